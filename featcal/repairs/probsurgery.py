"""ProbSurgery ("Representation Surgery in Model Merging with Probabilistic Modeling", Wei et al., ICML 2025)
for CLIP vision merges, as the authors' code trains it (github.com/1998v7/ProbSurgery, ``code/src_ours/
merging_model.py``'s ``AlphaWrapper`` and ``code/run/run_ProbSurgery.py``'s ``train``).

The merge stays as it is. Each task t gets a probabilistic module on top of its representation z, the
merged model's projected image embedding as the projection gives it (not normalised: open_clip's
``encode_image``, which the authors' code reads):

    h = ReLU(P_t z),   μ = M_t h,   log σ² = V_t h,   ẑ = μ + ε ⊙ exp(½ log σ²),   z' = z − ẑ,

P_t: (hidden, dim) initialised as ``nn.Linear``'s weight (Kaiming uniform, a = √5), M_t and V_t: (dim,
hidden) at zero. Training minimises, per batch, mean |z' − z_t| (L1, z_t the expert's embedding of the same
images) plus ``kl_weight`` times the KL term mean_b(−½ Σ_d (1 + log σ² − μ² − σ²)); ε ~ N(0, I) is drawn
afresh at every forward. The loop is Surgery's (:func:`featcal.repairs.surgery.train_modules`: one Adam
over every module, lr, β (0.9, 0.999), no weight decay; per step, task by task, one batch). Published
defaults (``run.py``: ``--iter_number 50`` passes of 100 batches of 16 per task; ``--lr 0.001``,
``--hidden_layer 128``, ``--KL_weight 1e-4``): 5000 steps, batch 16, hidden width 128.

Seeds: the initial P_t from a generator seeded with ``seed`` (task by task), task i's batch order from
``seed + 1 + i`` (as Surgery), and ε from one generator seeded with ``seed + 1 + T`` (T tasks), drawn on
the CPU in training order, (batch, dim) per forward.

At test time the authors use the mean: z' = z − μ, which their classification head L2-normalises before
the zero-shot weights; evaluation here does the same (logits = scale · (z'/‖z'‖) · headᵀ).
The authors' loop evaluates on the test split every 100 steps and reports the best; featcal evaluates
the modules after the last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from featcal.merging.registry import HyperParameter
from featcal.options import Option, Range
from featcal.repairs.options import PROBSURGERY_NAME
from featcal.repairs.registry import REPAIRS, Repair
from featcal.repairs.surgery import SurgeryResult, train_modules

# A task's module: ``{task}.proj`` (hidden, dim), ``{task}.mean`` and ``{task}.log_var`` (dim, hidden).
PROJ, MEAN, LOG_VAR = "proj", "mean", "log_var"

PROBSURGERY = Repair(
    PROBSURGERY_NAME, "ProbSurgery", "https://github.com/1998v7/ProbSurgery",
    "Trains a probabilistic module per task on top of the merged representation (mean and log-variance "
    "heads, z − (μ + σ ε), L1 to the expert's representation plus a KL term) on each task's unlabeled "
    "calibration examples; evaluated with the mean, not released",
    (
        HyperParameter("hidden", int, 128, Option(range=Range(ge=1))),
        HyperParameter("steps", int, 5000, Option(range=Range(ge=1))),
        HyperParameter("learning_rate", float, 1e-3, Option(range=Range(gt=0))),
        HyperParameter("batch_size", int, 16, Option(range=Range(ge=1))),
        HyperParameter("kl_weight", float, 1e-4, Option(range=Range(ge=0))),
    ),
    uses_data=True, releasable=False,
)  # fmt: skip
REPAIRS.add(PROBSURGERY)


def initial_modules(tasks: Sequence[str], dim: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """Each task's module before training: P_t as ``nn.Linear(dim, hidden)``'s initial weight, M_t and V_t zero.

    Args:
        tasks: The task names, in order (the draws follow it).
        dim: The embedding width.
        hidden: The modules' hidden width.
        seed: The seed of the generator P_t's are drawn from.

    Returns:
        ``{task}.proj`` (hidden, dim), ``{task}.mean`` and ``{task}.log_var`` (dim, hidden), float32.
    """
    generator = torch.Generator().manual_seed(seed)
    modules: dict[str, torch.Tensor] = {}
    for task in tasks:
        proj = torch.empty(hidden, dim)
        torch.nn.init.kaiming_uniform_(proj, a=math.sqrt(5), generator=generator)
        modules[f"{task}.{PROJ}"] = proj
        modules[f"{task}.{MEAN}"], modules[f"{task}.{LOG_VAR}"] = torch.zeros(dim, hidden), torch.zeros(dim, hidden)
    return modules


def apply_mean(features: torch.Tensor, proj: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """z − M ReLU(P z) for each row z of ``features``: the module at test time (its mean), not re-normalised.

    Args:
        features: The merged model's embeddings (batch, dim).
        proj: P (hidden, dim).
        mean: M (dim, hidden).

    Returns:
        The repaired embeddings (batch, dim).
    """
    return features - F.relu(features @ proj.T) @ mean.T


def kl_term(mu: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """mean over the batch of −½ Σ_d (1 + log σ² − μ² − σ²): the KL divergence of N(μ, σ²) from N(0, I)."""
    return torch.mean(-0.5 * torch.sum(1 + log_var - mu**2 - log_var.exp(), dim=1), dim=0)


def train_probsurgery(
    merged: Mapping[str, torch.Tensor],
    experts: Mapping[str, torch.Tensor],
    *,
    hidden: int,
    steps: int,
    learning_rate: float,
    batch_size: int,
    kl_weight: float,
    seed: int,
    modules: Mapping[str, torch.Tensor] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SurgeryResult:
    """Train each task's probabilistic module (see the module docstring).

    Args:
        merged: Per task, the merged model's embeddings of its calibration examples (n_t, dim).
        experts: Per task, its expert's embeddings of the same examples, in the same order.
        hidden: The modules' hidden width.
        steps: Passes over the tasks, one batch of each task per pass.
        learning_rate: Adam's learning rate.
        batch_size: Examples per batch.
        kl_weight: The KL term's weight in the loss.
        seed: Seeds the initial modules (``seed``), task i's batch order (``seed + 1 + i``) and the noise
            (``seed + 1 + T``).
        modules: Initial modules (default :func:`initial_modules`).
        on_step: Called after each step with its number (for progress).

    Returns:
        The trained modules (on the CPU) and the loss curve (L1 plus the weighted KL term).

    Raises:
        InvalidParameterError: when a task has no examples or its expert's embeddings do not match.
    """
    tasks = list(merged)
    start = modules if modules is not None else initial_modules(tasks, merged[tasks[0]].shape[-1], hidden, seed)
    noise = torch.Generator().manual_seed(seed + 1 + len(tasks))

    def loss_of(
        params: Mapping[str, torch.Tensor], task: str, features: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        h = F.relu(features @ params[f"{task}.{PROJ}"].T)
        mu, log_var = h @ params[f"{task}.{MEAN}"].T, h @ params[f"{task}.{LOG_VAR}"].T
        eps = torch.randn(mu.shape, generator=noise).to(mu.device)
        sampled = eps * torch.exp(0.5 * log_var) + mu
        return F.l1_loss(features - sampled, target) + kl_weight * kl_term(mu, log_var)

    return train_modules(
        merged, experts, start, loss_of, steps=steps, learning_rate=learning_rate, batch_size=batch_size,
        seed=seed, on_step=on_step,
    )  # fmt: skip
