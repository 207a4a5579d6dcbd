"""The entries of a repair comparison (``featcal run --repair``): a repair's name, alone or with hyper-parameters.

On the command line an entry is ``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]`` (``svc:alpha=0.3``), each value
read as a YAML scalar as ``--repair-param KEY=VALUE`` reads it; in a recipe's ``repair:`` list an entry is that
text or a mapping of the name to its hyper-parameters (``{svc: {alpha: 0.3}}``), as ``merge_params:`` maps
a merging method's. The hyper-parameters are checked as ``featcal calibrate --method NAME --repair-param``
checks them (:meth:`featcal.repairs.registry.Repair.resolved_params`). FeatCal's are its run options
(``lambda_ratio``, ...) that the entry sets for its own calibration, the others keeping the run's values;
the calibration draw (``num_calibration_examples``, ``calibration_batch_size``) stays the run's, since every
repair of a comparison reads the same one.

An entry is labelled by its name and the hyper-parameters it was given (``svc:alpha=0.3``); its result file
and output folder are named by the same text with ``@`` and ``+`` for ``:`` and ``,`` (``svc@alpha=0.3``),
so that an entry without hyper-parameters keeps the name alone (``svc.json``, ``svc/``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from featcal.calibration.params import FeatCalParams
from featcal.errors import InvalidParameterError
from featcal.options import convert
from featcal.repairs.options import DEFAULT_REPAIR
from featcal.repairs.registry import Repair

FLAG = "repair"  # the option an entry is given by (``--repair``, the recipe's ``repair``)
ENTRY_FORM = "a repair's name, or NAME:KEY=VALUE[,KEY=VALUE...] with its hyper-parameters (svc:alpha=0.3)"
RECIPE_FORM = "one or more repairs, each NAME, NAME:KEY=VALUE[,KEY=VALUE...] or {NAME: {KEY: VALUE}}"
# FeatCal's parameters that are the comparison's calibration draw, read alike by every data-using repair.
DRAW_PARAMS = ("num_calibration_examples", "calibration_batch_size")


@dataclasses.dataclass(frozen=True)
class ComparedRepair:
    """One entry of a comparison: a registered repair and the hyper-parameters the entry gives it.

    Args:
        repair: The repair.
        setting: The hyper-parameters given, converted and in the repair's declared order (empty: the repair's
            defaults; for FeatCal, the run's parameters).
    """

    repair: Repair
    setting: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        """The entry as the command line spells it, e.g. ``svc`` or ``svc:alpha=0.3`` (the comparison's row)."""
        return entry_label(self.repair.name, self.setting)

    @property
    def stem(self) -> str:
        """The name of the entry's result file and output folder in ``RUN/repairs``: ``svc``, ``svc@alpha=0.3``."""
        if not self.setting:
            return self.repair.name
        return f"{self.repair.name}@" + "+".join(f"{key}={shown_value(v)}" for key, v in self.setting.items())


def shown_value(value: Any) -> str:
    """A hyper-parameter's value as ``KEY=VALUE`` text writes it, read back to the same value (``true``, ``0.3``).

    Args:
        value: The converted value.

    Returns:
        Its text: ``true``/``false`` for a bool, ``repr`` for a float (all its digits), ``str`` otherwise.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def entry_label(name: str, setting: Mapping[str, Any]) -> str:
    """The label of the entry ``name`` with the hyper-parameters ``setting``: ``NAME`` or ``NAME:KEY=VALUE,...``.

    Args:
        name: The repair's name.
        setting: The hyper-parameters the entry gives, in the repair's declared order (empty: none).

    Returns:
        The label, as the command line spells the entry.
    """
    if not setting:
        return name
    return f"{name}:" + ",".join(f"{key}={shown_value(value)}" for key, value in setting.items())


def recipe_entries(value: Any, *, owner: str) -> list[Any] | None:
    """The entries of a recipe's ``repair`` value: one text, or a list of texts and ``{NAME: {KEY: VALUE}}``
    mappings; None for null.

    Raises:
        InvalidParameterError: naming ``owner`` when the value, or one of its entries, is none of these.
    """
    if value is None:
        return None
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not entries or not all(isinstance(e, (str, Mapping)) for e in entries):
        raise InvalidParameterError(FLAG, value, f"{RECIPE_FORM} (or null)", owner=owner)
    for entry in entries:
        try:
            parse_entry(entry)
        except InvalidParameterError as exc:
            raise InvalidParameterError(FLAG, entry, exc.expected, owner=owner) from None
    return list(entries)


def parse_entry(entry: Any) -> tuple[str, dict[str, Any]]:
    """The repair's name and the hyper-parameters (as given, not yet checked) of one entry.

    Args:
        entry: ``NAME``, ``NAME:KEY=VALUE[,KEY=VALUE...]``, or a mapping ``{NAME: {KEY: VALUE}}``.

    Returns:
        The name and the hyper-parameters by name (``-`` read as ``_``), each text value read as a YAML scalar.

    Raises:
        InvalidParameterError: for an entry of neither form, or a hyper-parameter given twice.
    """
    if isinstance(entry, Mapping) and len(entry) == 1:
        ((name, params),) = entry.items()
        if params is None:
            params = {}
        if isinstance(params, Mapping):
            keys = [str(key).replace("-", "_") for key in params]
            if len(set(keys)) == len(keys):
                return str(name).strip(), dict(zip(keys, params.values(), strict=True))
    elif isinstance(entry, str):
        name, sep, rest = entry.partition(":")
        items = rest.split(",") if sep else []
        keys = [item.partition("=")[0].strip().replace("-", "_") for item in items]
        if name.strip() and len(set(keys)) == len(keys):
            try:  # KEY=VALUE items as --repair-param reads them
                return name.strip(), convert(items, dict[str, Any], None, FLAG) if items else {}
            except InvalidParameterError:
                pass
    raise InvalidParameterError(FLAG, entry, f"{ENTRY_FORM}, each hyper-parameter once")


def compared_repairs(entries: Sequence[Any], featcal: FeatCalParams) -> list[ComparedRepair]:
    """The entries of a comparison, each repair looked up and its hyper-parameters checked, in the order given.

    Args:
        entries: The ``--repair`` values (texts) or the recipe's (texts and mappings).
        featcal: The run's FeatCal parameters, which a FeatCal entry's own override.

    Returns:
        The entries.

    Raises:
        UnknownNameError: for a name no repair has, or a hyper-parameter the repair does not have.
        InvalidParameterError: for an entry of neither form, a value of the wrong type or out of range, a
            FeatCal entry that sets the calibration draw, and an entry that repeats another's repair and
            hyper-parameters.
    """
    from featcal.repairs.catalog import get_repair

    seen: dict[tuple[str, tuple[tuple[str, Any], ...]], str] = {}
    compared: list[ComparedRepair] = []
    for entry in entries:
        name, given = parse_entry(entry)
        repair = get_repair(name)
        runs = featcal.to_dict() if repair.name == DEFAULT_REPAIR else {}
        drawn = [key for key in given if runs and key in DRAW_PARAMS]
        if drawn:
            raise InvalidParameterError(
                FLAG, entry_label(name, given), f"an entry that leaves {drawn[0]} to the run: every repair of a "
                "comparison reads the run's calibration draw (--num-calibration-examples, --calibration-batch-size)",
            )  # fmt: skip
        resolved = repair.resolved_params(**{**runs, **given})
        one = ComparedRepair(repair, {key: value for key, value in resolved.items() if key in given})
        same = seen.get((repair.name, tuple(resolved.items())))
        if same is not None:
            detail = "repeated here" if same == one.label else f"the same as {same}"
            raise InvalidParameterError(
                FLAG, one.label, f"each repair named once per setting of its hyper-parameters ({detail})"
            )
        seen[(repair.name, tuple(resolved.items()))] = one.label
        compared.append(one)
    return compared
