"""The training loop of the text benchmarks' models (lm5's Llamas, t5x4's T5s): AdamW, warm-up, cosine decay.

The loop knows nothing of the model's kind: the caller gives the loss of one random batch, drawn from the
loop's generator, so the same steps train a causal LM on texts and an encoder-decoder on (input, target)
pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from featcal.progress import Progress


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up over the first tenth of ``steps``, then a cosine decay to 0.

    Args:
        optimizer: The optimiser whose learning rate is scheduled.
        steps: The optimiser steps of the whole training.

    Returns:
        The scheduler (step it once per optimiser step).
    """
    warmup = max(steps // 10, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + torch.cos(torch.tensor((step - warmup) / max(steps - warmup, 1) * torch.pi)).item())

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fit(
    model: nn.Module,
    batch_loss: Callable[[torch.Generator], torch.Tensor],
    *,
    steps: int,
    lr: float,
    seed: int,
    frozen: Sequence[str] = (),
    desc: str = "training",
    progress: bool = True,
) -> None:
    """AdamW (no weight decay, betas 0.9/0.98, gradients clipped at norm 1) on ``batch_loss``, in place.

    Args:
        model: The model; left in eval mode.
        batch_loss: The loss of one random batch, drawn with the generator it is given.
        steps: Optimiser steps.
        lr: Peak learning rate (:func:`warmup_cosine`).
        seed: Seeds the generator the batches are drawn with.
        frozen: Parameter-name prefixes that keep their values.
        desc: The progress bar's label.
        progress: Show a progress bar.
    """
    generator = torch.Generator().manual_seed(seed)
    trainable = [p for n, p in model.named_parameters() if not n.startswith(tuple(frozen))]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = warmup_cosine(optimizer, steps)
    model.train()
    bar = Progress(range(steps), desc=desc, unit="steps", leave=False, enabled=progress)
    for _ in bar:
        loss = batch_loss(generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
