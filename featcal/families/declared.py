"""A model family written as a declaration: its facts as class attributes, its parts as a table.

A family's package defines one class deriving from :class:`DeclaredFamily`: the facts generic modules read
(``name``, ``model_types``, ``release``, ...) as class attributes, and :attr:`DeclaredFamily.parts`, a table
of every other member of :class:`~featcal.families.base.ModelFamily` to the ``module:name`` that is it
(a module relative to the family's package). A part is imported when first read, so looking a family up
imports no torch. The members most families share have defaults here (:data:`DEFAULT_PARTS`), which a family's
table replaces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from featcal.runfolder.reader import RunFolder
    from featcal.tasks import Task


def resolve_part(package: str, target: str) -> Any:
    """The object a parts table names: ``".folders:lm_checkpoint"`` of ``package``, imported now.

    Args:
        package: The family's package (relative module names are read against it).
        target: ``module:name``.

    Returns:
        The module's attribute.
    """
    module, _, name = target.partition(":")
    return getattr(import_module(module, package), name)


def hidden_size(config: Any) -> int:
    """The model's width: its configuration's ``hidden_size``."""
    return int(config.hidden_size)


def no_split_check(task: Task, dataset: Any, split: str) -> None:
    """Nothing beyond what the family's ``load_split`` checks."""


def no_examples_check(
    task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
) -> Mapping[str, Any] | None:
    """Nothing to read ahead; nothing recorded."""
    return None


def no_record() -> Mapping[str, Any]:
    """Nothing recorded of how the family evaluates beyond ``max_eval_samples``."""
    return {}


def no_card_context(run: RunFolder) -> Mapping[str, Any]:
    """No variables of the family's own for its card."""
    return {}


DEFAULT_PARTS = {
    "hidden_size": f"{__name__}:hidden_size",
    "check_split": f"{__name__}:no_split_check",
    "check_examples": f"{__name__}:no_examples_check",
    "evaluation_record": f"{__name__}:no_record",
    "card_context": f"{__name__}:no_card_context",
}


class DeclaredFamily:
    """Base of a family declared as facts and a table of parts (see the module's docstring).

    Attributes:
        parts: Member name -> ``module:name`` (the module relative to the family's package); a member read from
            the family is that object (a function, called with the protocol's arguments; a class, whose call
            builds the member's result; or a constant). Members it leaves out are :data:`DEFAULT_PARTS`'.
    """

    parts: ClassVar[Mapping[str, str]] = {}

    def __getattr__(self, name: str) -> Any:
        target = type(self).parts.get(name) or DEFAULT_PARTS.get(name)
        if target is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return resolve_part(type(self).__module__, target)
