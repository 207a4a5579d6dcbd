"""Representation Surgery ("Representation Surgery for Multi-Task Model Merging", Yang et al., ICML 2024,
arXiv 2402.02705) for CLIP vision merges, as FusionBench 0.2.33 trains it
(``fusion_bench/method/surgery/``, ``fusion_bench/models/surgery/surgerymodelwrapper.py``).

The merge stays as it is. Each task t gets a low-rank module on top of its representation: with z the
merged model's L2-normalised projected image embedding, the repaired embedding is

    z' = z − U_t ReLU(D_t z),      D_t: (rank, dim), U_t: (dim, rank),

D_t initialised as ``nn.Linear``'s weight is (Kaiming uniform, a = √5), U_t at zero (so z' = z before
training). The modules are trained on unlabeled examples to bring z' close to the expert's own embedding
z_t of the same images: one Adam optimiser over every module (β = (0.9, 0.999), no weight decay), and at
each step, task by task, one batch of task t's examples, the loss mean |z' − z_t| (L1), a gradient step.
Published defaults: rank 16, 1000 steps, learning rate 1e-3, batch 16.

The models are frozen and run in eval mode, so z and z_t of each calibration example are computed once
and the steps read them. The examples are FeatCal's calibration draw of each task's train split. The
initial modules come from a generator seeded with ``seed`` (task by task in order: D_t's draw; U_t is
zero), and task t (its position i in the task list) reads its examples in an order of its own: each pass
over them is ``torch.randperm(n, generator)`` of a generator seeded with ``seed + 1 + i``, cut into
consecutive batches of ``batch_size`` (the last one of a pass shorter when n is not a multiple).

The result is not a model: evaluation applies task t's module to the merged model's embeddings before
task t's zero-shot head (logits = scale · z' · headᵀ, z' not re-normalised, as FusionBench's classifier).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from featcal.errors import InvalidParameterError
from featcal.families import task_schema
from featcal.families.base import ModelFamily
from featcal.merging.registry import HyperParameter
from featcal.options import Option, Range
from featcal.repairs.options import SURGERY_NAME
from featcal.repairs.registry import REPAIRS, Repair

DOWN, UP = "down", "up"  # the two matrices of a task's module: ``{task}.down`` (rank, dim), ``{task}.up``

SURGERY = Repair(
    SURGERY_NAME, "Representation Surgery", "https://arxiv.org/abs/2402.02705",
    "Trains a low-rank module per task on top of the merged representation, z − U ReLU(D z), to match the "
    "expert's representation (L1) on each task's unlabeled calibration examples; evaluated, not released",
    (
        HyperParameter("rank", int, 16, Option(range=Range(ge=1))),
        HyperParameter("steps", int, 1000, Option(range=Range(ge=1))),
        HyperParameter("learning_rate", float, 1e-3, Option(range=Range(gt=0))),
        HyperParameter("batch_size", int, 16, Option(range=Range(ge=1))),
    ),
    uses_data=True, releasable=False,
)  # fmt: skip
REPAIRS.add(SURGERY)


def check_surgery_family(family: ModelFamily, repair: Repair = SURGERY) -> None:
    """Refuse, before any work, a family a per-task module repair (Representation Surgery, ProbSurgery) is not
    defined for here: all but the families of image tasks (CLIP vision towers).

    Raises:
        InvalidParameterError: naming the repair and the family.
    """
    if task_schema(family.name) != "image":  # modules on a vision tower's image embeddings
        raise InvalidParameterError(
            "method", repair.name, f"a repair defined for {family.title} models (family {family.name}; `featcal "
            f"methods` lists the repairs): {repair.name} trains its modules on a CLIP vision merge's image "
            "embeddings only",
        )  # fmt: skip


def initial_modules(tasks: Sequence[str], dim: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Each task's module before training: D_t as ``nn.Linear(dim, rank)``'s initial weight, U_t zero.

    Args:
        tasks: The task names, in order (the draws follow it).
        dim: The embedding width.
        rank: The modules' inner width.
        seed: The seed of the generator D_t's are drawn from.

    Returns:
        ``{task}.down`` (rank, dim) and ``{task}.up`` (dim, rank) for each task, float32.
    """
    generator = torch.Generator().manual_seed(seed)
    modules: dict[str, torch.Tensor] = {}
    for task in tasks:
        down = torch.empty(rank, dim)
        torch.nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=generator)
        modules[f"{task}.{DOWN}"], modules[f"{task}.{UP}"] = down, torch.zeros(dim, rank)
    return modules


