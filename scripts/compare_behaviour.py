"""Run the same featcal commands with two source trees on this machine and compare what they write.

    nice -n 10 .venv/bin/python scripts/compare_behaviour.py --before 2533dc7 --workdir /tmp/compare
    options: --after FOLDER_OR_COMMIT (default: this checkout, uncommitted changes included),
             --cases tiny-fixture,mini8-tiny,mini8,lm5-tiny,t5x4-tiny,lm-mergekit,t5-mergekit
             (default tiny-fixture,mini8-tiny), --allow FILE, --loss-rtol R (default 0)

How the two trees run. One interpreter, the one running this script (the project's venv), and two
source trees: every command is ``python -m featcal ARGS`` with ``PYTHONPATH=<tree>``. A folder on
PYTHONPATH comes before the venv's editable install of featcal; that is checked before anything runs
(``import featcal`` must load from the tree). A commit is extracted once with ``git archive`` into
``WORKDIR/trees/<sha>`` and reused by later calls; a folder runs as it is. No second venv: both trees
run on the same torch, transformers and datasets, so the comparison is of featcal's code alone. Two
things come from the venv, not from the tree: ``featcal.__version__`` (installed metadata) and the
dependencies; the report notes where the trees' ``pyproject.toml`` differ in either.

The cases, each run by the before tree, then by the after tree, never at the same time:

- ``tiny-fixture``: the golden command of the before tree's ``tests/golden/tiny_fixture_run.json``
  (``--no-export``, as recorded), ``featcal export`` of that run, ``featcal merge`` with each method of
  ``MERGE_METHODS`` and ``featcal calibrate`` of the Task Arithmetic merge (about a minute a side), on
  the before tree's ``tests/fixtures/tiny-clip-3task`` copied to ``WORKDIR/inputs`` (in neither tree);
- ``mini8-tiny``: ``featcal demo --tiny``; ``mini8``: ``featcal demo`` (10+ minutes a side). The zoo is
  built once, by the before tree (a ``featcal demo --no-export`` run), into ``WORKDIR/zoo-cache``, and
  both sides read it from there with ``--cache-dir``; the zoo's build is therefore not compared.
- ``lm5-tiny`` and ``t5x4-tiny``: ``featcal demo --zoo lm5 --tiny`` and ``featcal demo --zoo t5x4 --tiny``
  (a tiny Llama and a tiny T5, three text tasks each: merge, FeatCal, evaluation, export; under a minute a
  side), their zoo built once by the before tree into ``WORKDIR/zoo-cache`` as for mini8 and read with
  ``--zoo-cache-dir``.
- ``lm-mergekit`` and ``t5-mergekit``: a mergekit-style output folder, the before tree's Task Arithmetic
  merge of that tiny zoo (the demo's ``ta`` stage) with featcal's own records left out
  (``featcal_recipe.json``, ``metrics.json``, ``run.log``: weights, config, tokenizer and
  ``mergekit_config.yml``, whose paths name the base and the experts), made once into
  ``WORKDIR/inputs/{lm,t5}-mergekit``; each side runs ``featcal calibrate`` of it (FeatCal, 8 examples a
  task, ``--data`` the zoo's data file) and ``featcal export`` of the result, for the LM also ``featcal
  calibrate --method svc`` of it and its export (a T5 is refused SVC), and ``featcal merge`` of the zoo's
  experts with each method of its ``TEXT_ZOOS`` entry (LM: Task Arithmetic, TIES, RegMean on 8 examples a
  task; T5: Task Arithmetic, TIES, TSV; a T5 is refused RegMean); one to two minutes a side.

Both sides read the same input folders, run in ``WORKDIR`` with the same environment (this process's,
plus ``PYTHONHASHSEED=0``, ``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``, ``FEATCAL_CACHE`` and an
``HF_HOME`` of their own under ``WORKDIR``) and the commands' own thread defaults. A command line uses
only flags the before tree has, spelled in full (an abbreviation can become ambiguous when a flag is
added), and global options before the command, so it runs unchanged on a tree that only adds flags;
every flag is looked up in both trees' ``--help`` before anything runs.

What is compared, over each case's output folder (``WORKDIR/runs/<case>/<side>``, emptied first):

- the set of files;
- ``*.safetensors``: tensor names, dtypes, shapes and bits, then the metadata and the file's bytes; a
  tensor that differs gets its largest absolute difference, its difference relative to the tensor and,
  for calibrated weights, relative to the calibration's update (calibrated minus merged);
- ``metrics.json`` and ``run.log``: every value exactly, losses within ``--loss-rtol`` relative;
- ``run_config.json``, ``stages.json`` and every other JSON file: key by key;
- ``timings.json``: the key names, and the values under ``settings`` (torch threads);
- ``release_manifest.json``: key by key, the card's SHA-256 checked against the side's own card first;
- ``README.md`` (the model card): a unified diff, one difference per hunk, keyed by its section;
- any other file: its bytes; each command's exit status and standard output.

Normalisation, the same on both sides, before comparing:

- paths: the side's output folder becomes ``<OUT>``, its source tree ``<SRC>``, the work folder
  ``<WORKDIR>`` (in JSON strings, safetensors metadata, cards and standard output);
- the card's ``## Runtime`` section: every number in a table cell becomes ``<n>`` (wall-clock seconds);
- ``release_manifest.json``: the card's SHA-256, once it matches the side's own card, becomes a marker
  (it hashes the runtime above; the card itself is compared normalised);
- standard output: every duration ``N s`` becomes ``<n> s``;
- ``timings.json``: values other than ``settings`` are not compared (wall-clock time and memory).

Expected differences: ``--allow FILE`` (YAML or JSON), a list (or ``{"allow": [...]}``) of entries with
``path`` (a glob over ``<case>/<path in the output folder>``, or ``<case>/stdout/<step>`` and
``<case>/exit/<step>``; ``*`` also matches ``/``), ``what`` (a kind below, or ``*``), ``issue`` and
``reason``, and optionally ``key`` (a glob over the JSON key, tensor name or card section) and
``match`` (a regular expression searched in the difference's text). Kinds: files, exit-status, stdout,
weights, safetensors-metadata, safetensors-bytes, metrics, loss, run_config, json, timings, manifest,
card, bytes, unreadable (a file that does not parse). Each difference is reported ALLOWED (with the
entry's issue and reason) or UNEXPECTED in ``WORKDIR/report.json`` and ``WORKDIR/summary.md``; the exit
status is 1 when any is UNEXPECTED, 2 when the comparison could not be set up.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml
from safetensors import SafetensorError, safe_open

CHECKOUT = Path(__file__).resolve().parents[1]
GOLDEN_RECORD = "tests/golden/tiny_fixture_run.json"
FIXTURE = "tests/fixtures/tiny-clip-3task"
MERGE_METHODS = ("task_arithmetic", "simple_average", "ties", "tsv", "iso_c", "wudi")
# what mergekit writes beside the weights has no featcal record: the run's own files are left out
NOT_MERGEKIT = ("featcal_recipe.json", "metrics.json", "run.log")
CASES = ("tiny-fixture", "mini8-tiny", "mini8", "lm5-tiny", "t5x4-tiny", "lm-mergekit", "t5-mergekit")
DEFAULT_CASES = "tiny-fixture,mini8-tiny"
MISSING = "<missing>"
DURATION = re.compile(r"\b\d+(?:\.\d+)?(?= s\b)")
TABLE_NUMBER = re.compile(r"(?<=\|)\s*-?\d+(?:\.\d+)?\s*(?=\|)")
HEADING = re.compile(r"^#{1,6} ")
RUNTIME_SECTION = "## Runtime"
MANIFEST_CARD = "README.md"


@dataclass(frozen=True)
class TextZoo:
    """A tiny text benchmark of ``featcal demo --zoo``: its mergekit case's prefix, the zoo's folder in the cache
    (``featcal/demo/``), the merging methods its ``featcal merge`` steps use and the data-free repairs its
    ``featcal calibrate --method`` steps apply (RegMean and SVC are refused for a T5)."""

    prefix: str
    demo: str
    folder: str
    merge_methods: tuple[str, ...]
    repairs: tuple[str, ...]


TEXT_ZOOS = (
    TextZoo("lm", "lm5", "tiny-lm-v1-seed0", ("task_arithmetic", "ties", "regmean"), ("svc",)),
    TextZoo("t5", "t5x4", "tiny-t5-v1-seed0", ("task_arithmetic", "ties", "tsv"), ()),
)
# a run's calibrated and released weights, and the merge their updates are measured from
DEMO_REFERENCES = {
    "run/featcal-ta/model.safetensors": "run/ta/model.safetensors",
    "run/release/model.safetensors": "run/ta/model.safetensors",
}
DATA_MERGES = ("regmean", "regmean_plusplus")  # the merging methods that take the calibration draw's flags


@dataclass(frozen=True)
class Side:
    """One of the two trees: ``name`` is ``before`` or ``after``; ``label`` says which code it is."""

    name: str
    tree: Path
    label: str


@dataclass(frozen=True)
class Step:
    """One command, ``python -m featcal *argv``; ``name`` names its logs and its output lines."""

    name: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    """Steps to run with each tree into an output folder, and the weights calibrated ones update from.

    ``prepare`` runs once with the before tree into its own folder, before both sides (the shared zoo);
    ``inputs`` then makes the case's input folders from that folder's outputs (the mergekit-style merge).
    ``references`` maps a weights file of the output folder to the one its update is measured from (in the
    before side's output folder, or an absolute path: an input).
    """

    name: str
    steps: Callable[[Path], tuple[Step, ...]]
    prepare: Callable[[Path], tuple[Step, ...]] = lambda out: ()
    inputs: Callable[[Path], None] = lambda out: None
    references: dict[str, str] = field(default_factory=dict)


@dataclass
class Difference:
    """One way the after side's outputs differ from the before side's, and the verdict on it."""

    case: str
    path: str
    what: str
    key: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
    status: str = "UNEXPECTED"
    issue: str = ""
    reason: str = ""


@dataclass(frozen=True)
class Allowance:
    """An expected difference from the ``--allow`` file, with the issue that made it."""

    path: str
    what: str
    issue: str
    reason: str
    key: str = "*"
    match: str = ""

    def covers(self, difference: Difference) -> bool:
        """Whether this entry names ``difference``."""
        return (
            fnmatch.fnmatchcase(f"{difference.case}/{difference.path}", self.path)
            and self.what in ("*", difference.what)
            and fnmatch.fnmatchcase(difference.key, self.key)
            and re.search(self.match, difference.detail) is not None
        )


@dataclass(frozen=True)
class StepResult:
    """How one step ended on one side."""

    step: str
    side: str
    returncode: int
    seconds: float
    stdout: str


@dataclass(frozen=True)
class Normaliser:
    """Rewrites one side's own paths (output folder, source tree, work folder) into placeholders."""

    replacements: tuple[tuple[str, str], ...]

    @classmethod
    def for_side(cls, out: Path, tree: Path, workdir: Path) -> Normaliser:
        """The longest path first, so the output folder wins over the work folder that holds it."""
        pairs = [(str(out), "<OUT>"), (str(tree), "<SRC>"), (str(workdir), "<WORKDIR>")]
        return cls(tuple(sorted(pairs, key=lambda pair: len(pair[0]), reverse=True)))

    def text(self, text: str) -> str:
        """``text`` with every path replaced."""
        for path, placeholder in self.replacements:
            text = text.replace(path, placeholder)
        return text

    def json(self, value: Any) -> Any:
        """``value`` with every string in it normalised."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k): self.json(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.json(v) for v in value]
        return value


@dataclass(frozen=True)
class Pair:
    """One file present on both sides, and what comparing it needs."""

    case: str
    path: str
    before: Path
    after: Path
    norms: tuple[Normaliser, Normaliser]
    loss_rtol: float
    reference: Path | None

    def differences(self, what: str, mismatches: list[tuple[str, Any, Any]]) -> list[Difference]:
        """One difference per mismatching key."""
        return [
            Difference(self.case, self.path, what, key, f"{key}: {_show(b)} → {_show(a)}", {"before": b, "after": a})
            for key, b, a in mismatches
        ]


# --- the two trees -------------------------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """Stop before comparing anything, with exit status 2 (1 means an unexpected difference)."""
    print(f"compare_behaviour: {message}", file=sys.stderr)
    raise SystemExit(2)


def git(*args: str, cwd: Path = CHECKOUT) -> str:
    """``git args`` in ``cwd``, its standard output stripped; a failure stops the script."""
    result = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def extract_commit(sha: str, workdir: Path) -> Path:
    """The tree of commit ``sha`` in ``WORKDIR/trees/<sha>``, extracted with ``git archive`` unless there."""
    target = workdir / "trees" / sha
    if target.is_dir():
        return target
    partial = target.with_name(f"{sha}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(CHECKOUT), "archive", "--format=tar", sha], capture_output=True)
    if archive.returncode != 0:
        fail(f"git archive {sha} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(partial, filter="data")
    partial.rename(target)
    return target


def commit_side(name: str, revision: str, workdir: Path) -> Side:
    """The side that runs commit ``revision``, extracted into the work folder."""
    sha = git("rev-parse", "--verify", f"{revision}^{{commit}}")
    subject = git("log", "-1", "--format=%h %s", sha)
    return Side(name, extract_commit(sha, workdir), f"commit {subject}")


def folder_side(name: str, tree: Path) -> Side:
    """The side that runs the source folder ``tree`` as it is."""
    tree = tree.resolve()
    if not (tree / "featcal" / "__init__.py").is_file():
        fail(f"{tree} holds no featcal package")
    label = f"folder {tree}"
    if (tree / ".git").exists():
        dirty = " with uncommitted changes" if git("status", "--porcelain", cwd=tree) else ""
        label += f" at {git('log', '-1', '--format=%h %s', cwd=tree)}{dirty}"
    return Side(name, tree, label)


def after_side(revision: str | None, workdir: Path) -> Side:
    """``--after``: a folder as it is, else a commit; by default the checkout holding this script."""
    if revision is None:
        return folder_side("after", CHECKOUT)
    if Path(revision).is_dir():
        return folder_side("after", Path(revision))
    return commit_side("after", revision, workdir)


def side_env(side: Side, workdir: Path) -> dict[str, str]:
    """The environment of every command of ``side``: only the tree and the Hugging Face home differ."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(side.tree),
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(workdir / "hf-home" / side.name),
        FEATCAL_CACHE=str(workdir / "zoo-cache"),
    )
    return env


