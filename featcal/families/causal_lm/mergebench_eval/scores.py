"""MergeBench's per-domain scores and their averages, for every stage of a run.

A domain's score is the mean of its tasks' metrics (:data:`~.protocol.DOMAINS` names them). Two averages
over the five domains are reported:

- ``normalized`` (the headline, :data:`HEADLINE`): the mean over domains of the model's score divided by the
  domain's expert's score on its own domain, when every expert was measured: MergeBench's *normalised
  performance*, the metric the MergeBench paper reports (its issue tracker, github.com/uiuctml/MergeBench
  issues 4 and 5: "the main evaluation metric is reported as normalized performances over tasks", "the
  reported results are mainly presented as normalized scores across all tasks", the authors answering the
  latter with a promise of raw per-task results; issue 17 asks for the experts' own scores to compute
  "merged / expert performance"). The FeatCal paper's MergeBench numbers (60.1 / 62.1, 63.5 / 65.8) are
  compared with this one; its stored copies hold no text saying which average they are.
- ``average`` (raw): the plain mean of the five scores, shown beside it and labelled.

MergeBench's code (uiuctml/MergeBench at b245648) holds no script that combines the domains: its result
files (``merged_models/*/lm_eval.json``, ``code_eval.json``, ``safety_eval.json``) hold the raw metrics.
Those of its own Llama-3.2-3B merge (RegMean++) are math 0.351 (gsm8k_cot strict-match), multilingual 0.417
(the mean acc of the twelve tasks), instruction 0.068 (ifeval prompt-level strict), coding 0.310 and 0.430
(pass@1): their raw mean, 0.30, is far from the 60.1 the FeatCal paper reports for Task Arithmetic, as a raw
average would not be. Whether a domain of several datasets is averaged before its ratio to the expert (as
here) or each dataset is normalised first is what issue 4 asks; its answer is not in the stored copy. This
module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Any

from featcal.families.causal_lm.mergebench_eval.protocol import CODE_METRIC, DOMAIN_NAMES, domain

HEADLINE = "normalized"  # the average compared with the papers' MergeBench numbers
RAW = "average"


def domain_score(results: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    """A domain's score: the mean of its tasks' metrics; None when one is missing.

    Args:
        results: The protocol's results by task, then metric.
        name: The domain.

    Returns:
        The score (a fraction), or None (also when a metric is not finite: the harness gives NaN where a
        task's normalisation divides by zero).
    """
    spec = domain(name)
    values = [results.get(t.name, {}).get(t.metric) for t in spec.harness]
    values += [results.get(c.name, {}).get(CODE_METRIC) for c in spec.code]
    if not values or any(v is None or not math.isfinite(float(v)) for v in values):
        return None
    return fmean(float(v) for v in values if v is not None)


def domain_scores(results: Mapping[str, Mapping[str, float]], domains: Sequence[str] = DOMAIN_NAMES) -> dict[str, Any]:
    """Each domain's score (None where a task's metric is missing)."""
    return {name: domain_score(results, name) for name in domains}


def raw_average(scores: Mapping[str, float | None]) -> float | None:
    """The plain mean of the five domains' scores; None unless all five are measured."""
    values = [scores.get(name) for name in DOMAIN_NAMES]
    return None if any(v is None for v in values) else fmean(float(v) for v in values if v is not None)


def normalized_average(scores: Mapping[str, float | None], experts: Mapping[str, float | None]) -> float | None:
    """The mean over domains of ``scores[d] / experts[d]``: MergeBench's normalised performance.

    Args:
        scores: A model's domain scores.
        experts: Each domain's expert's score on its own domain.

    Returns:
        The average, or None unless all five domains have a score and a positive expert score.
    """
    ratios = []
    for name in DOMAIN_NAMES:
        score, expert = scores.get(name), experts.get(name)
        if score is None or expert is None or expert <= 0:
            return None
        ratios.append(float(score) / float(expert))
    return fmean(ratios)


def stage_table(reports: Mapping[str, Mapping[str, Any] | None], expert_reports: Mapping[str, Any] | None) -> dict:
    """Every stage's domain scores and averages, as ``metrics.json`` and the card show them.

    Args:
        reports: By stage (``base``, ``merged``, ``calibrated``), the protocol's results of that stage
            (``metrics.json``'s ``mergebench`` entry), or None where the stage was not evaluated so.
        expert_reports: By domain, the protocol's results of the domain's expert on it (``mergebench`` of
            each task's entry of the experts' ``metrics.json``).

    Returns:
        ``{"headline": HEADLINE, "experts": {domain: score}, "stages": {stage: {"domains", "average",
        "normalized"}}}``: ``average`` the raw mean, ``normalized`` the headline (None without every expert).
    """
    experts = {}
    for name in DOMAIN_NAMES:
        entry = (expert_reports or {}).get(name) or {}
        experts[name] = (entry.get("domains") or {}).get(name)
    stages = {}
    for stage, report in reports.items():
        if not report:
            continue
        scores = dict(report.get("domains") or {})
        stages[stage] = {
            "domains": scores,
            RAW: raw_average(scores),
            HEADLINE: normalized_average(scores, experts),
        }
    expert_row = {
        "domains": experts,
        RAW: raw_average(experts),
        HEADLINE: normalized_average(experts, experts),
    }
    return {"headline": HEADLINE, "experts": experts, "stages": {"expert": expert_row, **stages}}
