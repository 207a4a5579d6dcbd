"""The offline mini8 benchmark: eight procedural tasks, a small CLIP and its experts, built and cached.

>>> from featcal.benchmark import ZooConfig, build_zoo
>>> zoo = build_zoo(ZooConfig.mini8())          # doctest: +SKIP
>>> (zoo / "tasks.json").is_file()              # doctest: +SKIP
True
"""

from featcal.benchmark.config import ZOO_VERSION, ZooConfig
from featcal.benchmark.run import MINI8_DEFAULTS, demo_run_config
from featcal.benchmark.zoo import build_zoo, default_cache_dir, is_complete, zoo_path

__all__ = [
    "MINI8_DEFAULTS",
    "ZOO_VERSION",
    "ZooConfig",
    "build_zoo",
    "default_cache_dir",
    "demo_run_config",
    "is_complete",
    "zoo_path",
]
