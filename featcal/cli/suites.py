"""`featcal tasks`: the tasks of a built-in suite on a backbone, with their data and reference numbers.

Reads the package's JSON tables only, so it imports no torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from featcal.cli.options import add_options, command, given_values
from featcal.options import field_option, option, validate
from featcal.spec import RunSpec
from featcal.suites import check_backbone, default_backbone, describe_suite


@dataclass(frozen=True)
class SuiteChoice:
    """A built-in suite on a backbone, as `featcal tasks` and `featcal methods` take them (the run's options)."""

    suite: str = field_option(RunSpec, "suite", help="the suite", group="")
    backbone: str | None = field_option(RunSpec, "backbone", help="the backbone (default: the suite's)", group="")
    json: bool = option(False, help="print the listing as JSON")

    def __post_init__(self) -> None:
        validate(self)
        if self.backbone is None:
            object.__setattr__(self, "backbone", default_backbone(self.suite))
        check_backbone(self.suite, self.backbone)


REFERENCE_COLUMNS = {"zero_shot": "zero-shot", "expert": "expert"}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _table(header: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Aligned lines: the first ``left`` columns are text (left-aligned), the rest numbers."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(header).rstrip(), *(line(r).rstrip() for r in rows)]


def format_text_suite(listing: Mapping[str, Any]) -> str:
    """A language-model suite's listing: per task its dataset, the columns its text reads, its answer rule,
    expert and lm-evaluation-harness tasks; the merge settings, what is not run, the quoted averages."""
    rows = [
        [
            t["name"],
            t["dataset"],
            t["train_split"],
            ", ".join(t["columns"]),
            t["answer"] or "-",
            t["expert"],
            ", ".join(t["lm_eval"]) or "-",
        ]
        for t in listing["tasks"]
    ]
    header = ["task", "dataset", "split", "columns", "answer", "expert", "lm-eval tasks"]
    out = [
        f"Suite {listing['suite']}: {listing['title']}, {len(listing['tasks'])} tasks, on {listing['backbone_title']}",
        f"Base {listing['base_model']}; experts {listing['expert_model_pattern']}",
        "",
        *_table(header, rows, left=len(header)),
        "",
        "Merge: " + "; ".join(f"{m} {params}" for m, params in listing["merge_defaults"].items()),
    ]
    if listing.get("featcal_settings"):
        out.append(f"FeatCal: {listing['featcal_settings']}.")
    for t in listing["tasks"]:
        if t["not_run"]:
            out.append(f"Not run by featcal ({t['name']}): {t['not_run']}.")
    averages = listing["reference_average"]
    if averages:
        quoted = ", ".join(f"{m} {_pct(v)}" for m, v in averages.items())
        out.append(
            f"Reference averages (not measured by featcal): {quoted}, from {listing['merged_reference_source']}."
        )
    else:
        out.append("No reference average is quoted for this backbone.")
    source = listing["source"]
    out.append(f"Source: {source['repository']} at {source['commit'][:12]}; {source['models']}.")
    return "\n".join(out)


def format_suite(listing: Mapping[str, Any]) -> str:
    """The listing of :func:`featcal.suites.describe_suite` as a plain-text table, accuracies in %.

    A language-model suite (mergebench) has a listing of its own (:func:`format_text_suite`). A suite of
    text-to-text tasks (FLAN-T5 on GLUE) shows each task's metric and number of label words (``-`` for a score,
    STS-B's) in place of classes and prompt templates, and its pre-trained model's scores as ``pre-trained``; its
    scores are exact match in %, Spearman's ρ × 100 for a task whose metric says so.
    """
    if "merge_defaults" in listing:  # a language-model suite's listing
        return format_text_suite(listing)
    methods = sorted({m for t in listing["tasks"] for m in t["reference_accuracy"]} - set(REFERENCE_COLUMNS))
    columns = [*REFERENCE_COLUMNS, *methods]
    text = any("metric" in t for t in listing["tasks"])
    names = {**REFERENCE_COLUMNS, **({"zero_shot": "pre-trained"} if text else {})}
    headings = [names.get(c, c) for c in columns]
    rows = [
        [
            t["name"],
            t["dataset"] + (f" ({t['config']})" if t["config"] else ""),
            t["test_split"],
            *([t["metric"], str(t["classes"] or "-")] if text else [str(t["classes"]), str(t["templates"])]),
            *(_pct(t["reference_accuracy"].get(c)) for c in columns),
        ]
        for t in listing["tasks"]
    ]
    if listing["reference_average"]:
        rows.append(["average", "", "", "", "", "", "", *(_pct(listing["reference_average"].get(m)) for m in methods)])
    header = ["task", "dataset", "test split", *(["metric", "labels"] if text else ["classes", "templates"]), *headings]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    left = 4 if text else 3  # task, dataset, split (and metric) are text; the rest numbers

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    scores = "scores in % (exact match; Spearman's rho x 100 for a spearman task)" if text else "accuracies (%)"
    out = [
        f"Suite {listing['suite']}: {listing['title']}, {len(listing['tasks'])} tasks, on {listing['backbone_title']}",
        f"Base {listing['base_model']}; experts {listing['expert_model_pattern']}",
        "",
        line(header),
        *(line(r) for r in rows),
        "",
        f"{headings[0]}, expert: {scores} published by {listing['single_model_reference_source']}.",
    ]
    if methods:
        out.append(f"{', '.join(methods)}: merge {scores} published by {listing['merged_reference_source']}.")
    else:
        out.append("No per-task merge accuracy is published for this suite and backbone.")
    only_average = {m: v for m, v in listing["reference_average"].items() if m not in methods}
    if only_average:  # published as an average alone (the FeatCal paper's FLAN-T5 result)
        averages = ", ".join(f"{m} {_pct(v)}" for m, v in only_average.items())
        out.append(f"Published as an average only: {averages} (same source).")
    out.append(f"Source: {listing['source']['repository']} at {listing['source']['commit'][:12]}.")
    return "\n".join(out)


def cmd_tasks(args: argparse.Namespace) -> int:
    choice = SuiteChoice(**given_values(args, SuiteChoice))
    listing = describe_suite(choice.suite, choice.backbone)
    print(json.dumps(listing, indent=1) if choice.json else format_suite(listing))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tasks`, with ``func`` set to its handler."""
    p = subparsers.add_parser(
        "tasks",
        help="list the tasks of a built-in suite: datasets, classes, templates, reference accuracies",
        description="The tasks of a built-in suite on a CLIP backbone, with their datasets, number of classes "
        "and prompt templates, and the accuracies FusionBench (or the FeatCal reference run) publishes.",
    )
    add_options(p, SuiteChoice)
    command(p, cmd_tasks)
