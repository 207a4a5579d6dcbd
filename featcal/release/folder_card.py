"""The model card of a model folder's release (a language model's or a T5's): Hub metadata and a Jinja-rendered
body, from the model folder's ``featcal_recipe.json`` alone.

The template is the family's folder card (:attr:`~featcal.families.base.ReleaseParts.folder_card_template`:
``featcal/families/causal_lm/model_card.md.j2``, ``featcal/families/seq2seq/folder_card.md.j2``); pass
``template=`` to use your own. Inputs are named as a release publishes them
(:mod:`featcal.release.published`): Hub ids as they are, local folders by their folder name only.
featcal measured nothing of a model folder (a language model is not evaluated by featcal, a T5 only in a
run), so the card reports no result: it says so, and how to measure one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from featcal.errors import UnknownNameError
from featcal.families import get_family, mergekit_reader
from featcal.hub.refs import check_repo_id
from featcal.model_recipe import ModelRecipe, mergekit_config
from featcal.release.card_template import TAGS, card_metadata, featcal_rows, hub_ids, method_info, render_template_card
from featcal.release.model_folder import ModelFolder
from featcal.release.options import NO_LICENSE
from featcal.release.published import published_model_recipe, published_ref, published_text
from featcal.version import __version__


def mergekit_refs(recipe: ModelRecipe) -> list[str]:
    """The model references the recipe's quoted ``mergekit_config.yml`` names (none when it quotes none)."""
    if recipe.mergekit_config is None:
        return []
    merge = mergekit_reader().parse_mergekit_config(recipe.mergekit_config, "mergekit_config")
    return [r for r in (merge.base_model, *merge.models) if r]


def _merge_context(folder: ModelFolder) -> dict[str, Any]:
    """How the merged model came about: featcal's method and hyper-parameters (and the same merge in
    mergekit's words, when mergekit has it), mergekit's configuration as mergekit wrote it, or unknown."""
    recipe = folder.recipe
    merge = recipe.merge
    if merge.merged_from is None and merge.method:
        pretty_name, url = method_info(merge.method)
        published = dataclasses.replace(
            recipe,
            base_model=str(published_ref(recipe.base_model)),
            experts={k: str(published_ref(v)) for k, v in recipe.experts.items()},
        )
        return {
            "by": "featcal",
            "name": merge.method,
            "pretty_name": pretty_name,
            "url": url,
            "params": dict(merge.params),
            "mergekit": mergekit_config(published),
            "tag": merge.method.replace("_", "-"),
        }
    if recipe.mergekit_config is not None:
        parsed = mergekit_reader().parse_mergekit_config(recipe.mergekit_config, "mergekit_config")
        text = published_text(recipe.mergekit_config, mergekit_refs(recipe))
        return {
            "by": "mergekit",
            "name": parsed.method,
            "pretty_name": f"mergekit's {parsed.method}",
            "url": None,
            "params": {},
            "mergekit": text,
            "mergekit_local": text != recipe.mergekit_config,
            "source": published_ref(merge.merged_from),
            "tag": parsed.method.replace("_", "-"),
        }
    return {
        "by": None,
        "name": "",
        "pretty_name": "an existing merge",
        "url": None,
        "params": {},
        "mergekit": None,
        "source": published_ref(merge.merged_from),
        "tag": None,
    }


def _cell(text: str) -> str:
    """``text`` as it may stand in a Markdown table's cell (new lines and pipes escaped)."""
    return text.replace("\n", "\\n").replace("|", "\\|")


def _data_rows(recipe: ModelRecipe) -> list[dict[str, Any]]:
    """Each expert's calibration data as the recipe records it, inputs named as published. A language model's
    entry has a text ``format`` (a column or template, or a prompt and a response); a T5's its ``input`` and
    ``target`` templates and the ``labels`` words of its class ids (None when the entry has none)."""
    rows = []
    for task, entry in recipe.calibration_data.items():
        fmt = (
            f"`{entry['text']}`"
            if entry.get("text")
            else f"prompt `{entry.get('prompt', '')}`, response `{entry.get('response', '')}`"
        )
        pair = "input" in entry and "target" in entry
        rows.append(
            {
                "task": task,
                "expert": published_ref(entry.get("expert")),
                "dataset": published_ref(entry.get("dataset")),
                "config": entry.get("config"),
                "revision": entry.get("revision"),
                "split": entry.get("split"),
                "format": _cell(fmt),
                "input": _cell(f"`{entry['input']}`") if pair else None,
                "target": _cell(f"`{entry['target']}`") if pair else None,
                "labels": (_cell(", ".join(f"`{w}`" for w in entry.get("labels") or ())) or None) if pair else None,
                "weigh": entry.get("weigh"),
                "max_length": entry.get("max_length"),
                "target_max_length": entry.get("target_max_length"),
                "examples": entry.get("examples"),
            }
        )
    return rows


def default_model_name(folder: ModelFolder) -> str:
    """A repository name for the release: the model folder's name (``llama3b-ta-featcal``)."""
    return folder.path.resolve().name


