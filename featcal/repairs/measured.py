"""A command measured from inside its own process: ``python -m featcal.repairs.measured REPORT [ARGS ...]``.

Runs ``featcal ARGS ...`` (with no ARGS, only imports what a repair's command imports: the floor every
repair's process pays) and then writes to the file ``REPORT`` the process's peak resident memory,
:func:`featcal.memory.host_peak_bytes`: the high-water mark of this process's own memory since it started
(``VmHWM``). ``ru_maxrss``, as ``wait4`` reports it to the parent, is not used: on Linux a child that Python
starts with vfork inherits its parent's high-water mark when it calls exec, so a child of a large parent
would report the parent's peak.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from featcal.memory import host_peak_bytes

FLOOR_MODULES = ("torch", "transformers", "featcal.stages", "featcal.repairs.catalog")


def main(argv: list[str]) -> int:
    """Run ``featcal argv[1:]`` (or import the floor's modules), then write the peak to ``argv[0]``."""
    import importlib

    report, args = Path(argv[0]), argv[1:]
    if args:
        from featcal.cli import main as featcal_main

        status = featcal_main(args)
    else:
        for module in FLOOR_MODULES:
            importlib.import_module(module)
        status = 0
    report.write_text(json.dumps({"peak_rss_bytes": host_peak_bytes()}))
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