def check_import(side: Side, workdir: Path) -> None:
    """Stop unless ``import featcal`` loads the side's own tree, not the venv's editable install."""
    probe = [sys.executable, "-c", "import featcal; print(featcal.__file__)"]
    result = subprocess.run(probe, cwd=workdir, env=side_env(side, workdir), capture_output=True, text=True)
    loaded = Path(result.stdout.strip() or "?").resolve()
    if result.returncode != 0 or not loaded.is_relative_to(side.tree):
        fail(f"the {side.name} side imports featcal from {loaded}, not {side.tree}")


def project_notes(before: Side, after: Side) -> list[str]:
    """Where the trees' ``pyproject.toml`` differ in what both sides take from the venv instead."""
    projects = [tomllib.loads((side.tree / "pyproject.toml").read_text())["project"] for side in (before, after)]
    return [
        f"pyproject.toml's {key} differs ({projects[0].get(key)} → {projects[1].get(key)}); both sides ran "
        "with this venv's"
        for key in ("version", "dependencies")
        if projects[0].get(key) != projects[1].get(key)
    ]


# --- the cases -----------------------------------------------------------------------------------------


def copy_fixture(before_tree: Path, workdir: Path) -> Path:
    """The before tree's fixture, copied afresh to ``WORKDIR/inputs``: an input of both sides, in neither tree."""
    fixture = workdir / "inputs" / Path(FIXTURE).name
    shutil.rmtree(fixture, ignore_errors=True)
    shutil.copytree(before_tree / FIXTURE, fixture)
    return fixture


