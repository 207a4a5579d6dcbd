"""``featcal demo``'s options: the zoo to build and where, and the run's few options it offers.

The options that mean what a run's option means (device, threads, Task Arithmetic's κ, the export) are
the run spec's own, with the demo's defaults; this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal.options import field_option, option, validate
from featcal.spec import RunSpec

GROUP = "demo"
# the benchmark zoos `featcal demo --zoo` builds: mini8 (CLIP, image tasks), lm5 (a tiny Llama, text tasks),
# t5x4 (a tiny T5, text-to-text tasks)
ZOOS = ("mini8", "lm5", "t5x4")
TEXT_ZOOS = ("lm5", "t5x4")  # zoos whose base is scored as it is, not through zero-shot heads: "base"
DEFAULT_OUTPUT_DIR = "outputs/mini8"  # outputs/<zoo>: the default zoo's
# Task Arithmetic's κ on mini8: the reference run's, measured on the zoo in benchmarks/mini8.md.
MINI8_SCALING_FACTOR = 0.3


@dataclass(frozen=True)
class DemoOptions:
    """What ``featcal demo`` builds and runs.

    Raises:
        InvalidParameterError: naming the option whose value does not fit.
    """

    output_dir: str | None = field_option(RunSpec, "output_dir", default=None, help="run folder (default outputs/ZOO)")
    zoo: str = option(
        "mini8", help="the benchmark: mini8 (a small CLIP, eight image tasks), lm5 (a tiny Llama, five text "
        "tasks with exact-match answers) or t5x4 (a tiny T5, four text-to-text tasks answered with label words)",
        group=GROUP, metavar="ZOO", choices=ZOOS,
    )  # fmt: skip
    zoo_seed: int = option(0, help="seed the zoo is generated from", group=GROUP, metavar="SEED", ge=0)
    tiny: bool = option(False, help="the reduced version of the zoo, the test suite's (faster, weaker)", group=GROUP)
    rebuild: bool = option(False, help="rebuild the zoo even if it is cached", group=GROUP)
    zoo_cache_dir: str | None = option(
        None,
        help="folder the zoo is built into and cached in (default $FEATCAL_CACHE, else $XDG_CACHE_HOME/featcal, "
        "else ~/.cache/featcal)",
        group=GROUP,
        metavar="DIR",
        aliases=("cache-dir",),
    )
    device: str = field_option(RunSpec, "device", default="cpu", help="cpu, cuda or cuda:N")
    threads: int | None = field_option(
        RunSpec,
        "threads",
        help="torch CPU threads for the run (default: one, the models are small); the zoo is always built on "
        "one thread, so that a seed gives the same zoo on every build",
    )
    ta_scaling_factor: float = field_option(
        RunSpec, "ta_scaling_factor", default=MINI8_SCALING_FACTOR, help="Task Arithmetic κ"
    )
    no_export: bool = field_option(RunSpec, "no_export")

    def __post_init__(self) -> None:
        validate(self)

    @property
    def run_folder(self) -> str:
        """The run folder: ``output_dir``, else ``outputs/<zoo>``."""
        return self.output_dir or f"outputs/{self.zoo}"
