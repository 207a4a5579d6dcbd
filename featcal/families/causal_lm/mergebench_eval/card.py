"""MergeBench's scores in a run's model card: a results section beside the paper's averages, ``model-index``
entries for the released model, and the scores combined across stages in its release's ``metrics.json``.

Everything comes from the run folder: each stage's ``metrics.json`` holds the protocol's results under
``mergebench`` (the experts' under each task's entry), combined by :func:`.scores.stage_table`. This module
imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from featcal.families.causal_lm.mergebench_eval.protocol import DOMAIN_NAMES, MERGEBENCH, SAFETY_VARIANT
from featcal.families.causal_lm.mergebench_eval.scores import HEADLINE, RAW, stage_table

if TYPE_CHECKING:
    from featcal.runfolder.reader import RunFolder

STAGES = ("base", "expert", "merged", "calibrated")
ROWS = (*DOMAIN_NAMES, HEADLINE, RAW)
ROW_TITLES = {HEADLINE: "normalised average (MergeBench's)", RAW: "raw average"}


def protocol_table(run: RunFolder) -> dict[str, Any] | None:
    """The run's MergeBench scores by stage (:func:`.scores.stage_table`); None when no stage has them.

    Args:
        run: The run folder.
    """
    reports = {
        "base": (run.base_metrics or {}).get(MERGEBENCH),
        "merged": (run.merged.metrics or {}).get(MERGEBENCH) if run.merged else None,
        "calibrated": (run.calibrated.metrics or {}).get(MERGEBENCH) if run.calibrated else None,
    }
    experts = {
        name: entry.get(MERGEBENCH) for name, entry in (run.expert_metrics or {}).items() if isinstance(entry, dict)
    }
    if not any(reports.values()) and not any(experts.values()):
        return None
    return stage_table(reports, experts)


NOT_RUN = (
    "wildguardtest, harmbench, xstest and do_anything_now (MergeBench's safety-eval fork), whose responses a "
    "classifier judges (WildGuard, a 7B model): the safety score above is FusionBench's lm-eval variant instead"
)


def card_context(run: RunFolder) -> dict[str, Any]:
    """The card's variables of the protocol: ``mergebench_section`` (None without its scores), the released
    model's ``model_index_results``, and, when the protocol ran, ``not_run`` (MergeBench's judged safety alone,
    where FusionBench's variant ran in its place: ``--mergebench-safety fusionbench``).

    Args:
        run: The run folder.
    """
    section = results_section(run)
    context: dict[str, Any] = {"mergebench_section": section, "model_index_results": eval_results(run)}
    if section is not None:  # the protocol ran coding; safety too, when judged
        context["not_run"] = [{"task": "safety", "what": NOT_RUN}] if _safety(run) == SAFETY_VARIANT else []
    return context


def _reports(run: RunFolder) -> list[dict[str, Any]]:
    stages = [run.base_metrics, run.merged.metrics if run.merged else None,
              run.calibrated.metrics if run.calibrated else None]  # fmt: skip
    return [m[MERGEBENCH] for m in stages if m and isinstance(m.get(MERGEBENCH), dict)]


def _safety(run: RunFolder) -> str:
    """What the run's safety domain is (its stages' ``safety``): FusionBench's variant unless judged."""
    return next((r["safety"] for r in _reports(run) if r.get("safety")), SAFETY_VARIANT)


def _safety_words(run: RunFolder) -> str:
    safety = _safety(run)
    if safety == SAFETY_VARIANT:
        return f"safety: {SAFETY_VARIANT}, so its score and the averages are not those of the paper's safety protocol"
    judge = next((r["judge"] for r in _reports(run) if r.get("judge")), {})
    count = judge.get("parameters", 0)
    scaled = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    size = f"{scaled} parameters, about {judge.get('bf16_weights_gb')} GB in bf16"
    return f"safety: {safety} (the judge {judge.get('id')}: {size})"


def _value(row: dict[str, Any], key: str) -> float | None:
    return row.get(key) if key in (HEADLINE, RAW) else (row.get("domains") or {}).get(key)


def _released_stage(run: RunFolder) -> str:
    return "calibrated" if run.calibrated else "merged"


