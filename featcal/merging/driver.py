"""The streaming driver of per-tensor merging methods: the model is merged one tensor at a time.

For every key of the base, integer buffers (``position_ids``) are copied from the base; for every
floating-point tensor the driver reads that one tensor of each expert (experts are usually lazily-read
:class:`~featcal.checkpoint.Checkpoint` objects), hands the kernel float32 copies, and casts the
kernel's result back to the base tensor's dtype. Memory stays bounded by ``len(experts)`` copies of
the largest tensor, whatever the method.

Under torchrun each process computes a share of the tensors, balanced by size
(:meth:`~featcal.distributed.World.owners`), and each merged tensor is then copied from the process
that computed it to all the others: every process ends with the same merge, bit for bit, as one
process computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from featcal.distributed import SINGLE, World
from featcal.merging.common import StateDict, is_mergeable, progress, read_experts, read_task_vectors

KERNEL_INPUTS = ("base", "task_vectors", "experts", "key")
"""The names a kernel's positional parameters may take, each naming what the driver passes:

* ``base``: θ0, the base tensor in float32;
* ``task_vectors``: τ = θ_t − θ0 stacked over the experts, float32 of shape (T, *θ0.shape);
* ``experts``: θ_t stacked over the experts, float32 of shape (T, *θ0.shape);
* ``key``: the tensor's name in the state dict (``model.embed_tokens.weight``), for a kernel whose rule
  depends on which tensor it merges.
"""


def merge_tensorwise(
    kernel: Callable[..., torch.Tensor],
    inputs: Sequence[str],
    base: StateDict,
    experts: Sequence[StateDict],
    params: Mapping[str, Any],
    *,
    desc: str,
    device: torch.device | None = None,
    world: World = SINGLE,
) -> dict[str, torch.Tensor]:
    """Merge ``experts`` into ``base`` by calling ``kernel(*inputs, **params)`` on each tensor.

    Args:
        kernel: The per-tensor function. It returns a tensor of θ0's shape; its arguments are fresh
            float32 copies, so it may overwrite them.
        inputs: The kernel's positional parameters, each one of :data:`KERNEL_INPUTS`.
        base: The base state dict.
        experts: The experts' state dicts, each with the base's keys.
        params: The validated hyper-parameters, passed as keyword arguments.
        desc: The progress bar's label.
        device: Where the kernel computes (default: the CPU, where the tensors are read); the merged
            tensors are returned on the CPU either way.
        world: Under torchrun, the processes that share the tensors.

    Returns:
        The merged state dict, with the base's keys, shapes and dtypes.

    Raises:
        ValueError: If the kernel returns a tensor of another shape (a bug in the kernel).
    """
    merged: dict[str, torch.Tensor] = {}
    keys = list(base)
    owner = _owners(base, keys, world)
    for key in progress([k for k in keys if owner.get(k, world.rank) == world.rank], desc):
        theta0 = base[key]
        if not is_mergeable(theta0):
            merged[key] = theta0.clone()
            continue
        result = kernel(*_kernel_inputs(base, experts, key, inputs, device), **params)
        if result.shape != theta0.shape:
            raise ValueError(
                f"merging kernel {desc!r} returned shape {tuple(result.shape)} for {key} {tuple(theta0.shape)}"
            )
        result = result.to(device=theta0.device, dtype=theta0.dtype)
        # A view into the stacked inputs (``experts[0]``) would keep all T copies alive: copy it out.
        merged[key] = result.clone() if result.untyped_storage().nbytes() > result.nbytes else result
    if world.distributed:
        for key in keys:  # in the base's order on every process: one copy per tensor from its owner
            if key in owner:
                if key not in merged:
                    merged[key] = torch.empty_like(base[key], device="cpu")
                world.broadcast_([merged[key]], src=owner[key], what=f"merging {key}")
        merged = {key: merged[key] for key in keys}
    return merged


def _owners(base: StateDict, keys: list[str], world: World) -> dict[str, int]:
    """The process that merges each floating-point tensor (none for one process)."""
    if not world.distributed:
        return {}
    mergeable = [key for key in keys if is_mergeable(base[key])]
    return dict(zip(mergeable, world.owners([base[key].numel() for key in mergeable])))


def _kernel_inputs(
    base: StateDict, experts: Sequence[StateDict], key: str, names: Sequence[str], device: torch.device | None
) -> list[torch.Tensor | str]:
    """The kernel's inputs ``names`` for one key: float32 tensors on ``device`` (each expert's tensor read once),
    and the key itself."""
    if "experts" not in names:
        theta0, task_vectors = read_task_vectors(base, experts, key, device)
        values = {"base": theta0, "task_vectors": task_vectors}
    else:
        values = {"experts": read_experts(experts, key, device)}
        if "base" in names or "task_vectors" in names:
            values["base"] = base[key].to(device=device, dtype=torch.float32, copy=True)
        if "task_vectors" in names:
            values["task_vectors"] = values["experts"] - values["base"]
    return [key if name == "key" else values[name] for name in names]
