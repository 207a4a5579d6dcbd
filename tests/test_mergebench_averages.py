"""How MergeBench's five domain scores combine in a run's card, model-index and release ``metrics.json``: the
average normalised by each domain's expert (MergeBench's normalised performance) is the headline, beside the
paper's numbers; the raw mean is shown and labelled. No model runs: the run folder's stage results are given."""

from __future__ import annotations

from statistics import fmean
from types import SimpleNamespace

import pytest

from featcal.families.causal_lm.mergebench_eval.card import eval_results, release_metrics, results_section
from featcal.families.causal_lm.mergebench_eval.protocol import DOMAIN_NAMES, MERGEBENCH
from featcal.families.causal_lm.mergebench_eval.scores import HEADLINE, stage_table

EXPERTS = {"instruction": 0.5, "math": 0.4, "multilingual": 0.5, "coding": 0.2, "safety": 0.8}
MERGED = {"instruction": 0.25, "math": 0.2, "multilingual": 0.5, "coding": 0.1, "safety": 0.4}
CALIBRATED = {"instruction": 0.5, "math": 0.3, "multilingual": 0.5, "coding": 0.2, "safety": 0.4}


def _entry(domains: dict[str, float]) -> dict:
    return {"protocol": "mergebench", "domains": domains, "average": fmean(domains.values()), "safety": "variant"}


def _run(experts: dict[str, float], *, backbone: str = "llama-3.2-3b") -> SimpleNamespace:
    """A run folder's view as the card reads it: the stages' ``metrics.json`` and the run's record."""
    calibrated = SimpleNamespace(metrics={MERGEBENCH: _entry(CALIBRATED)})
    return SimpleNamespace(
        base_metrics=None,
        merged=SimpleNamespace(metrics={MERGEBENCH: _entry(MERGED)}),
        calibrated=calibrated,
        released=calibrated,
        expert_metrics={name: {MERGEBENCH: _entry({name: value})} for name, value in experts.items()},
        record=SimpleNamespace(suite="mergebench", backbone=backbone, merge=SimpleNamespace(method="task_arithmetic")),
    )


def _row(section: str, title: str) -> list[str]:
    line = next(line for line in section.splitlines() if line.startswith(f"| {title} |"))
    return [cell.strip() for cell in line.strip("|").split("|")[1:]]


def test_the_headline_is_the_average_normalised_by_each_expert() -> None:
    table = stage_table({"merged": _entry(MERGED)}, {n: _entry({n: v}) for n, v in EXPERTS.items()})
    assert table["headline"] == HEADLINE == "normalized"
    merged = table["stages"]["merged"]
    assert merged["normalized"] == pytest.approx(fmean(MERGED[n] / EXPERTS[n] for n in DOMAIN_NAMES))  # 0.6
    assert merged["average"] == pytest.approx(fmean(MERGED.values()))  # the raw mean, 0.29: not the headline


def test_the_card_shows_the_normalised_average_first_beside_the_paper_s_numbers() -> None:
    section = results_section(_run(EXPERTS))
    assert section is not None
    lines = section.splitlines()
    titles = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "---" not in line]
    assert titles == ["Domain", *DOMAIN_NAMES, "normalised average (MergeBench's)", "raw average"]
    assert _row(section, "Domain") == ["expert", "merged", "calibrated"]
    assert _row(section, "normalised average (MergeBench's)") == ["100.0", "60.0", "85.0"]
    assert _row(section, "raw average") == ["48.0", "29.0", "38.0"]
    paper = lines[-1]
    assert "merged 60.1, calibrated 62.1" in paper and "to compare with the normalised average" in paper
    assert "63.5" in results_section(_run(EXPERTS, backbone="llama-3.1-8b"))


def test_the_model_index_gives_the_normalised_average_before_the_raw_one() -> None:
    results = eval_results(_run(EXPERTS))
    assert [r.metric_type for r in results] == [*DOMAIN_NAMES, "normalized", "average"]
    assert results[-2].metric_value == 85.0 and results[-2].metric_name == "normalised average (MergeBench's)"
    assert results[-1].metric_value == 38.0 and results[-1].metric_name == "raw average"


def test_the_release_metrics_hold_the_headline_average_and_the_experts_it_divides_by() -> None:
    added = release_metrics(_run(EXPERTS))[MERGEBENCH]
    assert added["headline"] == "normalized" and added["normalized"] == pytest.approx(0.85)
    assert added["average"] == pytest.approx(0.38) and added["experts"] == EXPERTS
    assert added["domains"] == CALIBRATED  # the released stage's own entry, kept
    # an expert scoring 0 on its domain: no ratio to it, no normalised average (None, never a wrong number)
    assert release_metrics(_run({**EXPERTS, "coding": 0.0}))[MERGEBENCH]["normalized"] is None
    run = _run(EXPERTS)
    run.released = SimpleNamespace(metrics={"average": {}})  # a stage not scored by the protocol
    assert release_metrics(run) == {}


def test_each_domain_reads_the_metric_docs_causal_lm_names() -> None:
    """No source read names a domain's metric (docs/causal-lm.md, *Each domain's metric*): featcal's choices,
    pinned."""
    from featcal.families.causal_lm.mergebench_eval.protocol import CODE_METRIC, domain

    assert [(t.name, t.metric) for t in domain("instruction").harness] == [("ifeval", "prompt_level_strict_acc,none")]
    assert [(t.name, t.metric) for t in domain("math").harness] == [("gsm8k_cot", "exact_match,strict-match")]
    multilingual = domain("multilingual").harness
    assert len(multilingual) == 12 and {t.metric for t in multilingual} == {"acc,none"}
    assert [c.name for c in domain("coding").code] == ["humanevalplus", "mbppplus"] and CODE_METRIC == "pass@1"