def release_metrics(run: RunFolder) -> dict[str, Any]:
    """What a release's ``metrics.json`` holds of the protocol beside its released stage's results: that stage's
    ``mergebench`` entry with the headline average normalised by the run's experts.

    Args:
        run: The run folder.

    Returns:
        ``{"mergebench": {..., "average": raw, "normalized": headline, "experts": {domain: score},
        "headline": "normalized"}}`` (``normalized`` None unless every expert was scored on its domain); empty
        when the released stage was not scored by the protocol.
    """
    entry = (run.released.metrics or {}).get(MERGEBENCH)
    table = protocol_table(run)
    row = (table or {}).get("stages", {}).get(_released_stage(run))
    if not isinstance(entry, dict) or table is None or row is None:
        return {}
    return {MERGEBENCH: {**entry, HEADLINE: row[HEADLINE], "experts": table["experts"], "headline": HEADLINE}}


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def results_section(run: RunFolder) -> str | None:
    """The card's MergeBench section (Markdown), or None when the run was not evaluated by the protocol.

    Args:
        run: The run folder.

    Returns:
        A table of the domain scores and both averages (in %) of every stage measured, the normalised one first
        (MergeBench's, the one the paper's averages on the run's backbone, given beneath, are compared with),
        and what the scores are.
    """
    table = protocol_table(run)
    if table is None:
        return None
    stages = [
        s for s in STAGES if s in table["stages"] and any(_value(table["stages"][s], k) is not None for k in ROWS)
    ]
    lines = [
        "### MergeBench (five domains)",
        "",
        "Scored by MergeBench's protocol (`--eval-protocol mergebench`): lm-evaluation-harness on instruction "
        "(ifeval), math (gsm8k_cot) and multilingual (m_mmlu, arc, hellaswag in fr, es, de, ru) with each task's "
        "own settings and no chat template; coding as bigcode-evaluation-harness samples it (humanevalplus, "
        "mbppplus, pass@1 of 10 samples at temperature 0.2), the model-generated programs run in featcal's "
        f"sandbox only because `--allow-code-execution` was given; {_safety_words(run)}. Scores in %; *expert* is "
        "each domain's expert on its own domain. The normalised average is MergeBench's normalised performance: "
        "the mean over the domains of the model's score divided by the expert's (it needs `--eval-experts`, and an "
        "expert scoring above 0 on each domain); the raw average is the plain mean of the five scores.",
        "",
        "| Domain | " + " | ".join(stages) + " |",
        "|---|" + "---:|" * len(stages),
    ]
    for key in ROWS:
        values = [_pct(_value(table["stages"][s], key)) for s in stages]
        lines.append(f"| {ROW_TITLES.get(key, key)} | " + " | ".join(values) + " |")
    reference = _paper(run)
    if reference:
        lines += ["", reference]
    return "\n".join(lines)


def _paper(run: RunFolder) -> str | None:
    from featcal.suites import merged_reference, reference_source

    suite, backbone = run.record.suite, run.record.backbone
    if suite != "mergebench" or backbone is None:
        return None
    method = run.record.merge.method
    averages = merged_reference(suite, backbone)
    merged = averages.get(method, {}).get("average")
    calibrated = averages.get(f"{method}_featcal", {}).get("average")
    if merged is None and calibrated is None:
        return None
    return (
        f"**The paper's averages (not measured here):** merged {_pct(merged)}, calibrated {_pct(calibrated)} "
        f"({reference_source(suite, backbone)}), to compare with the normalised average above: MergeBench reports "
        "normalised performance; that the FeatCal paper's numbers are that average is inferred, not stated in the "
        "copies of its text read (docs/causal-lm.md)."
    )


def eval_results(run: RunFolder) -> list[Any]:
    """The released model's MergeBench scores (each domain, the normalised then the raw average; in %) as
    ``model-index`` results.

    Args:
        run: The run folder.

    Returns:
        ``huggingface_hub.EvalResult``s; none when the released stage was not scored by the protocol.
    """
    from huggingface_hub import EvalResult

    table = protocol_table(run)
    row = (table or {}).get("stages", {}).get(_released_stage(run))
    if row is None:
        return []
    return [
        EvalResult(
            task_type="text-generation", dataset_type="mergebench", dataset_name="MergeBench (five domains)",
            metric_type=key, metric_name=ROW_TITLES.get(key, key), metric_value=round(100 * value, 2),
        )
        for key in ROWS
        if (value := _value(row, key)) is not None
    ]  # fmt: skip
