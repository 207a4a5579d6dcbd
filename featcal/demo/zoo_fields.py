"""What every benchmark zoo's configuration does with its fields: variants from ``NAME=VALUE`` strings, its
fields as JSON, and the cache key that tells a preset from a variant (:class:`ZooConfigMethods`, which the
mini8, lm5 and t5x4 configurations share). This module imports no torch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields, replace
from typing import Any, ClassVar, Protocol, TypeVar


class ZooFields(Protocol):
    """A zoo's configuration: a frozen dataclass with a name, a seed and its fields as JSON."""

    name: str
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values."""
        ...


Config = TypeVar("Config", bound=ZooFields)


def with_assignments(config: Config, assignments: Sequence[str]) -> Config:
    """A copy of ``config`` with fields set from ``name=value`` strings, for benchmark variants.

    Args:
        config: A zoo configuration (a frozen dataclass).
        assignments: Items such as ``"hidden=96"``; tuple fields take comma-separated values.

    Returns:
        The changed configuration (validated by its own ``__post_init__``).

    Raises:
        FeatcalError: An item is not ``name=value``, names no field, or its value does not parse.
    """
    from featcal.errors import FeatcalError

    types = {f.name: type(getattr(config, f.name)) for f in fields(config)}  # type: ignore[arg-type]
    changes: dict[str, Any] = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise FeatcalError(f"zoo field {item!r}: expected NAME=VALUE with NAME one of {sorted(types)}.")
        kind = types[name]
        try:
            changes[name] = tuple(v for v in value.split(",") if v) if kind is tuple else kind(value)
        except ValueError as exc:
            raise FeatcalError(f"zoo field {item!r}: {value!r} is not a {kind.__name__}.") from exc
    return replace(config, **changes)  # type: ignore[type-var]


def cache_key(config: ZooFields, version: int, presets: Mapping[str, Callable[[], Any]]) -> str:
    """The zoo's folder name: ``<name>-v<version>-seed<seed>``, plus a digest of the fields for a variant.

    Args:
        config: The zoo's configuration.
        version: The zoo kind's version (bumped when its data, training or layout change).
        presets: The kind's presets by name, each giving its configuration of seed 0.

    Returns:
        The key; it has no digest when ``config`` is its name's preset with another seed at most.
    """
    key = f"{config.name}-v{version}-seed{config.seed}"
    preset = presets.get(config.name)
    if preset is not None and replace(preset(), seed=config.seed) == config:
        return key
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
    return f"{key}-{digest}"


class ZooConfigMethods:
    """The methods a zoo's configuration (a frozen dataclass) shares with the other zoos'. A subclass sets
    ``VERSION`` (bumped whenever its data, training or layout change: it keys the cache) and names its presets
    in :meth:`presets`."""

    VERSION: ClassVar[int]

    @classmethod
    def presets(cls) -> Mapping[str, Callable[[], Any]]:
        """The zoo kind's presets by name, each giving its configuration of seed 0."""
        raise NotImplementedError

    def with_assignments(self: Config, assignments: Sequence[str]) -> Config:
        """A copy with fields set from ``name=value`` strings, for benchmark variants.

        Args:
            assignments: Items such as ``"hidden=96"``; tuple fields take comma-separated values.

        Returns:
            The changed config (validated as any other).

        Raises:
            FeatcalError: An item is not ``name=value``, names no field, or its value does not parse.
        """
        return with_assignments(self, assignments)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready values (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}  # type: ignore[call-overload]

    def cache_key(self) -> str:
        """The zoo's folder name: ``<name>-v<version>-seed<seed>``, plus a digest for non-preset fields."""
        return cache_key(self, self.VERSION, self.presets())  # type: ignore[arg-type]