def golden_argv(before_tree: Path, fixture: Path) -> tuple[str, ...]:
    """The before tree's golden command, without the program name, reading the fixture from ``fixture``."""
    words = json.loads((before_tree / GOLDEN_RECORD).read_text())["command"].split()
    if words[0] != "featcal":
        fail(f"{GOLDEN_RECORD} holds no featcal command: {words[0]}")
    return tuple(str(fixture) + word.removeprefix(FIXTURE) if word.startswith(FIXTURE) else word for word in words[1:])


def tiny_fixture_steps(before_tree: Path, fixture: Path, out: Path) -> tuple[Step, ...]:
    """The golden run, its export, each merge method alone and a calibration alone, on the fixture."""
    inputs = ("--tasks-file", str(fixture / "tasks.json"), "--base-model-id", str(fixture / "base"), "--device", "cpu")
    calibration = ("--num-calibration-examples", "8", "--calibration-batch-size", "4")
    merges = tuple(
        Step(f"merge-{method}", ("-q", "merge", "--method", method, *inputs, "--output", str(out / f"merge-{method}")))
        for method in MERGE_METHODS
    )
    merged = str(out / "merge-task_arithmetic")
    return (
        Step("run", (*golden_argv(before_tree, fixture), "--output-dir", str(out / "run"))),
        Step("export", ("-q", "export", str(out / "run"))),
        *merges,
        Step(
            "calibrate",
            ("-q", "calibrate", "--merged", merged, *inputs, *calibration, "--output", str(out / "calibrate")),
        ),
    )


