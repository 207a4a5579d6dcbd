"""The offline mini8 benchmark: eight procedural tasks, a small CLIP and its experts, built and cached.

>>> from featcal.demo import ZooConfig, build_zoo
>>> zoo = build_zoo(ZooConfig.mini8())          # doctest: +SKIP
>>> (zoo / "tasks.json").is_file()              # doctest: +SKIP
True

Names are imported on first use, so ``featcal --help`` does not load torch through this package.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    "MINI8_DEFAULTS": "featcal.demo.run_spec",
    "demo_run_spec": "featcal.demo.run_spec",
    "ZOO_VERSION": "featcal.demo.config",
    "ZooConfig": "featcal.demo.config",
    "build_zoo": "featcal.demo.zoo",
    "default_cache_dir": "featcal.demo.cache",
    "is_complete": "featcal.demo.zoo",
    "zoo_path": "featcal.demo.cache",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