def apply_module(features: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """z − U ReLU(D z) for each row z of ``features``.

    Args:
        features: The merged model's embeddings (batch, dim).
        down: D (rank, dim).
        up: U (dim, rank).

    Returns:
        The repaired embeddings (batch, dim).
    """
    return features - F.relu(features @ down.T) @ up.T


def batch_order(n: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of example indices: each pass a ``randperm`` of a generator seeded with ``seed``.

    Args:
        n: The number of examples (> 0).
        batch_size: Indices per batch; a pass's last batch holds the rest.
        seed: The generator's seed.

    Yields:
        Index tensors.
    """
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(n, generator=generator).split(batch_size)


@dataclass(frozen=True)
class SurgeryResult:
    """Trained modules and the loss of each step.

    Attributes:
        modules: ``{task}.down`` and ``{task}.up`` for each task, float32.
        losses: ``losses[step][i]``: task i's loss at that step, before its update.
    """

    modules: dict[str, torch.Tensor]
    losses: list[list[float]]


def train_surgery(
    merged: Mapping[str, torch.Tensor],
    experts: Mapping[str, torch.Tensor],
    *,
    rank: int,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
    modules: Mapping[str, torch.Tensor] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SurgeryResult:
    """Train each task's module to bring the merged embeddings to the expert's (see the module docstring).

    Args:
        merged: Per task, the merged model's embeddings of its calibration examples (n_t, dim).
        experts: Per task, its expert's embeddings of the same examples, in the same order.
        rank: The modules' inner width.
        steps: Passes over the tasks, one batch of each task per pass.
        learning_rate: Adam's learning rate.
        batch_size: Examples per batch.
        seed: Seeds the initial modules (``seed``) and task i's batch order (``seed + 1 + i``).
        modules: Initial modules (default :func:`initial_modules`).
        on_step: Called after each step with its number (for progress).

    Returns:
        The trained modules (on the CPU) and the loss curve.

    Raises:
        InvalidParameterError: when a task has no examples or its expert's embeddings do not match.
    """
    tasks = list(merged)
    start = modules if modules is not None else initial_modules(tasks, merged[tasks[0]].shape[-1], rank, seed)

    def l1(params: Mapping[str, torch.Tensor], task: str, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(apply_module(features, params[f"{task}.{DOWN}"], params[f"{task}.{UP}"]), target)

    return train_modules(
        merged, experts, start, l1, steps=steps, learning_rate=learning_rate, batch_size=batch_size, seed=seed,
        on_step=on_step,
    )  # fmt: skip


def train_modules(
    merged: Mapping[str, torch.Tensor],
    experts: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    loss_of: Callable[[Mapping[str, torch.Tensor], str, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
    on_step: Callable[[int], None] | None = None,
) -> SurgeryResult:
    """The training loop Representation Surgery and ProbSurgery share: one Adam optimiser over every module
    (β = (0.9, 0.999), no weight decay); at each step, task by task, one batch of task i's examples (its
    order :func:`batch_order` seeded with ``seed + 1 + i``), the loss, a gradient step.

    Args:
        merged: Per task, the merged model's embeddings of its calibration examples (n_t, dim).
        experts: Per task, its expert's embeddings of the same examples, in the same order.
        start: The initial modules by key.
        loss_of: ``loss_of(params, task, features, target)``: a batch's loss under the current modules.
        steps: Passes over the tasks, one batch of each task per pass.
        learning_rate: Adam's learning rate.
        batch_size: Examples per batch.
        seed: Seeds task i's batch order (``seed + 1 + i``).
        on_step: Called after each step with its number (for progress).

    Returns:
        The trained modules (on the CPU) and the loss curve.

    Raises:
        InvalidParameterError: when a task has no examples or its expert's embeddings do not match.
    """
    tasks = list(merged)
    for task in tasks:
        if len(merged[task]) == 0 or merged[task].shape != experts[task].shape:
            raise InvalidParameterError(
                "tasks", task, "a task with calibration examples whose merged and expert embeddings match"
            )
    device = merged[tasks[0]].device
    params = {
        key: value.detach().to(device, torch.float32).clone().requires_grad_(True) for key, value in start.items()
    }
    optimizer = torch.optim.Adam(list(params.values()), lr=learning_rate, betas=(0.9, 0.999), weight_decay=0.0)
    orders = {task: batch_order(len(merged[task]), batch_size, seed + 1 + i) for i, task in enumerate(tasks)}
    losses: list[list[float]] = []
    for step in range(steps):
        row = []
        for task in tasks:
            index = next(orders[task]).to(device)
            loss = loss_of(params, task, merged[task][index], experts[task][index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            row.append(loss.item())
        losses.append(row)
        if on_step is not None:
            on_step(step)
    return SurgeryResult({key: value.detach().cpu() for key, value in params.items()}, losses)
