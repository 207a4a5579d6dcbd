"""Release a run: export folder, model card, and a push to the Hugging Face Hub."""

from featcal.release.card import render_card, write_card
from featcal.release.check import Release, check_release
from featcal.release.export import export_release
from featcal.release.push import PushResult, push_release
from featcal.runfolder import RunFolder, read_run, recipe_sha256

__all__ = [
    "PushResult",
    "Release",
    "RunFolder",
    "check_release",
    "export_release",
    "push_release",
    "read_run",
    "recipe_sha256",
    "render_card",
    "write_card",
]
