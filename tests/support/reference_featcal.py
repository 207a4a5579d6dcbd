"""A deliberately plain FeatCal, written line by line from featcal-method.md, to check the engine.

No shared inputs, no task folding, no in-place streams: full expert models, float64 everywhere.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def _inputs(layer: nn.Module, hidden: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    seen, handles = {}, []
    for name, module in layer.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            handles.append(
                module.register_forward_pre_hook(lambda m, a, n=name: seen.__setitem__(n, a[0].detach().clone()))
            )
    out = layer(hidden, None)
    for h in handles:
        h.remove()
    return seen, out


def plain_featcal(merged, base, experts: list, pixels: list[torch.Tensor], *, lam=0.05, rho=2.2, alpha=0.25, eps=1e-8):
    model = copy.deepcopy(merged).double()
    base, experts = base.double(), [e.double() for e in experts]
    stem = lambda m, px: m.pre_layrnorm(m.embeddings(px.double()))  # noqa: E731
    students = [stem(model, px) for px in pixels]
    teachers = [stem(e, px) for e, px in zip(experts, pixels)]
    layers = model.encoder.layers
    num_layers = len(layers)
    with torch.no_grad():
        for index, layer in enumerate(layers):
            per_task = []
            for t, expert in enumerate(experts):
                xs_all, _ = _inputs(layer, students[t])
                xe_all, teachers[t] = _inputs(expert.encoder.layers[index], teachers[t])
                per_task.append((xs_all, xe_all))
            new = {}
            for name, module in layer.named_modules():
                if not isinstance(module, (nn.Linear, nn.LayerNorm)):
                    continue
                last_weighted = index == num_layers - 1 and not name.endswith(("k_proj", "v_proj"))
                a_w = rho * module.weight + (1 - rho) * base.encoder.layers[index].get_submodule(name).weight
                a_b = rho * module.bias + (1 - rho) * base.encoder.layers[index].get_submodule(name).bias
                if isinstance(module, nn.LayerNorm):
                    a11 = a12 = r1 = r2 = 0.0
                    for t, (xs_all, _) in enumerate(per_task):
                        xs = xs_all[name]
                        w = torch.ones(xs.shape[:-1], dtype=torch.float64)
                        if last_weighted:
                            w[:, 1:] = 0.01
                        z = F.layer_norm(xs, xs.shape[-1:], eps=module.eps)
                        m = (w[..., None] * z).sum((0, 1)) / w.sum()
                        e = (w[..., None] * z * z).sum((0, 1)) / w.sum()
                        ex = experts[t].encoder.layers[index].get_submodule(name)
                        a11, a12 = a11 + e, a12 + m
                        r1, r2 = r1 + e * ex.weight + m * ex.bias, r2 + m * ex.weight + ex.bias
                    a11, a22 = a11 + lam, len(experts) + lam
                    r1, r2 = r1 + lam * a_w, r2 + lam * a_b
                    det = (a11 * a22 - a12 * a12).clamp_min(eps)
                    new[name] = ((a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det)
                    continue
                lhs = (lam + eps) * torch.eye(module.in_features, dtype=torch.float64)
                rhs = lam * a_w.T
                b_num, b_den, terms = lam * a_b, lam, []
                for t, (xs_all, xe_all) in enumerate(per_task):
                    xs = xs_all[name].reshape(-1, module.in_features)
                    xe = xe_all[name].reshape(-1, module.in_features)
                    w = torch.ones(xs_all[name].shape[:-1], dtype=torch.float64)
                    if last_weighted:
                        w[:, 1:] = 0.01
                    w = w.reshape(-1, 1)
                    xt = alpha * xe + (1 - alpha) * xs
                    c_ss = (w * xs).T @ xs / w.sum()
                    c_st = (w * xs).T @ xt / w.sum()
                    s = 1 / c_ss.norm().clamp_min(eps)
                    ex = experts[t].encoder.layers[index].get_submodule(name)
                    lhs = lhs + s * c_ss
                    rhs = rhs + s * c_st @ ex.weight.T
                    terms.append((s, ex, (w * xs).sum(0) / w.sum(), (w * xt).sum(0) / w.sum()))
                weight = torch.linalg.solve(lhs, rhs).T
                for s, ex, mu_s, mu_t in terms:
                    b_num = b_num + s * (ex.bias + ex.weight @ mu_t - weight @ mu_s)
                    b_den = b_den + s
                new[name] = (weight, b_num / b_den)
            for name, (weight, bias) in new.items():
                layer.get_submodule(name).weight.copy_(weight)
                layer.get_submodule(name).bias.copy_(bias)
            students = [layer(s, None) for s in students]
    return model.float()
