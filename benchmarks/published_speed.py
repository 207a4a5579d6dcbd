"""Merge + FeatCal calibration, the published code against featcal, side by side on the ViT-B/32 shape.

The published code is github egangu/featcal (its package is also named ``featcal``); it runs from its
own checkout in its own subprocesses, with ``PYTHONPATH`` set to its ``src/`` alone, so the two
packages never meet in one process. Both sides get the same random ViT-B/32-shaped base and experts
(``calibration_speed.build_models``, CLIPVisionModel folders on disk), the same random pixel tensors
(``calibration_speed._images``, one seeded tensor per task), Task Arithmetic with κ = 0.3 and FeatCal
with the published defaults (batch ``--batch-size``), on the CPU, with ``--threads`` torch threads.

Each run is a fresh process that does what the two implementations' own commands do, timed phase by
phase, and reports wall and CPU time and the peak RSS (VmHWM) of each phase:

- published (its ``run_ta8.py`` with ``--skip-eval-ta`` and no evaluation): ``task_arithmetic_merge``
  from the model folders, ``save_vision_model`` of the merge; then ``load_vision_model`` of the base,
  ``load_expert_models``, ``CLIPFeatCalibrator(...).calibrate`` of the in-memory merge and
  ``save_vision_model`` of the result.
- featcal (the library calls of ``featcal merge`` and ``featcal calibrate``): open and check the base
  and experts (``Checkpoint``, ``check_compatible``, ``check_finite_state``), ``task_arithmetic``, check,
  ``save_vision_model``; then open and check them again, ``check_vision_folder`` of the merge and
  ``featcal_calibrate_folder`` (the merge's encoder layers read, calibrated and written one at a time).

What the published side runs differs from its repository only here (``_adapt_published``):

1. transformers 5's ``CLIPVisionModel`` has no ``vision_model`` attribute (the embeddings, the
   pre-LayerNorm and the encoder are the model's own children): its two helpers that read
   ``model.vision_model`` (``_clip_first_layer_input``, ``_clip_layers``) are replaced by copies that
   use the model itself when it has no ``vision_model``; their bodies are otherwise unchanged.
2. Its data loading reads Hub datasets: ``load_task_dataset`` returns the task name instead, and
   ``make_clip_loader`` returns the task's pixel tensor cut into batches of ``calibration_batch_size``
   (in order: the published loader shuffles, which changes nothing but float rounding when all the
   images are used). ``iter_limited_image_batches`` and everything after are the published code.
3. No ``CLIPProcessor`` is loaded (the model folders have none, and only the replaced loader used it).

Images are not decoded on either side: the times are of the merge and the calibration, not of data
loading. ``--repeats`` runs alternate (published, featcal, published, featcal, …) so both see the same
machine; the best of each side is reported, with the speed-up, the RSS ratio and the issue's target
(featcal at least 2× faster at no more than half the peak RSS). The calibrated weights of the last
repeat are compared per tensor: ‖featcal − published‖ / ‖published − merged‖.

    .venv/bin/python benchmarks/published_speed.py --published /path/to/egangu-featcal   # a checkout
    .venv/bin/python benchmarks/published_speed.py --published /path/to/repo.git --published-commit 18c68b6
    .venv/bin/python benchmarks/published_speed.py --published ... --points 1x8 --repeats 1   # a quick check

Writes ``benchmarks/results/published_speed.json`` (``--out``) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from calibration_floor import RESULTS, environment
from calibration_speed import _images, _memory, _probe_gflops, build_models

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_POINTS = ["2x128", "8x256"]
DEFAULT_COMMIT = "18c68b6"
SCALING_FACTOR = 0.3  # Task Arithmetic κ, the published run's
SIDES = ("published", "featcal")
SPEED_TARGET, RSS_TARGET = 2.0, 0.5  # issue 15: at least 2× faster, at most half the peak RSS
PHASES = ("merge", "calibrate")


# -- measuring a phase in the child ----------------------------------------------------------------
class PhaseClock:
    """Wall time, CPU time and peak RSS of consecutive phases of this process.

    The kernel's peak (VmHWM) is reset at the start of each phase (``/proc/self/clear_refs``), so a
    phase's peak is its own; the process's peak is the largest of them.
    """

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}
        self.resets = True

    def _reset_peak(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resets = False  # then each phase's VmHWM is the process's peak so far

    def run(self, name: str, work) -> None:
        """Run ``work()`` as the phase ``name``."""
        import gc

        gc.collect()
        self._reset_peak()
        before = _memory()
        start, cpu = time.perf_counter(), time.process_time()
        work()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        self.phases[name] = {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "memory_before": before,
            "memory": _memory(),
        }

    def report(self) -> dict:
        import torch

        return {
            "phases": self.phases,
            "seconds": sum(p["seconds"] for p in self.phases.values()),
            "cpu_seconds": sum(p["cpu_seconds"] for p in self.phases.values()),
            "peak_rss": max(p["memory"]["VmHWM"] for p in self.phases.values()),
            "peak_per_phase": self.resets,
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }


def _task_names(tasks: int) -> list[str]:
    return [f"t{i}" for i in range(tasks)]


# -- the published side (a child with the published src/ on PYTHONPATH) ---------------------------
def _adapt_published(module, count: int, image_size: int, names: list[str]) -> None:
    """The published ``featcal.featcal`` module, adapted to transformers 5 and fed pixel tensors."""

    def vision_tower(model):
        return getattr(model, "vision_model", model)  # transformers 5: the CLIPVisionModel itself

    def clip_first_layer_input(model, images):
        vision = vision_tower(model)
        hidden = vision.embeddings(images)
        return vision.pre_layrnorm(hidden)

    def clip_layers(model):
        return vision_tower(model).encoder.layers

    def load_task_dataset(task, split, *, cache_dir=None):
        return task

    def make_clip_loader(dataset, processor, *, batch_size, **kwargs):
        pixels = _images(names.index(dataset), count, image_size)
        return ((batch, None) for batch in pixels.split(batch_size))

    module._clip_first_layer_input = clip_first_layer_input
    module._clip_layers = clip_layers
    module.load_task_dataset = load_task_dataset
    module.make_clip_loader = make_clip_loader


def run_published(workdir: Path, tasks: int, images: int, batch_size: int, out: Path) -> dict:
    """Merge and calibrate with the published code, as its ``run_ta8.py`` does; returns the measurements."""
    import torch
    from transformers import CLIPVisionConfig

    import featcal

    source = Path(os.environ["PUBLISHED_SRC"]).resolve()
    if source not in Path(featcal.__file__).resolve().parents:
        raise SystemExit(f"imported featcal from {featcal.__file__}, not from the published code in {source}")
    from featcal import featcal as published
    from featcal.featcal import CLIPFeatCalibrator, FeatCalConfig, load_expert_models
    from featcal.merge import save_vision_model, task_arithmetic_merge
    from featcal.models import load_vision_model
    from featcal.utils import seed_everything

    names = _task_names(tasks)
    expert_ids = {name: str(workdir / "experts" / name) for name in names}
    base_id = str(workdir / "base")
    device = torch.device("cpu")
    _adapt_published(published, images, CLIPVisionConfig.from_pretrained(base_id).image_size, names)
    clock, held = PhaseClock(), {}

    def merge() -> None:
        seed_everything(42)
        held["ta"] = task_arithmetic_merge(base_model_id=base_id, expert_model_ids=expert_ids, scaling_factor=0.3)
        save_vision_model(held["ta"], out / "ta")

    def calibrate() -> None:
        seed_everything(42)
        ta_model = held.pop("ta").to(device)
        base_model = load_vision_model(base_id)
        experts = load_expert_models(expert_ids)
        config = FeatCalConfig(num_calibration_examples=images, calibration_batch_size=batch_size)
        calibrator = CLIPFeatCalibrator(config, processor=None, device=device)
        model = calibrator.calibrate(merged_model=ta_model, base_model=base_model, expert_models=experts, tasks=names)
        save_vision_model(model, out / "featcal-ta")

    clock.run("merge", merge)
    clock.run("calibrate", calibrate)
    return clock.report() | {"package": str(Path(featcal.__file__).resolve().parent)}


# -- the featcal side --------------------------------------------------------------------------------
def run_featcal(workdir: Path, tasks: int, images: int, batch_size: int, out: Path) -> dict:
    """Merge and calibrate with featcal's library calls of ``featcal merge`` and ``featcal calibrate``."""
    import torch
    from transformers import CLIPVisionConfig

    import featcal

    if REPO not in Path(featcal.__file__).resolve().parents:
        raise SystemExit(f"imported featcal from {featcal.__file__}, not from {REPO}")
    from featcal.allocator import keep_freed_memory_for_reuse
    from featcal.calibration import FeatCalParams
    from featcal.calibration.streaming import featcal_calibrate_folder
    from featcal.checkpoint import Checkpoint, check_compatible, check_finite_state
    from featcal.families.clip_vision import FAMILY
    from featcal.families.clip_vision.folders import check_vision_folder, save_vision_model, vision_checkpoint
    from featcal.merging import get_method

    keep_freed_memory_for_reuse()  # as every featcal command does
    names = _task_names(tasks)
    device = torch.device("cpu")
    size = CLIPVisionConfig.from_pretrained(str(workdir / "base")).image_size

    def open_inputs() -> tuple[Checkpoint, dict[str, Checkpoint]]:
        """The model part of ``resolve_inputs``: open and check the base and the experts."""
        base = vision_checkpoint(workdir / "base", name="base model")
        base.check_finite()
        experts = {n: vision_checkpoint(workdir / "experts" / n, name=f"Expert for task {n!r}") for n in names}
        check_compatible(base, experts)
        for expert in experts.values():
            expert.check_finite()
        return base, experts

    def merge() -> None:
        base, experts = open_inputs()
        method = get_method("task_arithmetic")
        params = method.resolved_params(scaling_factor=SCALING_FACTOR)
        state = method(base, [experts[n] for n in names], device=device, **params)
        check_finite_state(state, "The task_arithmetic merge")
        save_vision_model(state, CLIPVisionConfig.from_pretrained(str(workdir / "base")), out / "ta")

    def calibrate() -> None:
        base, experts = open_inputs()
        check_vision_folder(out / "ta", base)
        params = FeatCalParams(num_calibration_examples=images, calibration_batch_size=batch_size)
        featcal_calibrate_folder(  # one encoder layer in memory at a time, written as it is done
            FAMILY,
            out / "ta",
            out / "featcal-ta",
            base,
            experts,
            lambda name: _images(names.index(name), images, size),
            params,
            config=CLIPVisionConfig.from_pretrained(str(workdir / "base")),
            device=device,
            progress=False,
        )

    clock = PhaseClock()
    clock.run("merge", merge)
    clock.run("calibrate", calibrate)
    return clock.report() | {"package": str(Path(featcal.__file__).resolve().parent)}


