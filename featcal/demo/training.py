"""Training the benchmark's models: contrastive CLIP pretraining and per-task experts.

The base is a real ``transformers.CLIPModel`` pretrained on image-caption pairs of all tasks (the zoo
draws the pretraining images in another look than the test images, see ``featcal.demo.styles``); an
expert is its vision tower fine-tuned on one task through the frozen zero-shot head (the base's
text tower, templates and visual projection), the way the task-vector experts of the TA8 run were.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPModel, CLIPTokenizer

from featcal.progress import Progress

logger = logging.getLogger(__name__)

MAX_LOGIT_SCALE = 4.6052  # ln(100), CLIP's clamp


@dataclass(frozen=True)
class TaskTensors:
    """One task's images as pixel tensors with labels, and its prompts."""

    train_pixels: torch.Tensor
    train_labels: torch.Tensor
    test_pixels: torch.Tensor
    test_labels: torch.Tensor
    classnames: Sequence[str]
    templates: Sequence[str]


def text_embeddings(clip: CLIPModel, tokenizer: CLIPTokenizer, texts: Sequence[str]) -> torch.Tensor:
    """L2-normalised projected text embeddings of ``texts`` (with gradients when enabled)."""
    batch = tokenizer(list(texts), padding=True, return_tensors="pt")
    features = clip.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    features = getattr(features, "pooler_output", features)
    return F.normalize(features, dim=-1)


@torch.no_grad()
def zero_shot_head(
    clip: CLIPModel, tokenizer: CLIPTokenizer, classnames: Sequence[str], templates: Sequence[str]
) -> torch.Tensor:
    """Class embeddings [C, D]: mean over templates of normalised text embeddings, normalised again."""
    prompts = [template.format(name) for name in classnames for template in templates]
    emb = text_embeddings(clip, tokenizer, prompts).view(len(classnames), len(templates), -1)
    return F.normalize(emb.mean(dim=1), dim=-1)


def image_embeddings(vision: nn.Module, projection: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """L2-normalised projected image embeddings (the zero-shot image side)."""
    return F.normalize(projection(vision(pixel_values=pixels).pooler_output), dim=-1)


@torch.no_grad()
def accuracy(
    vision: nn.Module,
    projection: nn.Module,
    head: torch.Tensor,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int = 512,
) -> float:
    """Zero-shot top-1 accuracy of ``vision`` with class embeddings ``head``."""
    was_training = vision.training
    vision.eval()
    correct = 0
    for start in range(0, pixels.shape[0], batch_size):
        emb = image_embeddings(vision, projection, pixels[start : start + batch_size])
        correct += int((emb @ head.T).argmax(dim=-1).eq(labels[start : start + batch_size]).sum())
    vision.train(was_training)
    return correct / max(pixels.shape[0], 1)


def _cosine_lr(
    optimizer: torch.optim.Optimizer, peak: float, steps: int, warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(steps - warmup, 1)
        return 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _stratified_batch(sizes: Sequence[int], per_task: int, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(size, (per_task,), generator=generator) for size in sizes]


def pretrain_clip(
    clip: CLIPModel,
    tokenizer: CLIPTokenizer,
    data: Mapping[str, TaskTensors],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    text_lr_scale: float = 1.0,
    progress: bool = True,
) -> None:
    """Contrastive image-caption pretraining on the train images of all tasks, in place.

    Each step draws ``batch_size`` images (stratified over tasks) and, per class of every task, one
    caption from a random template of that task; the loss is CLIP's symmetric InfoNCE, with every
    image of a class counted as a positive of that class's caption. The text tower learns
    ``text_lr_scale`` times faster: its few hundred distinct captions otherwise lag behind.
    """
    generator = torch.Generator().manual_seed(seed)
    names = list(data)
    offsets, total = {}, 0
    for name in names:
        offsets[name] = total
        total += len(data[name].classnames)
    per_task = max(batch_size // len(names), 1)
    text = [p for n, p in clip.named_parameters() if n.startswith(("text_model.", "text_projection."))]
    text_ids = {id(p) for p in text}
    rest = [p for p in clip.parameters() if id(p) not in text_ids]
    optimizer = torch.optim.AdamW(
        [{"params": rest, "lr": lr}, {"params": text, "lr": lr * text_lr_scale}], lr=lr, weight_decay=0.1
    )
    schedule = _cosine_lr(optimizer, lr, steps, warmup=max(steps // 10, 1))
    clip.train()
    bar = Progress(range(steps), desc="mini8: pretraining CLIP", unit="steps", enabled=progress)
    for _ in bar:
        rows = _stratified_batch([data[n].train_labels.shape[0] for n in names], per_task, generator)
        pixels = torch.cat([data[n].train_pixels[r] for n, r in zip(names, rows)])
        labels = torch.cat([data[n].train_labels[r] + offsets[n] for n, r in zip(names, rows)])
        captions = []
        for name in names:
            task = data[name]
            picks = torch.randint(len(task.templates), (len(task.classnames),), generator=generator).tolist()
            captions += [task.templates[t].format(c) for c, t in zip(task.classnames, picks)]
        img = image_embeddings(clip.vision_model, clip.visual_projection, pixels)
        txt = text_embeddings(clip, tokenizer, captions)
        logits = clip.logit_scale.exp() * img @ txt.T
        loss_image = F.cross_entropy(logits, labels)
        present = torch.zeros(total, dtype=torch.bool)
        present[labels] = True
        targets = (labels[None, :] == torch.arange(total)[:, None]).float()[present]
        loss_text = F.cross_entropy(logits.T[present], targets / targets.sum(dim=1, keepdim=True))
        loss = (loss_image + loss_text) / 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            clip.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    clip.eval()


def finetune_expert(
    clip: CLIPModel,
    head: torch.Tensor,
    task: TaskTensors,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    frozen: Sequence[str] = (),
    desc: str = "expert",
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Fine-tune a copy of ``clip``'s vision tower on one task; returns its state dict.

    The zero-shot head (``head``, the base's visual projection and logit scale) stays frozen: only
    the vision tower learns, as for the task-vector experts of the TA8 run.
    """
    import copy

    generator = torch.Generator().manual_seed(seed)
    vision = copy.deepcopy(clip.vision_model).train()
    projection = clip.visual_projection.requires_grad_(False)
    scale = clip.logit_scale.detach().exp()
    trainable = [p for n, p in vision.named_parameters() if not n.startswith(tuple(frozen))]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    schedule = _cosine_lr(optimizer, lr, steps, warmup=max(steps // 10, 1))
    size = task.train_labels.shape[0]
    for _ in Progress(range(steps), desc=f"mini8: fine-tuning {desc}", unit="steps", leave=False, enabled=progress):
        rows = torch.randint(size, (batch_size,), generator=generator)
        logits = scale * image_embeddings(vision, projection, task.train_pixels[rows]) @ head.T
        loss = F.cross_entropy(logits, task.train_labels[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    projection.requires_grad_(True)
    return {k: v.detach().clone() for k, v in vision.eval().state_dict().items()}
