"""``featcal space`` and ``featcal space push``'s options: one definition each, the flags derived from them.

The options that mean what a run's option means (the base model, the tasks file, the suite, the
device) are the run spec's own, with the Space's defaults and help; the Hub's are
:class:`~featcal.hub.options.HubOptions`. This module imports no torch, Gradio or Hub client.
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal.options import field_option, option, validate
from featcal.space.settings import DEFAULT_MODEL_ID
from featcal.spec import RunSpec
from featcal.suites import suite_names

IMAGE_SUITES = suite_names("clip_vision")  # the Space classifies images: CLIP's suites

GROUP = "Space"
SUITE_HELP = "built-in CLIP suite whose tasks to offer (default: the model's run_config.json's, else ta8)"


@dataclass(frozen=True)
class SpaceServeOptions:
    """What ``featcal space`` serves, and where.

    Raises:
        InvalidParameterError: naming the option whose value does not fit (a port outside 1–65535).
    """

    model_id: str = option(
        DEFAULT_MODEL_ID,
        help="run folder (its release/ or featcal-*/), release or model folder, or Hub id",
        group=GROUP,
        metavar="DIR_OR_ID",
        flag="model",
        aliases=("model-id",),
    )
    base_model_id: str | None = field_option(
        RunSpec,
        "base_model_id",
        help="base CLIPModel for the text tower (default: the run's, else openai/clip-vit-base-patch32)",
        group=GROUP,
    )
    tasks_file: str | None = field_option(
        RunSpec,
        "tasks_file",
        help="JSON or YAML task table to offer instead of the built-in suite's tasks",
        group=GROUP,
    )
    suite: str | None = field_option(RunSpec, "suite", default=None, help=SUITE_HELP, group=GROUP, choices=IMAGE_SUITES)
    host: str = option("127.0.0.1", help="address to serve on (0.0.0.0 for all)", group=GROUP, metavar="HOST")
    port: int | None = option(
        None, help="port (default: Gradio's, 7860 or the next free one)", group=GROUP, metavar="PORT", ge=1, le=65535
    )
    share: bool = option(False, help="also open a public gradio.live link (off by default)", group=GROUP)
    device: str = field_option(RunSpec, "device", help="auto, cpu, cuda or cuda:N", group=GROUP)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class SpacePushOptions:
    """What ``featcal space push`` stages and publishes (besides :class:`~featcal.hub.options.HubOptions`).

    Raises:
        InvalidParameterError: naming the option whose value does not fit.
    """

    model_id: str = option(
        DEFAULT_MODEL_ID,
        help="Hub model the Space loads, written to space_config.json",
        group=GROUP,
        metavar="ID",
    )
    base_model_id: str | None = field_option(
        RunSpec,
        "base_model_id",
        help="base CLIP on the Hub (default: the model's run_config.json, else openai/clip-vit-base-patch32)",
        group=GROUP,
        metavar="ID",
    )
    tasks_file: str | None = field_option(
        RunSpec,
        "tasks_file",
        help="task table to ship with the Space instead of the built-in suite's tasks",
        group=GROUP,
    )
    suite: str | None = field_option(RunSpec, "suite", default=None, help=SUITE_HELP, group=GROUP, choices=IMAGE_SUITES)
    output: str | None = option(
        None, help="stage the Space in DIR (new or empty) and keep it", group=GROUP, metavar="DIR"
    )
    no_examples: bool = option(
        False, help="ship no example images (else one per task, from its test split)", group=GROUP
    )

    def __post_init__(self) -> None:
        validate(self)