def demo_steps(tiny: bool, zoo_cache: Path, out: Path, *, export: bool) -> tuple[Step, ...]:
    """``featcal demo`` (``--tiny``) on the shared zoo cache, into ``out/run``."""
    flags = ("--tiny",) if tiny else ()
    no_export = () if export else ("--no-export",)
    argv = ("-q", "demo", *flags, "--cache-dir", str(zoo_cache), *no_export, "--output-dir", str(out / "run"))
    return (Step("demo", argv),)


def text_demo_steps(zoo: str, zoo_cache: Path, out: Path, *, export: bool) -> tuple[Step, ...]:
    """``featcal demo --zoo ZOO --tiny`` (lm5 or t5x4) on the shared zoo cache, into ``out/run``."""
    no_export = () if export else ("--no-export",)
    argv = ("-q", "demo", "--zoo", zoo, "--tiny", "--zoo-cache-dir", str(zoo_cache), *no_export)
    return (Step("demo", (*argv, "--output-dir", str(out / "run"))),)


def mergekit_folder(merged: Path, target: Path) -> None:
    """``target``: the files of featcal's merge ``merged`` a mergekit output holds (weights, config, tokenizer,
    ``mergekit_config.yml``), without featcal's own records; made afresh."""
    if not (merged / "mergekit_config.yml").is_file():
        fail(f"{merged} holds no mergekit_config.yml to calibrate a mergekit-style folder from")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(merged, target, ignore=shutil.ignore_patterns(*NOT_MERGEKIT))


def mergekit_steps(zoo: TextZoo, root: Path, merged: Path, out: Path) -> tuple[Step, ...]:
    """Calibrate the mergekit-style folder ``merged`` with FeatCal and each of ``zoo.repairs``, export each
    result, and merge the experts of the zoo in ``root`` with each of ``zoo.merge_methods`` (a data-using one
    on FeatCal's calibration draw)."""
    data, runtime = ("--data", str(root / "data.json")), ("--device", "cpu")
    calibration = ("--num-calibration-examples", "8", "--calibration-batch-size", "4")
    calibrate = ("-q", "calibrate", "--merged", str(merged), *runtime)
    steps = [
        Step("calibrate", (*calibrate, *data, *calibration, "--output", str(out / "calibrate"))),
        Step("export", ("-q", "export", str(out / "calibrate"), "--repo", "featcal-compare/calibrate")),
    ]
    for repair in zoo.repairs:
        folder = out / f"calibrate-{repair}"
        steps.append(Step(folder.name, (*calibrate, "--method", repair, "--output", str(folder))))
        steps.append(Step(f"export-{repair}", ("-q", "export", str(folder), "--repo", f"featcal-compare/{repair}")))
    for method in zoo.merge_methods:
        argv = ("-q", "merge", "--method", method, *data, "--base-model-id", str(root / "base"), *runtime)
        argv += calibration if method in DATA_MERGES else ()
        steps.append(Step(f"merge-{method}", (*argv, "--output", str(out / f"merge-{method}"))))
    return tuple(steps)


def text_cases(zoo_cache: Path, workdir: Path) -> dict[str, Case]:
    """``lm5-tiny``, ``t5x4-tiny``, ``lm-mergekit`` and ``t5-mergekit`` (see the module's docstring)."""
    cases = {}
    for zoo in TEXT_ZOOS:
        root, merged = zoo_cache / "benchmark" / zoo.folder, workdir / "inputs" / f"{zoo.prefix}-mergekit"
        prepare = functools.partial(text_demo_steps, zoo.demo, zoo_cache, export=False)
        cases[f"{zoo.demo}-tiny"] = Case(
            f"{zoo.demo}-tiny",
            functools.partial(text_demo_steps, zoo.demo, zoo_cache, export=True),
            prepare=prepare,
            references=DEMO_REFERENCES,
        )
        outputs = [f"calibrate{suffix}" for suffix in ("", *(f"-{repair}" for repair in zoo.repairs))]
        cases[f"{zoo.prefix}-mergekit"] = Case(
            f"{zoo.prefix}-mergekit",
            functools.partial(mergekit_steps, zoo, root, merged),
            prepare=prepare,
            inputs=lambda out, merged=merged: mergekit_folder(out / "run" / "ta", merged),
            references={
                f"{name}{release}/model.safetensors": str(merged / "model.safetensors")
                for name in outputs
                for release in ("", "-release")
            },
        )
    return cases


def build_cases(before_tree: Path, workdir: Path) -> dict[str, Case]:
    """Every case by name (see the module's docstring)."""
    zoo_cache, fixture = workdir / "zoo-cache", copy_fixture(before_tree, workdir)
    return {
        "tiny-fixture": Case(
            "tiny-fixture",
            lambda out: tiny_fixture_steps(before_tree, fixture, out),
            references={
                **DEMO_REFERENCES,
                "calibrate/model.safetensors": "merge-task_arithmetic/model.safetensors",
            },
        ),
        **{
            name: Case(
                name,
                lambda out, tiny=tiny: demo_steps(tiny, zoo_cache, out, export=True),
                prepare=lambda out, tiny=tiny: demo_steps(tiny, zoo_cache, out, export=False),
                references=DEMO_REFERENCES,
            )
            for name, tiny in (("mini8-tiny", True), ("mini8", False))
        },
        **text_cases(zoo_cache, workdir),
    }


