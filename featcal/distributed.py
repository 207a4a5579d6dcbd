"""Runs over several processes started by ``torchrun``: the process group, shards and collectives.

``torchrun --nproc-per-node N -m featcal …`` starts N copies of the command with ``WORLD_SIZE``,
``RANK`` and ``LOCAL_RANK`` set. :func:`session` reads them, checks the device, and starts PyTorch's
process group: gloo on the CPU, nccl on CUDA, where each process computes on the GPU of its
``LOCAL_RANK``. It yields a :class:`World`, which the library passes down: shards of the work
(:meth:`World.part`, :meth:`World.owns`, :meth:`World.owners`), sums over processes
(:meth:`World.all_reduce_sum_`), copies from one process to all (:meth:`World.broadcast_`).
Collectives move tensors only; no Python object is pickled.

One process started without torchrun gets :data:`SINGLE`: every helper is then a no-op, and
``torch.distributed`` is never imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from featcal.devices import resolve_device
from featcal.errors import DistributedError, InvalidParameterError

if TYPE_CHECKING:
    import torch

WORLD_SIZE_ENV, RANK_ENV, LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV = "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(0, f"The environment variable {name}={raw!r} is not a whole number; "
                               "start multi-process runs with torchrun.") from None  # fmt: skip


def launched() -> tuple[int, int]:
    """``(rank, world size)`` of this process as torchrun set them; ``(0, 1)`` without torchrun.

    Reads the environment only (no torch import), so the CLI can call it before anything else.
    """
    size = _env_int(WORLD_SIZE_ENV, 1)
    return (_env_int(RANK_ENV, 0), size) if size > 1 else (0, 1)


@dataclass(frozen=True)
class World:
    """The processes of one run and this process's place among them.

    Args:
        rank: This process's rank, 0 to ``size - 1``; rank 0 alone writes files, logs and progress.
        size: The number of processes (torchrun's ``WORLD_SIZE``).
        local_rank: The rank among the processes of this machine (the GPU a CUDA run uses).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); None for one process.
        device: Where this process computes and where collectives move tensors; None for one process.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device | None = None

    @property
    def distributed(self) -> bool:
        """Whether there are several processes."""
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one process that writes files, logs and progress."""
        return self.rank == 0

    def record(self) -> dict[str, Any] | None:
        """What ``run_config.json`` records of the processes (``world_size``, ``backend``); None for one."""
        return {"world_size": self.size, "backend": self.backend} if self.distributed else None

    def compute_device(self, name: str) -> torch.device:
        """The device this process computes on: ``name`` resolved for one process, else the rank's own.

        Raises:
            InvalidParameterError: for a device name that is not a device or not available.
        """
        if self.device is not None:
            return self.device
        return resolve_device(name)

    # -- shards ----------------------------------------------------------------------------
    def part(self, count: int) -> slice:
        """This rank's contiguous part of ``count`` items; parts differ in length by one at most."""
        return slice(count * self.rank // self.size, count * (self.rank + 1) // self.size)

    def owns(self, index: int) -> bool:
        """Whether item ``index`` of a round-robin split is this rank's."""
        return index % self.size == self.rank

    def owners(self, sizes: Sequence[int]) -> list[int]:
        """The rank that computes each item, balancing the sizes: largest first, to the least loaded.

        The same on every rank (ties go to the lower rank and the earlier item).
        """
        loads = [0] * self.size
        owners = [0] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            rank = min(range(self.size), key=lambda r: (loads[r], r))
            owners[index] = rank
            loads[rank] += sizes[index]
        return owners

    # -- collectives -----------------------------------------------------------------------
    @contextmanager
    def _collective(self, what: str) -> Iterator[Any]:
        """``torch.distributed``, with a failed or timed-out collective raised as a DistributedError."""
        import torch.distributed as dist

        try:
            yield dist
        except RuntimeError as exc:  # DistBackendError and gloo's timeouts are RuntimeErrors
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DistributedError(
                self.rank,
                f"{what} failed: another process stopped, or did not answer within `dist_timeout` seconds "
                f"({detail[:200]}).",
            ) from None

    def barrier(self, what: str = "waiting for the other processes") -> None:
        """Wait until every rank gets here."""
        if self.distributed:
            with self._collective(what) as dist:
                dist.barrier()

    @contextmanager
    def main_first(self, what: str = "waiting for rank 0") -> Iterator[None]:
        """Rank 0 runs the block first (downloads, cache writes), then the others do."""
        if not self.distributed:
            yield
            return
        if not self.is_main:
            self.barrier(what)
        yield
        if self.is_main:
            self.barrier(what)

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor], what: str = "summing over processes") -> None:
        """Replace each tensor by its sum over the ranks, in place, in its own dtype.

        Tensors of one dtype travel in one flat buffer: one collective per dtype.
        """
        if not self.distributed:
            return
        import torch

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with self._collective(what) as dist:
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1).to(self.device) for t in group])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                for tensor, part in zip(group, flat.split([t.numel() for t in group])):
                    tensor.copy_(part.view_as(tensor))

    def broadcast_(
        self, tensors: Sequence[torch.Tensor], src: int = 0, what: str = "copying between processes"
    ) -> None:
        """Overwrite each tensor, in place, with rank ``src``'s."""
        if not self.distributed:
            return
        with self._collective(what) as dist:
            for tensor in tensors:
                if tensor.device == self.device:
                    dist.broadcast(tensor, src=src)
                else:
                    moved = tensor.to(self.device)
                    dist.broadcast(moved, src=src)
                    tensor.copy_(moved)


