"""The FeatCal driver: layer by layer, in forward order, statistics then closed-form solves.

Architecture-agnostic: everything model-specific comes from an adapter
(:mod:`featcal.calibration.adapters`). Feature streams stay on the compute device; experts are read
one layer at a time from (memory-mapped) state dicts, so memory does not grow with their size.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.calibration.adapters import ArchitectureAdapter, CLIPVisionAdapter, TokenWeighting
from featcal.calibration.solves import LayerNormSystem, LinearSystem, anchor
from featcal.calibration.statistics import LayerNormMoments, LinearMoments
from featcal.errors import FeatcalError

logger = logging.getLogger(__name__)

StateDict = Mapping[str, torch.Tensor]
Moments = LinearMoments | LayerNormMoments


@dataclass(frozen=True)
class FeatCalParams:
    """FeatCal hyper-parameters; the defaults are the published reference run's."""

    num_calibration_examples: int = 256
    calibration_batch_size: int = 16
    lambda_ratio: float = 0.05
    anchor_blend_rho: float = 2.2
    teacher_interp_alpha: float = 0.25
    covariance_eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.num_calibration_examples < 1 or self.calibration_batch_size < 1:
            raise FeatcalError("--num-calibration-examples and --calibration-batch-size must be at least 1.")
        if self.lambda_ratio < 0 or self.covariance_eps < 0:
            raise FeatcalError("--lambda-ratio and --covariance-eps must be non-negative.")

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _load_params(module: nn.Module, source: StateDict, prefix: str) -> None:
    """Copy ``source[prefix + name]`` into each parameter and buffer of ``module`` (strict)."""
    own = module.state_dict()
    state = {}
    for name, current in own.items():
        key = prefix + name
        if key not in source:
            raise FeatcalError(f"Checkpoint has no tensor {key!r} needed for calibration.")
        state[name] = source[key].to(device=current.device, dtype=current.dtype)
    module.load_state_dict(state, strict=True)