def model_card_data(folder: ModelFolder, *, model_name: str, license: str) -> ModelCardData:
    """The card's YAML metadata: library, pipeline, license, the Hub models it was merged from, tags and
    the Hub datasets it was calibrated on.

    Args:
        folder: The model folder.
        model_name: The repository the card names.
        license: The license (``other`` when none was given).

    Returns:
        The metadata.
    """
    recipe = folder.recipe
    parts = get_family(recipe.family).release
    merge = _merge_context(folder)
    base_models = hub_ids([recipe.base_model, *recipe.experts.values()])
    datasets = hub_ids([entry.get("dataset") for entry in recipe.calibration_data.values()])
    tags = [*TAGS, *parts.tags, *(["mergekit"] if merge["by"] == "mergekit" else []), merge["tag"]]
    return card_metadata(
        parts,
        model_name=model_name,
        license=license,
        base_models=base_models,
        tags=list(dict.fromkeys(t for t in tags if t)),
        datasets=datasets,
    )


def folder_context(
    folder: ModelFolder, *, repo_id: str | None, license: str | None, name: str | None = None
) -> dict[str, Any]:
    """The template's variables: everything from the folder's recipe, inputs named as published (the card of a
    run released as its stage folder adds the family's results section to them:
    :func:`featcal.release.run_card.render_card`). The repository is ``repo_id``, else named ``name``, else by the
    folder (:func:`default_model_name`). ``snippet`` is the first calibration entry's input template (a T5's usage
    snippet shows it), else None.

    Args:
        folder: The model folder, read.
        repo_id: The Hub repository the card names, when known.
        license: The license in the metadata (None: the family's default, and where it has none ``other``, and
            the card says none was given).
        name: The model's name when ``repo_id`` is None.

    Returns:
        The variables by name.
    """
    recipe = folder.recipe
    family = get_family(recipe.family)
    model_name = repo_id or name or default_model_name(folder)
    published = published_model_recipe(folder.raw_recipe, mergekit_refs(recipe))
    license = license or family.release.default_license
    inputs = [(task, entry["input"]) for task, entry in recipe.calibration_data.items() if entry.get("input")]
    return {
        "card_data": model_card_data(folder, model_name=model_name, license=license or NO_LICENSE).to_yaml(),
        "title": model_name.split("/")[-1],
        "repo_id": repo_id or f"<namespace>/{model_name}",
        "repo_id_known": repo_id is not None,
        "license_given": license is not None,
        "snippet": {"task": inputs[0][0], "input": inputs[0][1]} if inputs else None,
        "base_model": published_ref(recipe.base_model),
        "experts": [{"task": task, "ref": published_ref(ref)} for task, ref in recipe.experts.items()],
        "calibrated": folder.calibrated,
        "merge": _merge_context(folder),
        "repairs": _repair_context(recipe),
        "featcal": featcal_rows(recipe.featcal.params.to_dict(), family.noun) if recipe.featcal else None,
        "seed": recipe.seed,
        "data": _data_rows(recipe),
        "featcal_version": __version__,
        "recipe_featcal_version": recipe.featcal_version,
        "recipe_sha256": folder.recipe_sha256,
        "local_inputs": published != folder.raw_recipe,
        "sharded": folder.index is not None,
        "architecture": folder.architecture,
    }


def _repair_context(recipe: ModelRecipe) -> list[dict[str, str]]:
    """The repairs applied to the merge (SVC, LOT), each by its name, reference and hyper-parameters (and a
    data-using one's calibration draw); a name the registry does not know is shown as recorded."""
    from featcal.repairs.catalog import get_repair

    out = []
    for entry in recipe.repairs:
        try:
            repair = get_repair(entry["method"])
            name, url = repair.pretty_name, repair.reference_url
        except UnknownNameError:
            name, url = entry["method"], ""
        values = entry["params"]
        shown = [f"{key} = {value}" for key, value in values.items() if not isinstance(value, Mapping)]
        draw = values.get("calibration")
        if isinstance(draw, Mapping):  # a data-using repair's (LOT's) calibration draw
            shown.append(
                f"{draw.get('num_calibration_examples')} calibration examples per task, seed {draw.get('seed')}"
            )
        params = ", ".join(shown)
        out.append({"pretty_name": name, "url": url, "params": params})
    return out


def render_folder_card(
    folder: ModelFolder, *, repo_id: str | None = None, license: str | None = None, template: str | Path | None = None
) -> ModelCard:
    """The model card of a model folder's release, from the family's folder card template.

    Args:
        folder: The model folder (:func:`~featcal.release.model_folder.read_model_folder`).
        repo_id: The Hub repository the card names (metadata ``model_name`` and the usage snippet).
        license: The license in the metadata; None gives the family's default, where it has none ``other`` and a
            line in the card saying none was given.
        template: A Jinja model card template of your own.

    Returns:
        The card.

    Raises:
        InvalidParameterError: for a ``repo_id`` that is not ``namespace/name``.
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    if repo_id is not None:
        check_repo_id(repo_id, namespace=True)
    return render_template_card(
        template,
        get_family(folder.family),
        lambda: folder_context(folder, repo_id=repo_id, license=license),
        folder=True,
    )
