"""Plain-text tables the subcommands print."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from featcal.hub.verification import HubFile


def file_table(files: Sequence[HubFile]) -> str:
    """The files a push sends (release or Space), one per line with its size, then the totals."""
    width = max((len(f.path_in_repo) for f in files), default=0)
    lines = [f"  {f.path_in_repo:<{width}}  {f.size:>13,d} bytes" for f in files]
    return "\n".join([*lines, f"  {len(files)} files, {sum(f.size for f in files):,d} bytes"])