class _InputRecorder:
    """Forward pre-hooks that keep the latest input of each named submodule."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            self.inputs[name] = args[0]
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class FeatCalibrator:
    """Runs FeatCal on one merged model. Use :func:`featcal_calibrate` for the one-call form."""

    def __init__(self, params: FeatCalParams, *, adapter: ArchitectureAdapter | None = None,
                 device: torch.device | str = "cpu", stats_dtype: torch.dtype = torch.float64,
                 progress: bool = True) -> None:
        self.params = params
        self.adapter = adapter or CLIPVisionAdapter()
        self.device = torch.device(device)
        self.stats_dtype = stats_dtype
        self.progress = progress

    # -- streams ---------------------------------------------------------------------------
    @torch.no_grad()
    def _first_inputs(self, model: nn.Module, expert: StateDict, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stem = self.adapter.stem(model)
        expert_stem = copy.deepcopy(stem)
        for prefix in self.adapter.stem_prefixes():
            _load_params(getattr(expert_stem, prefix.rstrip(".")), expert, prefix)
        bs = self.params.calibration_batch_size
        dtype = next(model.parameters()).dtype
        student, teacher = [], []
        for start in range(0, pixels.shape[0], bs):
            px = pixels[start:start + bs].to(self.device, dtype)
            student.append(self.adapter.run_stem(stem, px))
            teacher.append(self.adapter.run_stem(expert_stem, px))
        return torch.cat(student), torch.cat(teacher)

    @torch.no_grad()
    def _advance(self, layer: nn.Module, stream: torch.Tensor) -> None:
        """Replace ``stream`` in place by ``layer``'s output, batch by batch."""
        bs = self.params.calibration_batch_size
        for start in range(0, stream.shape[0], bs):
            stream[start:start + bs] = self.adapter.run_layer(layer, stream[start:start + bs])

    # -- statistics ------------------------------------------------------------------------
    @torch.no_grad()
    def _collect(self, layer: nn.Module, expert_layer: nn.Module, student: torch.Tensor, expert: torch.Tensor,
                 weighting: Mapping[str, TokenWeighting]) -> dict[str, Moments]:
        """One task's statistics for every calibrated submodule of one layer; advances ``expert``.

        Submodules that read the same input tensor with the same token weights (q, k, v) share
        one set of sums.
        """
        modules = self.adapter.calibrated_modules(layer)
        rec_s = _InputRecorder(modules)
        rec_e = _InputRecorder(self.adapter.calibrated_modules(expert_layer))
        leader: dict[str, str] = {}
        moments: dict[str, Moments] = {}
        bs = self.params.calibration_batch_size
        try:
            for start in range(0, student.shape[0], bs):
                self.adapter.run_layer(layer, student[start:start + bs])
                out_e = self.adapter.run_layer(expert_layer, expert[start:start + bs])
                if not leader:
                    leader = self._group(modules, rec_s.inputs, rec_e.inputs, weighting)
                for name, module in modules.items():
                    if leader[name] != name:
                        continue
                    xs, xe = rec_s.inputs[name], rec_e.inputs[name]
                    w = weighting[name].weights
                    if isinstance(module, nn.LayerNorm):
                        acc = moments.setdefault(name, LayerNormMoments.zeros(xs.shape[-1], device=self.device, dtype=self.stats_dtype))
                        acc.add(xs, module.eps, w)
                    else:
                        acc = moments.setdefault(name, LinearMoments.zeros(xs.shape[-1], device=self.device, dtype=self.stats_dtype))
                        acc.add(xs, xe, w)
                expert[start:start + bs] = out_e
        finally:
            rec_s.remove()
            rec_e.remove()
        return {name: moments[leader[name]] for name in modules}

    @staticmethod
    def _group(modules, inputs_s, inputs_e, weighting) -> dict[str, str]:
        """Map each submodule to the first submodule that reads the very same inputs and weights."""
        seen: dict[tuple, str] = {}
        leader = {}
        for name, module in modules.items():
            key = (type(module), id(inputs_s[name]), id(inputs_e[name]), weighting[name].key)
            leader[name] = seen.setdefault(key, name)
        return leader

    # -- the layer loop --------------------------------------------------------------------
    @torch.no_grad()
    def calibrate(self, merged: nn.Module, base: StateDict, experts: Mapping[str, StateDict],
                  load_images: Callable[[str], torch.Tensor]) -> nn.Module:
        """A calibrated copy of ``merged``; ``load_images(task)`` gives the task's calibration pixels."""
        p = self.params
        model = copy.deepcopy(merged).to(self.device).eval()
        tasks = list(experts)
        streams: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for task in tqdm(tasks, desc="FeatCal: first-layer inputs", disable=not self.progress):
            streams[task] = self._first_inputs(model, experts[task], load_images(task))
        layers = self.adapter.layers(model)
        num_layers = len(layers)
        expert_layer = copy.deepcopy(layers[0])
        for index in tqdm(range(num_layers), desc="FeatCal: layers", disable=not self.progress):
            layer, prefix = layers[index], self.adapter.layer_prefix(index)
            modules = self.adapter.calibrated_modules(layer)
            seq_len = streams[tasks[0]][0].shape[1]
            weighting = {n: self.adapter.token_weighting(n, index, num_layers, seq_len) for n in modules}
            systems = {
                name: LayerNormSystem.empty(m.normalized_shape[0], device=self.device, dtype=self.stats_dtype)
                if isinstance(m, nn.LayerNorm)
                else LinearSystem.empty(m.out_features, m.in_features, m.bias is not None, device=self.device, dtype=self.stats_dtype)
                for name, m in modules.items()
            }
            for task in tqdm(tasks, desc=f"layer {index}: statistics", leave=False, disable=not self.progress):
                _load_params(expert_layer, experts[task], prefix)
                student, expert = streams[task]
                moments = self._collect(layer, expert_layer, student, expert, weighting)
                expert_modules = self.adapter.calibrated_modules(expert_layer)
                for name, system in systems.items():
                    em = expert_modules[name]
                    if isinstance(system, LayerNormSystem):
                        system.add_task(moments[name], em.weight, em.bias)
                    else:
                        system.add_task(moments[name], em.weight, em.bias, alpha=p.teacher_interp_alpha, eps=p.covariance_eps)
            self._solve_into(modules, systems, base, prefix)
            if index < num_layers - 1:
                for student, _ in streams.values():
                    self._advance(layer, student)
            logger.debug("FeatCal: layer %d calibrated", index)
        return model

    def _solve_into(self, modules: Mapping[str, nn.Module], systems: Mapping[str, LinearSystem | LayerNormSystem],
                    base: StateDict, prefix: str) -> None:
        """Solve every submodule of one layer from the un-updated values, then write all at once."""
        p = self.params
        solved: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name, module in modules.items():
            base_w = base[f"{prefix}{name}.weight"].to(self.device)
            a_w = anchor(module.weight.to(self.stats_dtype), base_w.to(self.stats_dtype), p.anchor_blend_rho)
            a_b = None
            if module.bias is not None:
                base_b = base[f"{prefix}{name}.bias"].to(self.device)
                a_b = anchor(module.bias.to(self.stats_dtype), base_b.to(self.stats_dtype), p.anchor_blend_rho)
            solved[name] = systems[name].solve(a_w, a_b, lam=p.lambda_ratio, eps=p.covariance_eps)
        for name, (weight, bias) in solved.items():
            module = modules[name]
            if not torch.isfinite(weight).all() or (bias is not None and not torch.isfinite(bias).all()):
                raise FeatcalError(f"FeatCal produced non-finite values for {prefix}{name}; check the inputs "
                                   "(non-finite expert weights or features) or raise --lambda-ratio.")
            module.weight.copy_(weight.to(module.weight.dtype))
            if bias is not None:
                module.bias.copy_(bias.to(module.bias.dtype))


def featcal_calibrate(merged: nn.Module, base: StateDict, experts: Mapping[str, StateDict],
                      load_images: Callable[[str], torch.Tensor], params: FeatCalParams | None = None,
                      **kwargs) -> nn.Module:
    """A calibrated copy of ``merged`` (see :class:`FeatCalibrator` for the keyword arguments)."""
    return FeatCalibrator(params or FeatCalParams(), **kwargs).calibrate(merged, base, experts, load_images)
