"""Release a run, or a model folder: one exporter, one model card renderer, one check, and a push to the Hugging
Face Hub.

Names are imported on first use, so the CLI's parser does not load huggingface_hub or jinja2
through this package.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    "DEFAULT_LICENSE": "featcal.release.options",
    "render_card": "featcal.release.run_card",
    "write_card": "featcal.release.card",
    "Release": "featcal.release.check",
    "check_release": "featcal.release.check",
    "export_release": "featcal.release.export",
    "PushResult": "featcal.release.push",
    "push_release": "featcal.release.push",
    "RunFolder": "featcal.runfolder",
    "read_run": "featcal.runfolder",
    "recipe_sha256": "featcal.runfolder",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