def split_argv(argv: tuple[str, ...]) -> tuple[list[str], str, list[str]]:
    """Global options, the command, and the command's long flags of a featcal command line."""
    position = next(i for i, word in enumerate(argv) if not word.startswith("-"))
    flags = [word.split("=", 1)[0] for word in argv[position + 1 :] if word.startswith("--")]
    return list(argv[:position]), argv[position], flags


@functools.cache
def help_text(side: Side, command: str, workdir: Path) -> str:
    """``featcal [command] --help`` as the side's tree prints it."""
    argv = [sys.executable, "-m", "featcal", *([command] if command else []), "--help"]
    return subprocess.run(argv, cwd=workdir, env=side_env(side, workdir), capture_output=True, text=True).stdout


_ACCEPTS = """
import sys
from featcal.cli import build_parser
parser = build_parser()
if sys.argv[1]:
    commands = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict))
    parser = commands.choices[sys.argv[1]]
print(" ".join(parser._option_string_actions))
"""


@functools.cache
def accepted_options(side: Side, command: str, workdir: Path) -> frozenset[str]:
    """Every option the side's parser accepts for ``command``, those hidden from ``--help`` (old spellings
    kept as aliases) included."""
    argv = [sys.executable, "-c", _ACCEPTS, command]
    out = subprocess.run(argv, cwd=workdir, env=side_env(side, workdir), capture_output=True, text=True).stdout
    return frozenset(out.split())


def check_flags(steps: list[Step], sides: tuple[Side, Side], workdir: Path) -> None:
    """Stop unless every option of every step is spelled as in both trees' ``--help`` (or accepted by the
    tree's parser as a hidden alias)."""
    for side in sides:
        for step in steps:
            global_options, command, flags = split_argv(step.argv)
            for where, options in (("", global_options), (command, flags)):
                text = help_text(side, where, workdir)
                unknown = [
                    o
                    for o in options
                    if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)
                    and o not in accepted_options(side, where, workdir)
                ]
                if unknown:
                    fail(
                        f"featcal {where} of the {side.name} tree has no {', '.join(unknown)} "
                        f"(step {step.name}); the steps may use only flags both trees have, spelled in full"
                    )


# --- running -------------------------------------------------------------------------------------------


def run_step(step: Step, side: Side, workdir: Path, logs: Path) -> StepResult:
    """Run one step, its standard output and error kept under ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = logs / f"{step.name}.stdout", logs / f"{step.name}.stderr"
    start = time.perf_counter()
    argv = [sys.executable, "-m", "featcal", *step.argv]
    with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
        process = subprocess.run(argv, cwd=workdir, env=side_env(side, workdir), stdout=stdout, stderr=stderr)
    returncode = process.returncode
    seconds = time.perf_counter() - start
    status = "ok" if returncode == 0 else f"exit status {returncode}, see {stderr_path}"
    print(f"  {side.name:6} {step.name:24} {seconds:7.1f} s  {status}", file=sys.stderr, flush=True)
    return StepResult(step.name, side.name, returncode, seconds, stdout_path.read_text())


def output_folder(case: Case, side: Side, workdir: Path) -> Path:
    """Where ``side`` writes the outputs of ``case``."""
    return workdir / "runs" / case.name / side.name


def run_side(case: Case, side: Side, workdir: Path) -> list[StepResult]:
    """Every step of ``case`` with ``side``'s tree, into an emptied ``WORKDIR/runs/<case>/<side>``."""
    out = output_folder(case, side, workdir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return [run_step(step, side, workdir, workdir / "logs" / case.name / side.name) for step in case.steps(out)]


def prepare_case(case: Case, before: Side, workdir: Path) -> None:
    """The case's preparation (the shared zoo), with the before tree and an HF_HOME of its own; a failure
    stops the script."""
    out = workdir / "runs" / case.name / "prepare"
    shutil.rmtree(out, ignore_errors=True)
    preparer = replace(before, name="prepare")
    for step in case.prepare(out):
        if run_step(step, preparer, workdir, workdir / "logs" / case.name / "prepare").returncode != 0:
            fail(f"preparing {case.name} failed ({step.name})")
    case.inputs(out)


# --- comparing -----------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A value as JSON, cut to a readable length."""
    text = value if value is MISSING else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b[0]": leaf}`` for every leaf of a JSON value (an empty dict or list is a leaf)."""
    if isinstance(value, dict) and value:
        keys = {key: f"{prefix}.{key}" if prefix else str(key) for key in value}
        return {k: v for key, item in value.items() for k, v in flatten(item, keys[key]).items()}
    if isinstance(value, list) and value:
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def json_mismatches(before: Any, after: Any) -> list[tuple[str, Any, Any]]:
    """Every key whose leaf differs (as JSON text: 1 and 1.0 differ), ``MISSING`` where one side has none."""
    flat_before, flat_after = flatten(before), flatten(after)
    keys = sorted(flat_before.keys() | flat_after.keys())
    pairs = [(key, flat_before.get(key, MISSING), flat_after.get(key, MISSING)) for key in keys]
    return [(key, b, a) for key, b, a in pairs if json.dumps(b) != json.dumps(a)]


def read_json(path: Path) -> Any:
    """A JSON file, or a file of one JSON value per line (``run.log``) as a list."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def normalised_json(pair: Pair) -> tuple[Any, Any]:
    """Both sides' JSON, their paths normalised."""
    return pair.norms[0].json(read_json(pair.before)), pair.norms[1].json(read_json(pair.after))


def compare_json(pair: Pair) -> list[Difference]:
    """Key by key; ``run_config.json`` differences are of their own kind."""
    what = "run_config" if pair.before.name == "run_config.json" else "json"
    return pair.differences(what, json_mismatches(*normalised_json(pair)))


def is_loss(key: str, before: Any, after: Any) -> bool:
    """Whether ``key`` is a loss with a number on both sides."""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (before, after))
    return numbers and re.search(r"(^|\.)loss$", key) is not None