SINGLE = World()
"""The world of one process started without torchrun."""


def _device_kind(name: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a multi-process run's ``device`` option."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidParameterError("device", name, "auto, cpu or cuda") from None
    if device.type not in BACKENDS:
        raise InvalidParameterError("device", name, "auto, cpu or cuda: several processes run on gloo or nccl")
    if device.index is not None:
        raise InvalidParameterError(
            "device", name, "cpu, cuda or auto without an index: under torchrun each process uses the GPU of its "
            "LOCAL_RANK",
        )  # fmt: skip
    return device.type


def start(device: str = "auto", timeout_s: float = 1800.0) -> World:
    """Start the process group torchrun set up, after checking ``device``; :data:`SINGLE` without torchrun.

    Args:
        device: The run's ``device`` option: ``auto``, ``cpu`` (gloo) or ``cuda`` (nccl, one GPU per process).
        timeout_s: How long a collective waits for the other processes before failing.

    Returns:
        This process's world.

    Raises:
        InvalidParameterError: a device that is not ``auto``, ``cpu`` or ``cuda``, or fewer GPUs than
            processes on this machine.
        DistributedError: the process group did not start (e.g. ``WORLD_SIZE`` set without torchrun).
    """
    rank, size = launched()
    if size == 1:
        return SINGLE
    import torch

    local_rank = _env_int(LOCAL_RANK_ENV, rank)
    local_size = _env_int(LOCAL_WORLD_SIZE_ENV, size)
    kind = _device_kind(device)
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidParameterError("device", device, "cpu or auto, since torch sees no GPU")
        if count < local_size:
            raise InvalidParameterError(
                "device", device, f"cpu, or cuda with one GPU per process: torchrun starts {local_size} processes "
                f"on this machine and torch sees {count} GPU(s); start at most {count} with --nproc-per-node",
            )  # fmt: skip
        where = torch.device("cuda", local_rank)
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    backend = BACKENDS[kind]
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s), rank=rank, world_size=size
        )  # fmt: skip
    except (RuntimeError, ValueError) as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DistributedError(
            rank, f"The {backend} process group of {size} processes did not start ({detail[:200]}); start "
            "multi-process runs with torchrun.",
        ) from None  # fmt: skip
    return World(rank=rank, size=size, local_rank=local_rank, backend=backend, device=where)


@contextmanager
def session(device: str = "auto", timeout_s: float = 1800.0) -> Iterator[World]:
    """:func:`start` the processes' world for a command, and close the process group when it succeeds.

    After a failure the process group is left to the process's exit: torchrun stops the others.
    """
    world = start(device, timeout_s)
    yield world
    if world.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
