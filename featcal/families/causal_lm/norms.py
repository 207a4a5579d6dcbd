"""Which normalisation a decoder's norm module computes, found by running it, not by its class name.

A norm the calibration can solve maps ``x`` to ``(offset + w)·z`` or ``w·z + b``, with ``z`` the RMS
normalisation ``x / rms(x)`` or the LayerNorm one ``(x − mean) / std`` and ``w``/``b`` its 1-D weight and
bias: Llama's RMSNorm (offset 0), Gemma's ``(1 + w)`` RMSNorm (offset 1), ``nn.LayerNorm`` with or without
bias, Cohere's bias-free LayerNorm. :func:`norm_form` runs a copy of the module on a random input with random
parameters and compares it with each form; the module's ``eps`` is read from its attributes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from featcal.calibration.adapters import Normalization

RMS, LAYER = "rms", "layer"
EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps")
_TOLERANCE = 1e-5
_PROBE_ROWS = 6


@dataclass(frozen=True)
class NormForm:
    """What a norm module computes: its normalisation (``rms`` or ``layer``), whether its affine has a bias,
    the offset of its scale (Gemma: 1) and its ``eps``."""

    kind: str
    has_bias: bool
    scale_offset: float
    eps: float

    def normalization(self) -> Normalization:
        """The calibration's view of this form."""
        normalize = rms_normalize(self.eps) if self.kind == RMS else layer_normalize(self.eps)
        return Normalization(normalize, has_bias=self.has_bias, scale_offset=self.scale_offset)


def rms_normalize(eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An RMSNorm's normalisation without its scale, in float32 as transformers computes it."""

    def normalize(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    return normalize


def layer_normalize(eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A LayerNorm's normalisation without its affine, in float32."""

    def normalize(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)

    return normalize


def module_eps(module: nn.Module) -> float | None:
    """A norm module's ``eps``, read from the attribute transformers' norms keep it in; None when none."""
    for name in EPS_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _affine_parameters(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A module's 1-D ``weight`` and optional 1-D ``bias`` when they are all its parameters, else None."""
    params = dict(module.named_parameters())
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
        return None
    if bias is not None and bias.shape != weight.shape:
        return None
    return weight, bias


@torch.no_grad()
def norm_form(module: nn.Module) -> NormForm | None:
    """What ``module`` computes, when it is a normalisation the calibration solves; None otherwise
    (an ``nn.Linear`` included).

    Args:
        module: A submodule of a decoder layer.

    Returns:
        Its :class:`NormForm`, found by running a float32 copy of it on a random input with random
        parameters, or None when it matches no form (or has no ``eps`` attribute).
    """
    if isinstance(module, nn.Linear):
        return None
    affine = _affine_parameters(module)
    eps = module_eps(module)
    if affine is None or eps is None:
        return None
    probe = copy.deepcopy(module)  # on the CPU, whatever device (or the meta device) the module is on
    probe = (probe.to_empty(device="cpu") if affine[0].is_meta else probe.cpu()).float()
    weight, bias = _affine_parameters(probe)
    dim = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    weight.copy_(torch.randn(dim, generator=generator))
    if bias is not None:
        bias.copy_(torch.randn(dim, generator=generator))
    x = torch.randn(_PROBE_ROWS, dim, generator=generator) * 3 + 1  # a mean far from 0: RMS and LayerNorm differ
    try:
        y = probe(x)
    except Exception:  # noqa: BLE001 - a module that does not run on one vector is no norm of these forms
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    shift = bias if bias is not None else 0.0
    candidates = [NormForm(kind, bias is not None, offset, eps) for kind in (RMS, LAYER) for offset in (0.0, 1.0)]
    for form in candidates:
        z = form.normalization().normalize(x)
        if torch.allclose(y.float(), (form.scale_offset + weight) * z + shift, rtol=_TOLERANCE, atol=_TOLERANCE):
            return form
    return None
