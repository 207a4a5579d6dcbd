"""Reading a mergekit output folder's ``mergekit_config.yml``: what was merged, from which base, and how.

mergekit (https://github.com/arcee-ai/mergekit) writes the merge configuration it ran into the output
folder as ``mergekit_config.yml``: with its command line, the input YAML verbatim; with its Python API,
the configuration dumped with its keys sorted. featcal writes the same file beside its own
``task_arithmetic`` and ``simple_average`` merges (:func:`featcal.model_recipe.mergekit_config`). This
module reads either, without importing mergekit (or torch), following mergekit's configuration schema
(``mergekit/config.py``, ``mergekit/common.py``, ``mergekit/tokenizer/config.py``).

featcal calibrates a merge of whole models that share the base model's vocabulary, so the features
that break either are refused, each in one line naming the file, the feature and the fix: layer
slices and per-module definitions, parameters that vary by tensor (``filter``/``value`` lists) or by
layer (gradients), LoRA adapters, a model architecture override, and a tokenizer other than the base
model's (a union vocabulary, added tokens, a padded vocabulary, or another model's tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

from featcal.errors import InputError, ModelInputError
from featcal.files.reading import DuplicateKeyError, read_text_input, unique_key_yaml_loader

MERGEKIT_CONFIG = "mergekit_config.yml"

_LORA_FIX = (
    "merge the LoRA into a full model first (peft: "
    "PeftModel.from_pretrained(base, lora).merge_and_unload().save_pretrained(dir)), then list that folder in "
    "place of {ref!r}"
)
_TOKENIZER_FIX = (
    "the merged vocabulary is not the base model's, so the experts' embeddings do not line up with the "
    "base's; merge with tokenizer_source: base (or no tokenizer setting)"
)
_SCALAR = (bool, int, float, str)


@dataclass(frozen=True)
class MergekitMerge:
    """A whole-model merge as a ``mergekit_config.yml`` describes it.

    Attributes:
        method: mergekit's ``merge_method`` (``task_arithmetic``, ``ties``, ``linear``, ``dare_ties``,
            ``slerp``...), as written.
        base_model: The base model as written (a Hub id, maybe ``id@revision``, or a path); None when
            the configuration names none.
        models: The merged models (the experts) in the configuration's order, the base left out when it
            is listed too. Each is written as in the file; a mapping form ``{path, revision}`` becomes
            ``path@revision``, as mergekit prints it.
        model_params: Each listed model's own scalar parameters (``weight``, ``density``...), by model
            reference: every model in ``models``, and the base when it is listed with parameters.
            Parameters given only in the global ``parameters`` are not copied here.
        params: The merge's global ``parameters`` (``lambda``, ``normalize``, ``t``...), scalars only.
        dtype: The configuration's ``dtype`` (the dtype mergekit computed in), or None.
        featcal_method: featcal's merging method that computes the same merge, when there is one
            (``task_arithmetic``, ``simple_average``); None otherwise.
        text: The YAML text as read, to quote in a model card.
        featcal_params: The hyper-parameters of ``featcal_method`` that give the same merge
            (``{"scaling_factor": ...}`` for ``task_arithmetic``); empty when there are none or no
            equivalent.
    """

    method: str
    base_model: str | None
    models: tuple[str, ...]
    model_params: Mapping[str, Mapping[str, Any]] = field(hash=False)
    params: Mapping[str, Any] = field(hash=False)
    dtype: str | None
    featcal_method: str | None
    text: str
    featcal_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)


def read_mergekit_folder(folder: str | Path) -> MergekitMerge | None:
    """The merge a model folder's ``mergekit_config.yml`` describes, or None when it has no such file.

    Args:
        folder: A model folder, e.g. a mergekit output folder.

    Returns:
        The merge, or None when ``folder/mergekit_config.yml`` does not exist.

    Raises:
        ModelInputError: The file cannot be read as UTF-8 text, or :func:`parse_mergekit_config`
            refuses it.
    """
    path = Path(folder) / MERGEKIT_CONFIG
    if not path.exists():
        return None
    try:
        text = read_text_input(path, "mergekit configuration")
    except InputError as exc:
        raise ModelInputError(str(path), exc.message) from None
    return parse_mergekit_config(text, path)


def parse_mergekit_config(text: str, where: str | Path) -> MergekitMerge:
    """Parse the text of a ``mergekit_config.yml``.

    Args:
        text: The YAML text.
        where: The file it came from, for messages (and the errors' ``ref``).

    Returns:
        The merge it describes.

    Raises:
        ModelInputError: The text is not valid YAML, repeats a key in one mapping, is not a mapping,
            names no ``merge_method`` or no models, or uses a feature featcal cannot calibrate: layer
            ``slices`` (or a model's ``layer_range``), per-module definitions, a parameter that varies by
            tensor or by layer, a LoRA adapter, an architecture override, or a tokenizer other than the
            base model's.
    """
    config = _load(text, where)
    if not isinstance(config, Mapping):
        _refuse(
            where,
            "is not a mergekit merge configuration (a YAML mapping with merge_method and models); "
            "rewrite it, or remove it if the folder is not a mergekit merge",
            joined=" ",
        )
    for key, what in (("slices", "layer slices"), ("modules", "per-module merge definitions")):
        if config.get(key):
            _refuse(
                where,
                f"'{key}' ({what}) is not supported: featcal calibrates whole-model merges only; "
                "merge whole models listed under 'models:' instead",
            )
    method = config.get("merge_method")
    if not isinstance(method, str) or not method.strip():
        _refuse(
            where, "names no merge_method; add the method mergekit ran, e.g. merge_method: task_arithmetic", joined=" "
        )
    entries = config.get("models")
    if not entries:
        _refuse(where, "lists no models; list the merged models under 'models:'", joined=" ")
    if not isinstance(entries, list):
        _refuse(where, "'models' must be a list of models (each a reference, or a mapping with 'model')")

    base = None if config.get("base_model") is None else _model_ref(config["base_model"], where, "base_model")
    listed: list[str] = []
    model_params: dict[str, Mapping[str, Any]] = {}
    for entry in entries:
        ref, own = _model_entry(entry, where)
        if ref in listed:
            _refuse(where, f"lists model {ref!r} twice; list each model once", joined=" ")
        listed.append(ref)
        model_params[ref] = MappingProxyType(own)
    models = tuple(ref for ref in listed if ref != base)
    if not models:
        _refuse(where, "lists no models besides the base model; list the merged models under 'models:'", joined=" ")
    if base is not None and base in model_params and not model_params[base]:
        del model_params[base]
    params = _parameters(config.get("parameters"), where, "the merge")
    _check_tokenizer(config, base, where)
    dtype = config.get("dtype")
    featcal_method, featcal_params = _featcal_equivalent(method, base, models, model_params, params)
    return MergekitMerge(
        method=method,
        base_model=base,
        models=models,
        model_params=MappingProxyType(model_params),
        params=MappingProxyType(params),
        dtype=None if dtype is None else str(dtype),
        featcal_method=featcal_method,
        text=text,
        featcal_params=MappingProxyType(featcal_params),
    )


def _refuse(where: str | Path, message: str, *, joined: str = ": ") -> NoReturn:
    """Raise the one-line :class:`ModelInputError` ``"<where>: <message>."``."""
    raise ModelInputError(str(where), f"{where}{joined}{message}.")


def _load(text: str, where: str | Path) -> Any:
    """The YAML ``text`` parsed safely, refusing a key given twice in one mapping."""
    import yaml

    try:
        return yaml.load(text, Loader=unique_key_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as exc:
        _refuse(where, f"{exc}; keep one")
    except yaml.YAMLError as exc:
        _refuse(
            where,
            f"is not valid YAML ({' '.join(str(exc).split())}); fix it, or remove it if the folder is not a "
            "mergekit merge",
            joined=" ",
        )


def _model_entry(entry: Any, where: str | Path) -> tuple[str, dict[str, Any]]:
    """A ``models:`` entry's reference and its own parameters.

    An entry is a reference, or mergekit's ``{model: <reference>, parameters: {...}}``.
    """
    if not isinstance(entry, Mapping):
        return _model_ref(entry, where, "model"), {}
    if "model" not in entry:
        _refuse(where, f"the models entry {dict(entry)!r} names no 'model'; give each entry 'model: <id or path>'")
    ref = _model_ref(entry["model"], where, "model")
    if entry.get("layer_range") is not None:
        _refuse(
            where,
            f"model {ref!r} has a layer_range: featcal calibrates whole-model merges only; "
            "remove layer_range and merge the whole models",
        )
    return ref, _parameters(entry.get("parameters"), where, f"model {ref!r}")


def _model_ref(value: Any, where: str | Path, key: str) -> str:
    """A mergekit model reference (``ModelReference``) as text, refusing LoRA adapters.

    mergekit reads ``"path"``, ``"path@revision"`` and ``"path+lora"`` (a LoRA adapter on ``path``), or
    the mapping ``{model: <path>, lora: <path>, override_architecture: <name>}`` whose paths are text or
    ``{path, revision}``. Text is kept as written; a mapping is written as mergekit prints it.
    """
    if isinstance(value, str):
        text = value.strip()
        if not text or text.count("+") > 1 or any(part.count("@") > 1 for part in text.split("+")):
            _refuse(
                where,
                f"{key} {value!r} is not a model reference mergekit reads; give a Hub id or a path, "
                "optionally followed by @revision",
            )
        if "+" in text:
            model, lora = text.split("+")
            _refuse(
                where, f"{key} {text!r} is the LoRA adapter {lora!r} applied to {model!r}; {_LORA_FIX.format(ref=text)}"
            )
        return text
    if isinstance(value, Mapping) and "model" in value:
        model = _model_path(value["model"], where, key)
        if value.get("lora") is not None:
            lora = _model_path(value["lora"], where, f"lora of {key}")
            _refuse(where, f"{key} {model!r} has the LoRA adapter {lora!r}; {_LORA_FIX.format(ref=model + '+' + lora)}")
        if value.get("override_architecture") is not None:
            _refuse(
                where,
                f"{key} {model!r} sets override_architecture {value['override_architecture']!r}: featcal loads "
                "each model with the architecture its own config.json names; merge without "
                "override_architecture",
            )
        return model
    _refuse(
        where,
        f"{key} {value!r} is not a model reference mergekit reads; give a Hub id or a path (or a mapping with 'model')",
    )


def _model_path(value: Any, where: str | Path, key: str) -> str:
    """A mergekit ``ModelPath`` (text, or ``{path, revision}``) as text: ``path`` or ``path@revision``."""
    if isinstance(value, str) and value.strip() and value.count("@") <= 1:
        return value.strip()
    if isinstance(value, Mapping) and isinstance(value.get("path"), str) and value["path"].strip():
        revision = value.get("revision")
        return f"{value['path'].strip()}@{revision}" if revision else value["path"].strip()
    _refuse(where, f"{key} {value!r} is not a model path mergekit reads; give a Hub id or a path")


def _parameters(values: Any, where: str | Path, owner: str) -> dict[str, Any]:
    """A ``parameters`` mapping with one scalar per name, refusing values that vary by tensor or layer.

    mergekit's ``ParameterSetting`` is a number, a list of numbers (a gradient, interpolated over the
    layers), ``{value, filter}`` (the value for tensors whose name contains ``filter``) or a list of
    those. A single ``{value: <number>}`` whose filter is absent or ``*`` applies to every tensor, so it
    is read as that number.

    Args:
        values: The ``parameters`` mapping (None when absent).
        where: The file, for messages.
        owner: Whose parameters they are, for messages: ``"the merge"`` or ``"model 'a/b'"``.
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        _refuse(where, f"the parameters of {owner} must be a mapping of names to numbers, not {values!r}")
    out: dict[str, Any] = {}
    for name, value in values.items():
        label = f"parameter {name!r} of {owner}"
        if (
            isinstance(value, Mapping)
            and value.get("filter") in (None, "*")
            and isinstance(value.get("value"), _SCALAR)
        ):
            value = value["value"]
        if isinstance(value, _SCALAR):
            out[str(name)] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            _refuse(
                where,
                f"{label} is a gradient over the layers ({value!r}): featcal calibrates merges with one value "
                f"per parameter; merge with a single number for {name!r}",
            )
        elif isinstance(value, Mapping) or (isinstance(value, list) and any(isinstance(v, Mapping) for v in value)):
            _refuse(
                where,
                f"{label} varies by tensor (filter/value list {value!r}): featcal calibrates merges with one "
                f"value per parameter; merge with a single number for {name!r}",
            )
        else:
            _refuse(where, f"{label} is not a number ({value!r}); give it a single number")
    return out


def _check_tokenizer(config: Mapping[str, Any], base: str | None, where: str | Path) -> None:
    """Refuse a tokenizer setting that gives the merged model a vocabulary other than the base model's."""
    source = config.get("tokenizer_source")
    if source is not None:
        if source == "union":
            _refuse(where, f"tokenizer_source: union builds a union of the models' vocabularies: {_TOKENIZER_FIX}")
        if source != "base" and _ref_text(source) != base:
            shown = _ref_text(source) or source
            _refuse(where, f"tokenizer_source {shown!r} is not the base model{_base_named(base)}: {_TOKENIZER_FIX}")
    tokenizer = config.get("tokenizer")
    if tokenizer is None:
        return
    if not isinstance(tokenizer, Mapping):
        _refuse(where, f"'tokenizer' must be a mapping (source, tokens, pad_to_multiple_of); {_TOKENIZER_FIX}")
    source = tokenizer.get("source", "union")  # mergekit's default for a tokenizer section
    if source == "union":
        _refuse(where, f"'tokenizer' has source: union (mergekit's default), a union vocabulary: {_TOKENIZER_FIX}")
    if source != "base" and _ref_text(source) != base:
        shown = _ref_text(source) or source
        _refuse(where, f"'tokenizer' has source {shown!r}, not the base model{_base_named(base)}: {_TOKENIZER_FIX}")
    if tokenizer.get("tokens"):
        _refuse(
            where, f"'tokenizer' adds or sets tokens ({', '.join(map(str, tokenizer['tokens']))}): {_TOKENIZER_FIX}"
        )
    if tokenizer.get("pad_to_multiple_of"):
        _refuse(
            where,
            f"'tokenizer' pads the vocabulary (pad_to_multiple_of: {tokenizer['pad_to_multiple_of']}): "
            f"{_TOKENIZER_FIX}",
        )


def _base_named(base: str | None) -> str:
    """`` ('org/base')`` for messages, or a note that the configuration names no base model."""
    return f" ({base!r})" if base is not None else " (the configuration names no base_model)"


def _ref_text(value: Any) -> str | None:
    """A model reference as :func:`_model_ref` writes it, or None when it is not a plain one (a LoRA, say)."""
    try:
        return _model_ref(value, "", "model")
    except ModelInputError:
        return None


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _featcal_equivalent(
    method: str,
    base: str | None,
    models: tuple[str, ...],
    model_params: Mapping[str, Mapping[str, Any]],
    params: Mapping[str, Any],
) -> tuple[str | None, dict[str, Any]]:
    """featcal's merging method (and its hyper-parameters) that computes the same merge, if any.

    featcal's methods (``featcal/merging/``): ``task_arithmetic`` (θ0 + κ Σ τt), ``simple_average``
    (the mean of the experts), ``ties`` (top-k % of each **whole** task vector, FusionBench's), ``tsv``,
    ``iso_c`` and ``wudi``. Only two of mergekit's methods compute the same thing:

    - mergekit's ``task_arithmetic`` is θ0 + λ · Σ wi τi (divided by Σ wi when ``normalize``, off by
      default); with one weight w for every model it is featcal's ``task_arithmetic`` with
      κ = λ·w (κ = λ/T when normalized). Unequal weights have no featcal equivalent.
    - mergekit's ``linear`` is Σ wi θi (divided by Σ wi when ``normalize``, on by default); with one weight
      for every model and no ``base_model`` it is featcal's ``simple_average``. mergekit adds a named
      base model to a linear merge's inputs, so a linear merge with a base averages the base too.

    mergekit's ``ties`` trims each tensor to its own ``density`` (featcal's ``ties`` trims each whole
    task vector to one threshold) and breaks sign ties differently; ``dare_*`` drop entries at random;
    ``slerp`` and the others have no featcal counterpart: all None. mergekit computes in the
    configuration's ``dtype``, featcal in float32: the same computation, rounded differently.

    A model's weight is its own ``weight`` parameter, or the global one (mergekit's lookup order).
    """
    weights = [_number(model_params.get(m, {}).get("weight", params.get("weight"))) for m in models]
    if not models or any(w is None for w in weights) or len(set(weights)) != 1:
        return None, {}
    weight = weights[0]
    assert weight is not None
    count = len(models)
    if method == "task_arithmetic" and base is not None:
        lam = _number(params.get("lambda", 1.0))
        if lam is None:
            return None, {}
        normalize = bool(params.get("normalize", False))
        # mergekit divides by Σ w = T·w unless that is below 1e-8 in magnitude
        kappa = lam / count if normalize and abs(weight * count) >= 1e-8 else lam * weight
        return "task_arithmetic", {"scaling_factor": kappa}
    if method == "linear" and base is None and weight != 0:
        normalize = bool(params.get("normalize", True))
        if normalize or math.isclose(weight * count, 1.0, rel_tol=1e-9):
            return "simple_average", {}
    return None, {}
