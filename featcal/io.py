"""Files that appear whole or not at all: atomic JSON/text writes and model folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import FeatcalError, InputError

if TYPE_CHECKING:
    import torch
    from transformers import CLIPVisionConfig

    from featcal.safetensors_writer import SafetensorsWriter


CHUNK = 1 << 20  # bytes read at a time when hashing a file


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex (what the Hub lists for a file stored in LFS).

    Args:
        path: The file.

    Returns:
        64 hex digits.
    """
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_text_input(path: Path, what: str) -> str:
    """The UTF-8 text of an input file the user named (a recipe, a tasks file, a card template).

    Args:
        path: The file.
        what: What it is, for messages (``"Recipe"``).

    Raises:
        InputError: for a missing file, a folder, a file that is not UTF-8 text or cannot be read.
    """
    if path.is_dir():
        raise InputError(path, f"{what} {path} is a folder, not a file.")
    if not path.is_file():
        raise InputError(path, f"{what} {path} does not exist.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(path, f"{what} {path} is not UTF-8 text: save it as UTF-8.") from None
    except OSError as exc:
        raise InputError(path, f"{what} {path} cannot be read ({exc.strerror or exc}).") from None


def current_umask() -> int:
    """The process's file-creation mask (read without changing it for long)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_if_created(path: str | Path, *, folder: bool = False) -> None:
    """Give ``path`` the permissions a plain ``open``/``mkdir`` would have: 0666/0777 less the umask.

    ``tempfile`` creates private files (0600) and folders (0700); what featcal renames into place
    from there is meant to be read by the user's group and the Hub client like any other output.
    """
    os.chmod(path, (0o777 if folder else 0o666) & ~current_umask())


def as_if_created_tree(folder: str | Path) -> None:
    """:func:`as_if_created` on ``folder`` and everything in it (libraries such as safetensors create
    their files private)."""
    folder = Path(folder)
    as_if_created(folder, folder=True)
    for path in folder.rglob("*"):
        as_if_created(path, folder=path.is_dir())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        as_if_created(tmp)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as strict JSON (``NaN`` and ``Infinity`` are refused with a ValueError)."""
    atomic_write_text(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def config_hash(data: Mapping[str, Any]) -> str:
    """A stable SHA-256 of a JSON-able mapping (sorted keys), naming a recipe."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL (or the signal ``FEATCAL_KILL_SIGNAL`` names, e.g. ``TERM``) at
    ``name`` when ``FEATCAL_KILL_AT`` names it, or raise a :class:`~featcal.errors.FeatcalError` there
    when ``FEATCAL_FAIL_AT`` names it.

    The resume tests use it to stop a run at chosen points, the way a rented machine's loss would;
    the multi-process tests restrict it to one process with ``FEATCAL_FAULT_RANK`` (torchrun's
    ``RANK``). Unset, it costs two environment lookups.
    """
    kill, fail = os.environ.get("FEATCAL_KILL_AT"), os.environ.get("FEATCAL_FAIL_AT")
    if name not in (kill, fail):
        return
    rank = os.environ.get("FEATCAL_FAULT_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    if kill == name:  # FEATCAL_KILL_SIGNAL=TERM sends a stop request instead of a kill
        os.kill(os.getpid(), getattr(signal, f"SIG{os.environ.get('FEATCAL_KILL_SIGNAL', 'KILL')}"))
    from featcal.errors import FeatcalError

    raise FeatcalError(f"Stopped at {name} as FEATCAL_FAIL_AT asks.")


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder into place, replacing any previous one."""
    fault_point(f"replace:{final.name}")
    if final.exists() and not final.is_dir():
        raise FeatcalError(f"{final} exists and is a file: choose another output folder.")
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def save_vision_model(state: Mapping[str, torch.Tensor], vision_config, folder: str | Path) -> Path:
    """Save a vision-tower state dict as a `transformers.CLIPVisionModel` folder, atomically.

    The model that writes the folder is built on the meta device and saves ``state`` itself: no second
    copy of the weights in memory and no random initialisation. Tensors are written in the model's
    parameter dtype, as loading them into a materialised model would.

    Raises:
        ValueError: when ``state`` lacks a tensor of the model, has one it does not know, or one of
            another shape.
    """
    model = _meta_vision_model(vision_config)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"Not the state of this CLIPVisionModel: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"other shapes {wrong[:3]}."
        )
    tensors = {k: v.detach().to(device="cpu", dtype=expected[k].dtype) for k, v in state.items()}
    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp, state_dict=tensors)
    return Path(folder)


@contextmanager
def streamed_vision_model(vision_config: CLIPVisionConfig, folder: str | Path) -> Iterator[SafetensorsWriter]:
    """A `transformers.CLIPVisionModel` folder written tensor by tensor, atomically.

    Args:
        vision_config: The model's configuration, written as ``config.json``.
        folder: The folder to write (replaced when it exists, once the block ends).

    Yields a :class:`~featcal.safetensors_writer.SafetensorsWriter` laid out for the model's state
    dict (its parameter dtype, keys as :func:`save_vision_model` writes them); every tensor must be
    written before the block ends. The folder appears, with the same ``config.json``, only then: a
    block that raises leaves nothing behind.

    Raises:
        ValueError: when the block ends with a tensor not written.
    """
    from featcal.safetensors_writer import SafetensorsWriter

    model = _meta_vision_model(vision_config)
    layout = {key: (value.dtype, tuple(value.shape)) for key, value in model.state_dict().items()}
    with atomic_folder(folder) as tmp:
        model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # as save_pretrained sets
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        writer = SafetensorsWriter(tmp / "model.safetensors", layout, {"format": "pt"})
        try:
            yield writer
            writer.close()
        finally:
            writer.discard()


def _meta_vision_model(vision_config: CLIPVisionConfig):
    """A `CLIPVisionModel` on the meta device: its state dict's keys, shapes and dtypes, no memory."""
    import torch
    from transformers import CLIPVisionModel

    with torch.device("meta"):
        return CLIPVisionModel(vision_config)


@contextmanager
def atomic_folder(folder: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``folder`` (``.name.XXXX``, which a run's leftover clean-up knows) to
    write into; renamed to ``folder``, replacing it, when the block ends (what it holds given the
    permissions of files created under the umask: mkdtemp and safetensors create private ones), and
    removed when it raises.

    Args:
        folder: The folder to write.

    Yields:
        The temporary folder.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        yield tmp
        as_if_created_tree(tmp)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
