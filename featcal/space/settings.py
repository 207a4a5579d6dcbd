"""What the Space loads and how it behaves: defaults, the pushed ``space_config.json``, environment."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError
from featcal.files.reading import read_text_input

DEFAULT_MODEL_ID = "yanggangu/wudi-featcal-b32-ta8"
DEFAULT_BASE_MODEL_ID = "openai/clip-vit-base-patch32"
PAPER_URL = "https://arxiv.org/abs/2605.13030"
CONFIG_FILE = "space_config.json"
EXAMPLES_DIR = "examples"

# Environment variables (Space variables in the Hub's settings) override space_config.json.
ENV_KEYS = {"model_id": "MODEL_ID", "base_model_id": "BASE_MODEL_ID", "tasks_file": "TASKS_FILE", "suite": "SUITE"}


@dataclass(frozen=True)
class SpaceSettings:
    """The Space's model references and limits.

    ``base_model_id`` None means: the base named in the model's ``run_config.json`` when it has one
    usable here, else :data:`DEFAULT_BASE_MODEL_ID`. ``tasks_file`` None means the tasks of the built-in
    ``suite`` (``ta8``, ``ta14``, ``ta20``); ``suite`` None means the one the model's ``run_config.json``
    records, else ``ta8``.
    Relative ``tasks_file`` and ``examples_dir`` paths resolve against ``app_dir``. ``heads_cache`` is
    where class embeddings are kept between starts (None: ``~/.cache/featcal/space-heads``).
    ``max_megapixels`` bounds the frame an upload declares (the classifier sees 224×224 pixels of it;
    docs/space.md gives the reasons for the number).
    """

    model_id: str = DEFAULT_MODEL_ID
    base_model_id: str | None = None
    tasks_file: str | None = None
    suite: str | None = None
    app_dir: Path | None = None
    examples_dir: str = EXAMPLES_DIR
    device: str = "auto"
    heads_cache: str | None = None
    max_file_mb: float = 10.0
    max_megapixels: float = 8.0
    concurrency_limit: int = 2
    queue_size: int = 32
    top_k: int = 5

    def path(self, value: str) -> Path:
        """``value`` as a path, relative ones against ``app_dir`` (or the working directory)."""
        path = Path(value).expanduser()
        return path if path.is_absolute() or self.app_dir is None else self.app_dir / path

    def to_config(self) -> dict[str, Any]:
        """The JSON that `featcal space push` writes as ``space_config.json``."""
        config = {k: v for k, v in asdict(self).items() if k not in {"app_dir", "device", "heads_cache"}}
        if config["suite"] is None:  # as before suites existed: the model's own, else ta8
            del config["suite"]
        return config

    @classmethod
    def from_app_dir(cls, app_dir: str | Path, environ: Mapping[str, str] | None = None) -> SpaceSettings:
        """Settings of the app in ``app_dir``: its ``space_config.json``, then the environment (:data:`ENV_KEYS`)."""
        app_dir = Path(app_dir).resolve()
        values: dict[str, Any] = {}
        config = app_dir / CONFIG_FILE
        if config.is_file():
            try:
                values = json.loads(read_text_input(config, "Space settings file"))
            except json.JSONDecodeError as exc:
                raise FeatcalError(
                    f"{config} is not valid JSON ({exc}): fix it or delete it to use the defaults."
                ) from None
            allowed = set(cls.__dataclass_fields__) - {"app_dir"}
            if not isinstance(values, dict) or set(values) - allowed:
                raise FeatcalError(f"{config}: expected a JSON object with keys among {sorted(allowed)}.")
        environ = os.environ if environ is None else environ
        for field, key in ENV_KEYS.items():
            if environ.get(key):
                values[field] = environ[key]
        return replace(cls(app_dir=app_dir), **values)