def compare_metrics(pair: Pair) -> list[Difference]:
    """Every value exactly; a loss may move by ``--loss-rtol`` of its value, and reports how far it moved."""
    differences = []
    for key, before, after in json_mismatches(*normalised_json(pair)):
        if not is_loss(key, before, after):
            differences += pair.differences("metrics", [(key, before, after)])
            continue
        change = abs(after - before)
        relative = change / abs(before) if before else float("inf")
        if relative > pair.loss_rtol:
            detail = f"{key}: {before!r} → {after!r} (|Δ| {change:.3g}, relative {relative:.3g})"
            data = {"before": before, "after": after, "abs_diff": change, "rel_diff": relative}
            differences.append(Difference(pair.case, pair.path, "loss", key, detail, data))
    return differences


def compare_timings(pair: Pair) -> list[Difference]:
    """Key names everywhere, values under ``settings`` only."""
    before, after = (flatten(side) for side in normalised_json(pair))
    names = [(key, "present", MISSING) for key in sorted(before.keys() - after.keys())]
    names += [(key, MISSING, "present") for key in sorted(after.keys() - before.keys())]
    settings = [(k, before[k], after[k]) for k in sorted(before.keys() & after.keys()) if k.startswith("settings.")]
    return pair.differences("timings", names + [(k, b, a) for k, b, a in settings if json.dumps(b) != json.dumps(a)])


def sha256(path: Path) -> str:
    """The SHA-256 of a file, in hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_for_comparison(path: Path, norm: Normaliser) -> Any:
    """The manifest, the card's hash replaced by a marker when it is the hash of the card beside it."""
    manifest = norm.json(read_json(path))
    files = manifest.get("files", {})
    card = path.parent / MANIFEST_CARD
    if card.is_file() and files.get(MANIFEST_CARD) == sha256(card):
        files[MANIFEST_CARD] = "<the SHA-256 of the card beside it>"
    return manifest


def compare_manifest(pair: Pair) -> list[Difference]:
    """Key by key, the card's hash checked on each side and left to the card's own comparison."""
    before = manifest_for_comparison(pair.before, pair.norms[0])
    after = manifest_for_comparison(pair.after, pair.norms[1])
    return pair.differences("manifest", json_mismatches(before, after))


def normalised_card(path: Path, norm: Normaliser) -> list[str]:
    """The card's lines, paths normalised and the numbers of the Runtime section's tables replaced."""
    lines, section = [], ""
    for line in norm.text(path.read_text()).splitlines():
        if line.startswith("## "):
            section = line.strip()
        elif section == RUNTIME_SECTION and line.startswith("|"):
            line = TABLE_NUMBER.sub(" <n> ", line)
        lines.append(line)
    return lines


def section_at(lines: list[str], index: int) -> str:
    """The Markdown heading ``lines[index]`` falls under, or is (``#`` lines in code blocks are not headings)."""
    heading, in_code = "(before the first heading)", False
    for line in lines[: index + 1]:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and HEADING.match(line):
            heading = line.strip()
    return heading


def hunk_text(group: list[tuple[str, int, int, int, int]], before: list[str], after: list[str]) -> str:
    """One hunk of a unified diff."""
    first, last = group[0], group[-1]
    header = f"@@ -{first[1] + 1},{last[2] - first[1]} +{first[3] + 1},{last[4] - first[3]} @@"
    lines = [header]
    for tag, i1, i2, j1, j2 in group:
        if tag == "equal":
            lines += [f" {line}" for line in before[i1:i2]]
            continue
        lines += [f"-{line}" for line in before[i1:i2]] + [f"+{line}" for line in after[j1:j2]]
    return "\n".join(lines)


def compare_card(pair: Pair) -> list[Difference]:
    """A unified diff of the normalised cards, one difference per hunk, keyed by the section it starts in."""
    before, after = normalised_card(pair.before, pair.norms[0]), normalised_card(pair.after, pair.norms[1])
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    differences = []
    for group in matcher.get_grouped_opcodes(3):
        start = next(op[1] for op in group if op[0] != "equal")
        key = section_at(before, start)
        differences.append(Difference(pair.case, pair.path, "card", key, hunk_text(group, before, after)))
    return differences


def compare_bytes(pair: Pair) -> list[Difference]:
    """The files' bytes."""
    digests = sha256(pair.before), sha256(pair.after)
    if digests[0] == digests[1]:
        return []
    return [Difference(pair.case, pair.path, "bytes", "", f"SHA-256 {digests[0]} → {digests[1]}")]


def tensor_change(before: torch.Tensor, after: torch.Tensor, reference: torch.Tensor | None) -> dict[str, Any]:
    """How far ``after`` is from ``before``: largest absolute difference, relative to the tensor and to the
    update from ``reference`` (when given, with the same shape and a non-zero update)."""
    delta = after.double() - before.double()
    change: dict[str, Any] = {"max_abs_diff": float(delta.abs().max()) if delta.numel() else 0.0}
    norm = float(before.double().norm())
    change["rel_to_tensor"] = float(delta.norm()) / norm if norm else None
    if reference is not None and reference.shape == before.shape:
        update = float((before.double() - reference.double()).norm())
        change["rel_to_update"] = float(delta.norm()) / update if update else None
    return change


