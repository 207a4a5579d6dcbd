"""The table of a run's repair comparison (``<run>/repairs/*.json``): ``featcal compare RUN`` and the model card.

One row per compared entry (a repair, labelled with the hyper-parameters its entry gave, ``svc:alpha=0.3``),
after the merge it starts from: the score per task (accuracy, the task's own metric, or
a language task's exact match) and their mean in % (a task no result has a score for, such as a language task
evaluated by its loss alone: its loss), the wall time and peak RSS of the repair's own process,
and whether its result is releasable. Only the results of the run as its ``run_config.json`` now stands are shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import FeatcalError
from featcal.memory import GIB
from featcal.metrics import AVERAGE, EXACT_MATCH, is_task_result, task_score
from featcal.repairs.comparison import REPAIRS_DIR
from featcal.repairs.entries import entry_label

if TYPE_CHECKING:
    from featcal.runfolder.reader import RunFolder

MERGE = "merge"


def read_comparison(run_dir: str | Path) -> list[dict[str, Any]]:
    """The merge's and each repair's result of the run in ``run_dir``: the merge first, FeatCal next, then the
    others by name (a repair's entries by label); results of an earlier recipe of the run are left out.

    Raises:
        RunFolderError: when ``run_dir`` holds no readable ``run_config.json``.
    """
    from featcal.files.reading import read_json
    from featcal.runfolder.layout import RUN_CONFIG
    from featcal.runfolder.record import read_run_config

    run = Path(run_dir).expanduser()
    run_id = read_run_config(run / RUN_CONFIG, f"Run folder {run}").recipe_sha256
    folder = run / REPAIRS_DIR
    found = [read_json(path) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    rows = [row for row in found if isinstance(row, dict) and row.get("run_id") == run_id and "metrics" in row]
    order = {MERGE: 0, "featcal": 1}
    return sorted(rows, key=lambda row: (order.get(row["repair"], 2), row["repair"], row_label(row)))


def row_label(row: Mapping[str, Any]) -> str:
    """A result's name in the table: the repair's, with the hyper-parameters its entry gave (``svc:alpha=0.3``)."""
    return entry_label(row["repair"], row.get("setting") or {})


def task_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tasks of the results, in the order of the first result's report."""
    return [name for name, value in rows[0]["metrics"].items() if name != AVERAGE and is_task_result(value)]


def score(metrics: Mapping[str, Any], task: str) -> float | None:
    """A task's score (0..1) in a ``metrics.json`` report: its accuracy or its metric's value, else (a language
    model's task) its exact match; for :data:`AVERAGE`, the mean of the tasks' scores when every task has one.

    Returns:
        The score, or None where there is none.
    """
    if task == AVERAGE:
        scores = [score(metrics, name) for name, value in metrics.items() if name != AVERAGE and is_task_result(value)]
        return None if not scores or None in scores else sum(scores) / len(scores)  # type: ignore[arg-type]
    entry = metrics.get(task)
    value = task_score(entry)
    if value is None and isinstance(entry, Mapping) and entry.get(EXACT_MATCH) is not None:
        value = float(entry[EXACT_MATCH])
    return value


def loss(metrics: Mapping[str, Any], task: str) -> float | None:
    """A task's loss in a ``metrics.json`` report (for :data:`AVERAGE`, the average's); None where there is none."""
    entry = metrics.get(task)
    return float(entry["loss"]) if isinstance(entry, Mapping) and entry.get("loss") is not None else None


def _by_loss(rows: Sequence[Mapping[str, Any]], column: str) -> bool:
    """Whether a column shows the loss: no result has a score for it (a language task scored by its loss alone)."""
    return all(score(row["metrics"], column) is None for row in rows) and any(
        loss(row["metrics"], column) is not None for row in rows
    )


def _cell(metrics: Mapping[str, Any], column: str, by_loss: bool) -> str:
    value = loss(metrics, column) if by_loss else score(metrics, column)
    return "—" if value is None else f"{value:.4f}" if by_loss else f"{100 * value:.2f}"


def comparison_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of the results (:func:`read_comparison`): each column's score in %, or, for a column no
    result has a score for, its loss (headed ``NAME loss``).

    Returns:
        Its lines joined, one row per result.
    """
    columns = [*task_names(rows), AVERAGE]
    by_loss = {column: _by_loss(rows, column) for column in columns}
    head = ["repair", *(f"{c} loss" if by_loss[c] else c for c in columns), "wall s", "peak RSS GiB", "releasable"]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join("---:" for _ in head[1:-1]) + " | --- |"]
    for row in rows:
        metrics = row["metrics"]
        is_merge = row["repair"] == MERGE
        cost = ["—", "—"] if is_merge else [f"{row['seconds']:.1f}", f"{row['peak_rss_bytes'] / GIB:.2f}"]
        released = "—" if is_merge else "yes" if row["releasable"] else "no (modules)"
        name = "merge (no repair)" if is_merge else row_label(row)
        cells = [name, *(_cell(metrics, c, by_loss[c]) for c in columns), *cost, released]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """A sentence giving the import floor every repair's process paid (the first repair's measure)."""
    floor = next((row["floor"] for row in rows if row.get("floor")), None)
    if floor is None:
        return ""
    return (
        f"Each repair ran as `featcal calibrate --method NAME` in a process of its own; wall time and peak RSS "
        f"(its own `VmHWM`) are that process's, imports and loading included: a process that only imports torch, "
        f"transformers and featcal took {floor['seconds']:.1f} s and {floor['peak_rss_bytes'] / GIB:.2f} GiB."
    )


def comparison_text(run_dir: str | Path) -> str:
    """``featcal compare``'s output: the table and the floor line.

    Raises:
        FeatcalError: when the run holds no comparison.
        RunFolderError: when ``run_dir`` holds no readable ``run_config.json``.
    """
    rows = read_comparison(run_dir)
    if not any(row["repair"] != MERGE for row in rows):
        raise FeatcalError(
            f"{run_dir} holds no repair comparison of its run: run it with `featcal run ... --repair NAME ...` first."
        )
    return f"{comparison_table(rows)}\n\n{floor_line(rows)}"


def card_section(run_dir: str | Path) -> str:
    """The model card's section on the run's repair comparison; empty when the run compared none."""
    rows = read_comparison(run_dir)
    if not any(row["repair"] != MERGE for row in rows):
        return ""
    return (
        "\n## Post-merge repairs side by side\n\n"
        "Each repair below started from this run's merge and read the same calibration examples (the run's "
        "draw: same number per task, same seed); scores in % on the test examples evaluated above. Only a "
        "releasable repair gives a model: Representation Surgery and ProbSurgery add per-task modules on top "
        "of the merge, so they are compared here and never released. The released model is the run's own."
        f"{_loss_note(rows)}\n\n"
        f"{comparison_table(rows)}\n\n{floor_line(rows)}\n"
    )


def _loss_note(rows: Sequence[Mapping[str, Any]]) -> str:
    """The card's sentence on the columns that show a loss, when there are any."""
    if not any(_by_loss(rows, column) for column in [*task_names(rows), AVERAGE]):
        return ""
    return " A column headed `NAME loss` gives the task's loss (lower is better): no result has a score for it."


def comparison_section(run: RunFolder) -> str | None:
    """The run card's section on the repairs compared on the run's merge (``featcal run --repair``), one of
    :data:`featcal.release.run_card.CARD_SECTIONS`; None when the run compared none, so that every other card
    stays as it was.

    Args:
        run: The run folder.

    Returns:
        The section's Markdown, or None.
    """
    return card_section(run.path) or None