# -- comparing the weights ---------------------------------------------------------------------------
def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k.removeprefix("vision_model."): v for k, v in load_file(str(folder / "model.safetensors")).items()}


def compare_outputs(published: Path, ours: Path) -> dict:
    """How far featcal's merge and calibration are from the published code's, per tensor.

    Merge: the largest ‖ours − theirs‖ / ‖theirs‖. Calibration: over the tensors the published code
    changed, the largest ‖ours − theirs‖ / ‖theirs − merged‖ (merged: the published merge); over the
    others, the largest absolute difference (they should be equal).
    """
    theirs_ta, ours_ta = _weights(published / "ta"), _weights(ours / "ta")
    theirs, mine = _weights(published / "featcal-ta"), _weights(ours / "featcal-ta")
    if set(theirs) != set(mine) or set(theirs_ta) != set(ours_ta):
        raise SystemExit("the two implementations saved different tensors")
    merge = {k: float((ours_ta[k] - v).norm() / v.norm().clamp_min(1e-30)) for k, v in theirs_ta.items()}
    update, unchanged = {}, {}
    for key, value in theirs.items():
        step = float((value - theirs_ta[key]).norm())
        if step > 0:
            update[key] = float((mine[key] - value).norm()) / step
        else:
            unchanged[key] = float((mine[key] - value).abs().max())
    worst_merge, worst_update = max(merge, key=merge.get), max(update, key=update.get)
    return {
        "merge_max_relative": merge[worst_merge],
        "merge_worst_tensor": worst_merge,
        "update_max_relative": update[worst_update],
        "update_worst_tensor": worst_update,
        "update_median_relative": sorted(update.values())[len(update) // 2],
        "calibrated_tensors": len(update),
        "unchanged_tensors": len(unchanged),
        "unchanged_max_abs": max(unchanged.values(), default=0.0),
    }


# -- the parent ------------------------------------------------------------------------------------
def _fail(message: str) -> NoReturn:
    """One line naming the bad input and the fix, exit status 2."""
    print(f"published_speed: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def published_source(path: Path, commit: str, scratch: Path) -> tuple[Path, str]:
    """The published checkout (its root holds ``src/featcal``) and its commit.

    ``path`` is a checkout, or a git directory from which ``commit`` is extracted into ``scratch``.
    """
    if (path / "src" / "featcal" / "featcal.py").is_file():
        done = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        return path.resolve(), done.stdout.strip() if done.returncode == 0 else "unknown (not a git work tree)"
    git = ["git", "--git-dir", str(path)]
    done = subprocess.run([*git, "rev-parse", "--verify", f"{commit}^{{commit}}"], capture_output=True, text=True)
    if done.returncode != 0:
        _fail(
            f"--published {path} is neither a checkout with src/featcal nor a git "
            f"directory holding commit {commit}; pass the published repository (github egangu/featcal)."
        )
    full = done.stdout.strip()
    root = scratch / f"published-{full[:12]}"
    if not (root / "src" / "featcal" / "featcal.py").is_file():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run([*git, "archive", full], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root, full


def featcal_commit() -> str:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _spawn(args: argparse.Namespace, side: str, tasks: int, images: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    threads = str(args.threads)
    env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    if side == "published":
        env |= {"PYTHONPATH": str(args.published_root / "src"), "PUBLISHED_SRC": str(args.published_root / "src")}
    else:
        env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--points", f"{tasks}x{images}"]
    cmd += ["--workdir", str(args.workdir), "--batch-size", str(args.batch_size), "--threads", threads]
    cmd += ["--child-out", str(out)]
    cwd = args.published_root if side == "published" else REPO
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{side} at {tasks}x{images} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best(runs: list[dict]) -> dict:
    """The smallest of each measurement over one side's repeats."""
    pick = {
        "merge_s": lambda r: r["phases"]["merge"]["seconds"],
        "calibrate_s": lambda r: r["phases"]["calibrate"]["seconds"],
        "total_s": lambda r: r["seconds"],
        "cpu_s": lambda r: r["cpu_seconds"],
        "peak_rss": lambda r: r["peak_rss"],
        "merge_peak_rss": lambda r: r["phases"]["merge"]["memory"]["VmHWM"],
        "calibrate_peak_rss": lambda r: r["phases"]["calibrate"]["memory"]["VmHWM"],
    }
    return {key: min(map(get, runs)) for key, get in pick.items()}


def summarise(runs: list[dict]) -> dict:
    """Best per side, the ratios and whether the target is met, for one point."""
    sides = {side: best([r for r in runs if r["side"] == side]) for side in SIDES}
    theirs, ours = sides["published"], sides["featcal"]
    speedup = theirs["total_s"] / ours["total_s"]
    rss_ratio = ours["peak_rss"] / theirs["peak_rss"]
    return {
        "best": sides,
        "speedup_total": speedup,
        "speedup_merge": theirs["merge_s"] / ours["merge_s"],
        "speedup_calibrate": theirs["calibrate_s"] / ours["calibrate_s"],
        "rss_ratio": rss_ratio,
        "target_met": speedup >= SPEED_TARGET and rss_ratio <= RSS_TARGET,
    }


GIB = 2**30


def run_row(run: dict) -> str:
    merge, calibrate = run["phases"]["merge"], run["phases"]["calibrate"]
    return (
        f"| {run['tasks']}×{run['images']} | {run['repeat']} | {run['side']} | {merge['seconds']:.1f} | "
        f"{calibrate['seconds']:.1f} | {run['seconds']:.1f} | {run['cpu_seconds']:.0f} | "
        f"{merge['memory']['VmHWM'] / GIB:.2f} | {calibrate['memory']['VmHWM'] / GIB:.2f} | "
        f"{run['torch_threads']} | {run['load_average_before'][0]:.2f} → {run['load_average_after'][0]:.2f} | "
        f"{run['probe_gflops']:.0f} |"
    )


def summary_row(point: dict) -> str:
    s, theirs, ours = point["summary"], point["summary"]["best"]["published"], point["summary"]["best"]["featcal"]
    agree = point["agreement"]
    return (
        f"| {point['tasks']}×{point['images']} | {theirs['total_s']:.1f} | {ours['total_s']:.1f} | "
        f"**{s['speedup_total']:.2f}×** ({s['speedup_merge']:.1f}× / {s['speedup_calibrate']:.2f}×) | "
        f"{theirs['peak_rss'] / GIB:.2f} | {ours['peak_rss'] / GIB:.2f} | **{s['rss_ratio']:.2f}** | "
        f"{'met' if s['target_met'] else 'not met'} | {agree['update_max_relative']:.1e} |"
    )


def markdown(report: dict) -> str:
    head = (
        "| point | published merge + calibration (s) | featcal (s) | speed-up (merge / calibration) | "
        "published peak RSS (GiB) | featcal peak RSS (GiB) | RSS ratio | target (≥ 2×, ≤ 0.5) | "
        "max update difference |\n|---|---:|---:|---:|---:|---:|---:|---|---:|"
    )
    runs_head = (
        "| point | repeat | side | merge (s) | calibration (s) | total (s) | CPU (s) | merge peak RSS (GiB) | "
        "calibration peak RSS (GiB) | torch threads | load average (1 min) before → after | probe GFLOP/s |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"
    )
    runs = [run_row(r) for p in report["points"] for r in p["runs"]]
    return "\n".join(
        [
            *([f"**{report['note']}**", ""] if report["note"] else []),
            f"`{report['command']}`",
            "",
            f"published {report['published']['commit']}, featcal {report['featcal']['commit']}; "
            f"{report['environment']['cpu']}, {report['environment']['cores']} cores, torch "
            f"{report['environment']['torch']}, {report['threads']} threads, nice {report['nice']}.",
            "",
            head,
            *map(summary_row, report["points"]),
            "",
            runs_head,
            *runs,
        ]
    )


def measure(args: argparse.Namespace, scratch: Path) -> dict:
    grid = [tuple(map(int, p.split("x"))) for p in args.points]
    start = time.perf_counter()
    build_models(args.workdir, max(t for t, _ in grid))
    print(f"models ready in {time.perf_counter() - start:.0f} s ({args.workdir})", flush=True)
    points = []
    for tasks, images in grid:
        runs = []
        for repeat in range(1, args.repeats + 1):
            for side in SIDES:
                out = scratch / "outputs" / side
                probe, before = _probe_gflops(), os.getloadavg()
                result = _spawn(args, side, tasks, images, out)
                run = {"side": side, "tasks": tasks, "images": images, "repeat": repeat, **result}
                run |= {"load_average_before": before, "load_average_after": os.getloadavg(), "probe_gflops": probe}
                runs.append(run)
                print(run_row(run), flush=True)
        agreement = compare_outputs(scratch / "outputs" / "published", scratch / "outputs" / "featcal")
        point = {"tasks": tasks, "images": images, "runs": runs, "summary": summarise(runs), "agreement": agreement}
        points.append(point)
        print(summary_row(point), flush=True)
    return {"points": points}


def _check_points(points: list[str]) -> None:
    for point in points:
        tasks, _, images = point.partition("x")
        if not (tasks.isdigit() and images.isdigit() and int(tasks) >= 1 and int(images) >= 1):
            _fail(f"--points {point!r} is not TASKSxIMAGES, e.g. 2x128")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", type=Path, help="the published repository: a checkout, or a git directory")
    parser.add_argument(
        "--published-commit", default=DEFAULT_COMMIT, help=f"commit to extract from a git directory ({DEFAULT_COMMIT})"
    )
    parser.add_argument(
        "--points",
        nargs="+",
        default=DEFAULT_POINTS,
        metavar="TxN",
        help=f"tasks x images ({' '.join(DEFAULT_POINTS)})",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per side and point, alternating (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="calibration batch size, both sides (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides (default 2)")
    parser.add_argument("--workdir", type=Path, help="where the models are built (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS / "published_speed.json")
    parser.add_argument("--note", default="", help="a line recorded with the results, e.g. what the machine was doing")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    _check_points(args.points)

    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        tasks, images = map(int, args.points[0].split("x"))
        run = run_published if args.child == "published" else run_featcal
        print(json.dumps(run(args.workdir, tasks, images, args.batch_size, args.child_out)))
        return

    if args.published is None:
        _fail("--published is required: the egangu/featcal checkout or git directory")
    for flag, value in (("--repeats", args.repeats), ("--threads", args.threads), ("--batch-size", args.batch_size)):
        if value < 1:
            _fail(f"{flag} must be at least 1, not {value}")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="featcal-published-speed-") as tmp:
        scratch = Path(tmp)
        args.published_root, commit = published_source(args.published.resolve(), args.published_commit, scratch)
        args.workdir = (args.workdir or scratch / "models").resolve()
        measured = measure(args, scratch)
    report = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "note": args.note,
        "published": {"repository": "github egangu/featcal", "commit": commit, "source": str(args.published)},
        "featcal": {"commit": featcal_commit()},
        "shape": "ViT-B/32 (CLIPVisionConfig defaults)",
        "threads": args.threads,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "nice": os.nice(0),
        "load_average_start": load_start,
        "environment": environment(args.threads),
        "target": {"speedup_at_least": SPEED_TARGET, "rss_ratio_at_most": RSS_TARGET},
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
