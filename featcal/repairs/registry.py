"""The registry of post-merge repairs: what each repair of a merged model is, reads and gives.

A *repair* changes a merged model after the merge. Each declares its name, its paper, whether it needs
calibration data (:attr:`Repair.uses_data`), whether its result is a plain ``transformers`` model of
the merge's architecture, released by ``featcal export`` and ``push`` as a merge is
(:attr:`Repair.releasable`), and its hyper-parameters with their defaults, declared as the merging
methods declare theirs (:class:`~featcal.merging.registry.HyperParameter`, checked and worded by
:mod:`featcal.options`).

Two kinds are registered. A **weight-only** repair is a per-tensor kernel registered with
:func:`weight_repair`: ``kernel(base, experts, merged, *, <hyper-parameters>)`` takes θ0, the experts'
tensors stacked (T, ...) and the merged tensor, all float32, and returns the repaired float32 tensor;
its keyword-only arguments are its hyper-parameters, typed as a merging method's
(``Annotated[float, Range(gt=0)]``). :mod:`featcal.repairs.apply` runs it over a merged folder. FeatCal,
which computes from calibration data layer by layer, is registered with its parameters read from
:class:`~featcal.calibration.params.FeatCalParams` and runs through :func:`featcal.stages.calibrate`.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from featcal.merging.registry import HyperParameter, NamedRegistry, hyper_parameter, resolve_params

F = TypeVar("F", bound=Callable[..., Any])
KERNEL_INPUTS = ("base", "experts", "merged")  # a weight-only repair's positional parameters, in order


@dataclass(frozen=True)
class Repair:
    """A registered post-merge repair.

    Args:
        name: The registry name (``"svc"``), as ``featcal calibrate --method`` gives it.
        pretty_name: The name for people (``"Singular Value Calibration (SVC)"``).
        reference_url: The paper.
        description: One line saying what the repair computes.
        params: The hyper-parameters, with their defaults.
        uses_data: The repair computes from each task's calibration examples.
        releasable: Its result is a plain ``transformers`` model of the merge's architecture, which
            ``featcal export`` and ``push`` release.
        kernel: A weight-only repair's per-tensor function (see the module docstring); None for one that
            runs its own way (FeatCal).
    """

    name: str
    pretty_name: str
    reference_url: str
    description: str
    params: tuple[HyperParameter, ...]
    uses_data: bool
    releasable: bool
    kernel: Callable[..., Any] | None = None

    @property
    def defaults(self) -> dict[str, Any]:
        """Each hyper-parameter's default, by name."""
        return {p.name: p.default for p in self.params}

    def resolved_params(self, **params: Any) -> dict[str, Any]:
        """Every hyper-parameter's value: the defaults overridden by ``params``, validated and converted.

        Args:
            **params: Hyper-parameter values by name; ``None`` stands for the default.

        Returns:
            All hyper-parameters by name, in their declared order (for recipes and model cards).

        Raises:
            UnknownNameError: If a name is not a hyper-parameter of this repair.
            InvalidParameterError: If a value has the wrong type or is out of range.
        """
        return resolve_params(self.params, params, owner=f"repair {self.name!r}")


class RepairRegistry(NamedRegistry[Repair]):
    """Repairs by name. featcal's are in :data:`REPAIRS` once :mod:`featcal.repairs.catalog` is imported;
    a test may use its own."""

    def __init__(self) -> None:
        super().__init__("repair")


REPAIRS = RepairRegistry()


def weight_repair(
    name: str,
    *,
    pretty_name: str,
    reference_url: str,
    description: str | None = None,
    registry: RepairRegistry | None = None,
) -> Callable[[F], F]:
    """Register the decorated per-tensor kernel as the data-free, releasable repair ``name``.

    Args:
        name: The registry name.
        pretty_name: The name for people, shown in model cards.
        reference_url: The paper.
        description: One line for ``featcal methods``; default the first line of the docstring.
        registry: Where to register; default :data:`REPAIRS`.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        TypeError: If the positional parameters are not ``(base, experts, merged)``, or a hyper-parameter
            lacks a default or has an unsupported annotation.
        ValueError: If ``name`` is taken or a default is outside its own type or range.
    """

    def register(fn: F) -> F:
        doc = inspect.getdoc(fn) or ""
        summary = description if description is not None else (doc.splitlines() or [""])[0]
        params = _hyper_parameters(fn, f"repair {name!r}")
        repair = Repair(name, pretty_name, reference_url, summary, params, uses_data=False, releasable=True, kernel=fn)
        (REPAIRS if registry is None else registry).add(repair)
        return fn

    return register


def _hyper_parameters(fn: Callable[..., Any], where: str) -> tuple[HyperParameter, ...]:
    """The keyword-only hyper-parameters of a weight-only kernel, whose positional parameters are checked."""
    hints = typing.get_type_hints(fn, include_extras=True)
    parameters: Sequence[inspect.Parameter] = list(inspect.signature(fn).parameters.values())
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    others = [p for p in parameters if p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if positional != list(KERNEL_INPUTS) or others:
        raise TypeError(f"{where}: a weight-only repair takes ({', '.join(KERNEL_INPUTS)}, *, <hyper-parameters>)")
    return tuple(hyper_parameter(p, hints.get(p.name), where) for p in parameters if p.kind is p.KEYWORD_ONLY)