def same_bits(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether two tensors of the same dtype and shape hold the same bits (NaNs included)."""
    return torch.equal(before.reshape(-1).view(torch.uint8), after.reshape(-1).view(torch.uint8))


def weights_summary(pair: Pair, changes: dict[str, dict[str, Any]]) -> Difference:
    """One difference for every tensor whose bits changed, led by the largest changes."""
    parts = [f"{len(changes)} tensor(s) differ"]
    for measure in ("max_abs_diff", "rel_to_tensor", "rel_to_update"):
        values = {name: c[measure] for name, c in changes.items() if c.get(measure) is not None}
        if values:
            name = max(values, key=values.__getitem__)
            parts.append(f"largest {measure} {values[name]:.3g} ({name})")
    return Difference(pair.case, pair.path, "weights", "", "; ".join(parts), {"tensors": changes})


def tensor_differences(pair: Pair, before: Any, after: Any, reference: Any) -> list[Difference]:
    """Tensor names, dtypes, shapes and bits of two open safetensors files."""
    names_before, names_after = set(before.keys()), set(after.keys())
    differences = pair.differences("weights", [(n, "present", MISSING) for n in sorted(names_before - names_after)])
    differences += pair.differences("weights", [(n, MISSING, "present") for n in sorted(names_after - names_before)])
    changes = {}
    for name in sorted(names_before & names_after):
        b, a = before.get_tensor(name), after.get_tensor(name)
        if (b.dtype, b.shape) != (a.dtype, a.shape):
            layout = [(name, f"{b.dtype} {list(b.shape)}", f"{a.dtype} {list(a.shape)}")]
            differences += pair.differences("weights", layout)
        elif not same_bits(b, a):
            ref = reference.get_tensor(name) if reference is not None and name in reference.keys() else None
            changes[name] = tensor_change(b, a, ref)
    return differences + ([weights_summary(pair, changes)] if changes else [])


def compare_safetensors(pair: Pair) -> list[Difference]:
    """Tensors bit for bit, then the metadata, then the file's bytes (layout and order)."""
    if sha256(pair.before) == sha256(pair.after):
        return []
    with safe_open(pair.before, "pt") as before, safe_open(pair.after, "pt") as after:
        if pair.reference is not None and pair.reference.is_file():
            with safe_open(pair.reference, "pt") as reference:
                differences = tensor_differences(pair, before, after, reference)
        else:
            differences = tensor_differences(pair, before, after, None)
        metadata = pair.norms[0].json(before.metadata() or {}), pair.norms[1].json(after.metadata() or {})
    differences += pair.differences("safetensors-metadata", json_mismatches(*metadata))
    if not differences:
        detail = "the same tensors and metadata in other bytes (header, order or alignment)"
        differences.append(Difference(pair.case, pair.path, "safetensors-bytes", "", detail))
    return differences


def comparer(path: Path) -> Callable[[Pair], list[Difference]]:
    """How a file is compared, from its name."""
    by_name = {
        "metrics.json": compare_metrics,
        "run.log": compare_metrics,
        "timings.json": compare_timings,
        "release_manifest.json": compare_manifest,
        "README.md": compare_card,
    }
    if path.name in by_name:
        return by_name[path.name]
    return {".safetensors": compare_safetensors, ".json": compare_json}.get(path.suffix, compare_bytes)


def files_under(root: Path) -> set[str]:
    """Every file under ``root``, relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()


def side_norms(case: Case, sides: tuple[Side, Side], workdir: Path) -> tuple[Normaliser, Normaliser]:
    """Each side's normaliser for ``case``."""
    before, after = (Normaliser.for_side(output_folder(case, side, workdir), side.tree, workdir) for side in sides)
    return before, after


def compare_outputs(case: Case, workdir: Path, sides: tuple[Side, Side], loss_rtol: float) -> list[Difference]:
    """The case's two output folders: the set of files, then each file present in both."""
    roots = tuple(output_folder(case, side, workdir) for side in sides)
    norms = side_norms(case, sides, workdir)
    files = files_under(roots[0]), files_under(roots[1])
    differences = [Difference(case.name, p, "files", "", "only before") for p in sorted(files[0] - files[1])]
    differences += [Difference(case.name, p, "files", "", "only after") for p in sorted(files[1] - files[0])]
    for path in sorted(files[0] & files[1]):
        reference = roots[0] / case.references[path] if path in case.references else None
        pair = Pair(case.name, path, roots[0] / path, roots[1] / path, norms, loss_rtol, reference)
        try:
            differences += comparer(Path(path))(pair)
        except (ValueError, OSError, SafetensorError) as exc:  # JSON, text or safetensors that does not read
            differences.append(Difference(case.name, path, "unreadable", "", f"{type(exc).__name__}: {exc}"))
    return differences


def compare_steps(case: Case, results: list[StepResult], norms: tuple[Normaliser, Normaliser]) -> list[Difference]:
    """Each step's exit status (both must succeed) and its normalised standard output."""
    before = {r.step: r for r in results if r.side == "before"}
    after = {r.step: r for r in results if r.side == "after"}
    differences = []
    for name in dict.fromkeys(r.step for r in results):
        b, a = before.get(name), after.get(name)
        codes = (b.returncode if b else MISSING, a.returncode if a else MISSING)
        if codes != (0, 0):
            detail = f"exit status {codes[0]} → {codes[1]}"
            differences.append(Difference(case.name, f"exit/{name}", "exit-status", "", detail))
        if b and a:
            lines = [DURATION.sub("<n>", norm.text(r.stdout)).splitlines() for norm, r in zip(norms, (b, a))]
            diff = "\n".join(difflib.unified_diff(*lines, "before", "after", lineterm=""))
            if diff:
                differences.append(Difference(case.name, f"stdout/{name}", "stdout", "", diff))
    return differences


# --- verdict and report --------------------------------------------------------------------------------


def load_allowances(path: Path | None) -> list[Allowance]:
    """The ``--allow`` file's entries (YAML, or JSON for a ``.json`` file); none without one."""
    if path is None:
        return []
    if not path.is_file():
        fail(f"--allow {path}: no such file")
    data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    entries = data.get("allow", []) if isinstance(data, dict) else data or []
    allowances = []
    for i, entry in enumerate(entries):
        missing = [k for k in ("path", "what", "issue", "reason") if not isinstance(entry, dict) or k not in entry]
        if missing:
            fail(f"entry {i} of {path} lacks {', '.join(missing)}")
        fields = {k: str(entry[k]) for k in ("path", "what", "issue", "reason", "key", "match") if k in entry}
        try:
            re.compile(fields.get("match", ""))
        except re.error as exc:
            fail(f"entry {i} of {path}: match is no regular expression ({exc})")
        allowances.append(Allowance(**fields))
    return allowances


def judge(differences: list[Difference], allowances: list[Allowance]) -> list[Allowance]:
    """Mark each difference ALLOWED by the first entry that covers it; return the entries that covered none."""
    used = set()
    for difference in differences:
        entry = next((i for i, allowance in enumerate(allowances) if allowance.covers(difference)), None)
        if entry is not None:
            used.add(entry)
            allowed = allowances[entry]
            difference.status, difference.issue, difference.reason = "ALLOWED", allowed.issue, allowed.reason
    return [allowance for i, allowance in enumerate(allowances) if i not in used]


def case_seconds(results: list[StepResult]) -> dict[str, float]:
    """Seconds each side took for the case's steps."""
    return {side: round(sum(r.seconds for r in results if r.side == side), 1) for side in ("before", "after")}


def headline(detail: str) -> str:
    """A difference's text in one line: a diff's first changed line, cut to 100 characters."""
    lines = detail.splitlines() or [""]
    changed = [line for line in lines if line.startswith(("-", "+")) and line not in ("--- before", "+++ after")]
    line = changed[0] if len(lines) > 1 and changed else lines[0]
    return line if len(line) <= 100 else line[:97] + "..."


def summary_lines(report: dict[str, Any]) -> Iterator[str]:
    """The short Markdown summary of a report."""
    yield "# Behaviour comparison\n"
    yield f"- before: {report['before']['label']}"
    yield f"- after: {report['after']['label']}"
    yield from (f"- note: {note}" for note in report["notes"])
    yield "\n| case | files | before (s) | after (s) | differences | unexpected |\n|---|---:|---:|---:|---:|---:|"
    for name, case in report["cases"].items():
        found = [d for d in report["differences"] if d["case"] == name]
        unexpected = sum(d["status"] == "UNEXPECTED" for d in found)
        files, seconds = f"{case['files']['before']} / {case['files']['after']}", case["seconds"]
        yield f"| {name} | {files} | {seconds['before']} | {seconds['after']} | {len(found)} | {unexpected} |"
    if report["differences"]:
        yield "\n| status | case | path | what | key | detail | issue |\n|---|---|---|---|---|---|---|"
    for d in report["differences"]:
        cells = [d["status"], d["case"], d["path"], d["what"], d["key"], headline(d["detail"]), d["issue"]]
        yield "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    for allowance in report["unused"]:
        yield f"\nAllowed, did not occur: {allowance['path']} {allowance['what']} (#{allowance['issue']})"
    yield f"\n**{report['unexpected']} unexpected difference(s)**; details in report.json, logs in logs/."


def write_report(workdir: Path, report: dict[str, Any]) -> str:
    """``report.json`` and ``summary.md`` in the work folder; returns the summary."""
    (workdir / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    summary = "\n".join(summary_lines(report)) + "\n"
    (workdir / "summary.md").write_text(summary)
    return summary


# --- command line --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="commit whose outputs are the reference")
    parser.add_argument("--after", help="source folder or commit to compare (default: this checkout as it is)")
    parser.add_argument("--workdir", type=Path, required=True, help="work folder: trees, zoo cache, runs, report")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--allow", type=Path, help="YAML or JSON file of expected differences")
    parser.add_argument("--loss-rtol", type=float, default=0.0, help="relative change a loss may have (default 0)")
    args = parser.parse_args(argv)
    args.cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in args.cases if name not in CASES]
    if unknown or not args.cases:
        parser.error(f"--cases: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the cases with both trees, compare, report; 1 when any difference is unexpected."""
    args = parse_args(argv)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    allowances = load_allowances(args.allow)
    sides = commit_side("before", args.before, workdir), after_side(args.after, workdir)
    for side in sides:
        check_import(side, workdir)
    cases = [build_cases(sides[0].tree, workdir)[name] for name in args.cases]
    check_flags([s for case in cases for s in (*case.prepare(workdir), *case.steps(workdir))], sides, workdir)
    report: dict[str, Any] = {
        **{side.name: {"label": side.label, "tree": str(side.tree)} for side in sides},
        "python": sys.executable,
        "notes": project_notes(*sides),
        "cases": {},
    }
    differences = []
    for case in cases:
        print(f"{case.name}:", file=sys.stderr, flush=True)
        prepare_case(case, sides[0], workdir)
        results = [result for side in sides for result in run_side(case, side, workdir)]
        differences += compare_steps(case, results, side_norms(case, sides, workdir))
        differences += compare_outputs(case, workdir, sides, args.loss_rtol)
        files = {side.name: len(files_under(output_folder(case, side, workdir))) for side in sides}
        report["cases"][case.name] = {
            "seconds": case_seconds(results),
            "files": files,
            "steps": [asdict(r) for r in results],
        }
    unused = judge(differences, allowances)
    report["differences"] = [asdict(d) for d in differences]
    report["unused"] = [asdict(a) for a in unused]
    report["unexpected"] = sum(d.status == "UNEXPECTED" for d in differences)
    print(write_report(workdir, report))
    return 1 if report["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
