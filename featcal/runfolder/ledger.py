"""The stage ledger, ``stages.json``: which steps of a run finished, from which inputs, with which weights."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.files.atomic import atomic_write_json
from featcal.files.hashing import file_sha256
from featcal.runfolder.layout import STAGES_FILE


@dataclass
class StageLedger:
    """Which stages of a run folder are finished, from which inputs, and what each wrote.

    Kept in ``<run>/stages.json`` as ``{stage: {"identity": …, "outputs": [relative paths], "weights":
    {relative path: [size, sha256]}}}``. A stage whose recorded identity equals the one a new run
    computes, and whose weight files (``*.safetensors`` among its outputs) are still those it wrote, is
    skipped (an entry without ``weights`` is judged by its identity alone); a stage whose identity
    changed, whose weights were damaged or removed since, or that the new run cannot produce, has its
    outputs removed and is redone.
    With ``writes`` False (the processes of a torchrun run other than rank 0) it is kept in memory
    only: the same decisions, no file touched.
    """

    run: Path
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: bool = True
    _hashes: dict[tuple, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def read(cls, run: Path, *, writes: bool = True) -> StageLedger:
        path = Path(run) / STAGES_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except ValueError:
            data = {}
        entries = {str(k): v for k, v in (data.items() if isinstance(data, dict) else ()) if isinstance(v, dict)}
        return cls(Path(run), entries, writes)

    def is_done(self, stage: str, identity: str) -> bool:
        """Whether ``stage`` finished from inputs ``identity`` and its weight files are as it wrote them."""
        entry = self.done.get(stage) or {}
        if entry.get("identity") != identity:
            return False
        recorded = entry.get("weights")
        return recorded is None or recorded == self._weights(entry.get("outputs", []))

    def mark(self, stage: str, identity: str, outputs: list[str]) -> None:
        """Record ``stage`` as finished from inputs ``identity``, having written ``outputs``."""
        self.done[stage] = {"identity": identity, "outputs": outputs}
        # A process that does not write (torchrun ranks but 0) never reads this entry back in this run;
        # hashing there could race rank 0's rename of the folder into place.
        weights = self._weights(outputs) if self.writes else {}
        if weights:
            self.done[stage]["weights"] = weights
        self._write()

    def _weights(self, outputs: list[str]) -> dict[str, list]:
        """Size and SHA-256 of every ``*.safetensors`` file among ``outputs`` (in them, for folders)."""
        files: list[Path] = []
        for relative in outputs:
            path = self.run / relative
            files += (
                sorted(path.rglob("*.safetensors"))
                if path.is_dir()
                else [path]
                if path.suffix == ".safetensors"
                else []
            )
        return {f.relative_to(self.run).as_posix(): self._size_and_hash(f) for f in files if f.is_file()}

    def _size_and_hash(self, path: Path) -> list:
        """[size, sha256] of a file, hashed once per size and modification time."""
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = file_sha256(path)
        return [stat.st_size, self._hashes[key]]

    def discard(self, stage: str) -> None:
        """Remove ``stage``'s outputs and forget it."""
        entry = self.done.pop(stage, None) or {}
        if not self.writes:
            return
        for relative in entry.get("outputs", []):
            path = self.run / relative
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self._write()

    def _write(self) -> None:
        if self.writes:
            atomic_write_json(self.run / STAGES_FILE, dict(sorted(self.done.items())))
