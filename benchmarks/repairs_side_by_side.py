"""Post-merge repairs side by side on an offline benchmark: `featcal run --repair ...` over several merges.

    python benchmarks/repairs_side_by_side.py --zoo mini8 [--zoo-seed 1] [--zoo-cache-dir DIR] \
        [--merges task_arithmetic regmean_plusplus wudi] [--repairs featcal surgery probsurgery svc lot]
    python benchmarks/repairs_side_by_side.py --zoo t5x4 --repairs featcal svc
    python benchmarks/repairs_side_by_side.py --zoo lm5 --repairs featcal svc lot
    python benchmarks/repairs_side_by_side.py --render benchmarks/results/repairs_side_by_side_lm5_seed0.json
    python benchmarks/repairs_side_by_side.py --zoo mini8 --work-dir DIR --interleave featcal surgery --repeats 3

``--interleave A B`` times the repairs A and B again on the first merge's run in ``--work-dir`` (a folder of an
earlier comparison), alternately A, B, A, B, ..., each in its own process as the comparison runs it, so that
both see the same load on a shared machine, after timing once a process that only imports what each repair's
imports (the import floor); it writes ``..._interleaved.json``.

For each merge, one run (merge, evaluate, FeatCal) with one torch thread, then each repair on that merge
through :func:`featcal.repairs.compare_run.run_compared`, one repair at a time so that the machine's load
average (``os.getloadavg``) can be recorded before and after each. Each repair runs as ``featcal calibrate
--method NAME`` in a child process of its own: its wall time and peak RSS (its own ``VmHWM``) are that
process's. Writes ``benchmarks/results/repairs_side_by_side_<zoo>_seed<seed>.json`` and a markdown table beside
it (``.md``); scores in %.

A merge or repair that featcal refuses for the zoo's family before any work (RegMean++ and LOT on t5x4: they
stream examples through one plain stack of layers, which a T5 is not) is recorded under ``not_defined`` with
featcal's one-line reason, and the others run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from featcal.errors import InvalidParameterError
from featcal.memory import GIB
from featcal.repairs.compare_run import run_compared
from featcal.repairs.compare_table import comparison_table, read_comparison, row_label, score

RESULTS = Path(__file__).parent / "results"


def zoo_folder(zoo: str, seed: int, cache: str | None) -> Path:
    """The zoo's folder, built (one thread) when the cache has none."""
    if zoo == "lm5":
        from featcal.demo.lm_zoo import LMZooConfig, build_lm_zoo

        return build_lm_zoo(LMZooConfig.lm5(seed=seed), cache_dir=cache, progress=False)
    if zoo == "t5x4":
        from featcal.demo.t5_zoo import T5ZooConfig, build_t5_zoo

        return build_t5_zoo(T5ZooConfig.t5x4(seed=seed), cache_dir=cache, progress=False)
    from featcal.demo import ZooConfig, build_zoo

    return build_zoo(ZooConfig.mini8(seed=seed), cache_dir=cache, progress=False)


def run_spec(zoo: str, folder: Path, out: Path, merge: str):
    """The zoo's demo run with ``merge``, one thread, no release, no zero-shot or expert evaluation."""
    if zoo == "lm5":
        from featcal.demo.lm_zoo import lm_run_spec

        spec = lm_run_spec(folder, out, progress=False, merge_method=merge)
    else:
        if zoo == "t5x4":
            from featcal.demo.t5_zoo import t5_run_spec as make
        else:
            from featcal.demo import demo_run_spec as make
        spec = make(folder, out, progress=False)
        if merge != "task_arithmetic":
            spec = spec.replace(merge_method=merge, merge_params={})
    return spec.replace(threads=1, no_export=True, eval_zero_shot=False, eval_experts=False)


def markdown(zoo: str, seed: int, merges: dict[str, list[dict]], not_defined: list[dict] | None = None) -> str:
    """One table per merge: each repair's average score, its wall time and peak RSS, the load around it; then
    the merges and repairs featcal refused for the zoo's family, with its reason."""
    lines = [f"# Repairs side by side: {zoo}, zoo seed {seed}", ""]
    for merge, rows in merges.items():
        lines += [f"## {merge}", "", "| repair | average % | wall s | peak RSS GiB | load before → after |",
                  "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
        for row in rows:
            value = score(row["metrics"], "average")
            average = "—" if value is None else f"{100 * value:.2f}"
            if row["repair"] == "merge":
                lines.append(f"| merge (no repair) | {average} | — | — | — |")
                continue
            load = f"{row['load_before'][0]:.2f} → {row['load_after'][0]:.2f}" if "load_before" in row else "—"
            lines.append(
                f"| {row_label(row)} | {average} | {row['seconds']:.1f} | {row['peak_rss_bytes'] / GIB:.2f} | {load} |"
            )
        lines += ["", "Per task (% ; wall time and peak RSS of the repair's own process):", "", comparison_table(rows)]
        floor = next((row["floor"] for row in rows if row.get("floor")), None)
        if floor:
            lines += ["", f"Import floor of a repair process: {floor['seconds']:.1f} s, "
                      f"{floor['peak_rss_bytes'] / GIB:.2f} GiB."]  # fmt: skip
        lines.append("")
    if not_defined:
        lines += ["## Not defined for this family", ""]
        lines += [f"- {entry['merge']}{' × ' + entry['repair'] if entry['repair'] else ''}: {entry['reason']}"
                  for entry in not_defined]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def interleave(spec, names: list[str], repeats: int, output: Path) -> None:
    """Time the repairs ``names`` again on the merge of the run ``spec`` (run already), alternately, ``repeats``
    times each."""
    from featcal.repairs import comparison
    from featcal.repairs.catalog import get_repair
    from featcal.repairs.compare_run import merged_folder
    from featcal.runfolder.layout import RUN_CONFIG
    from featcal.runfolder.record import read_run_config

    record = read_run_config(Path(spec.output_dir) / RUN_CONFIG, f"Run folder {spec.output_dir}")
    times: dict[str, list[dict]] = {name: [] for name in names}
    floor = comparison.measure_floor()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for name in names:
                out = Path(tmp) / f"{name}-{i}"
                argv = comparison.repair_command(spec, get_repair(name), merged_folder(spec), out)
                before = os.getloadavg()
                cost = comparison.measure_child(argv, what=name)
                times[name].append({"seconds": cost.seconds, "peak_rss_bytes": cost.peak_rss_bytes,
                                    "load_before": before, "load_after": os.getloadavg()})  # fmt: skip
                print(f"{name} #{i}: {cost.seconds:.1f} s, load {before[0]:.2f}", flush=True)
    result = {"run_id": record.recipe_sha256, "repeats": repeats, "times": times,
              "floor": {"seconds": floor.seconds, "peak_rss_bytes": floor.peak_rss_bytes}}  # fmt: skip
    output.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", choices=("mini8", "t5x4", "lm5"), default="mini8")
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument("--zoo-cache-dir", default=None)
    parser.add_argument("--merges", nargs="+", default=["task_arithmetic", "regmean_plusplus", "wudi"])
    parser.add_argument("--repairs", nargs="+", default=["featcal", "surgery", "probsurgery", "svc", "lot"])
    parser.add_argument("--work-dir", default=None, help="where the run folders go (default: a temporary folder)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--render", default=None, metavar="JSON", help="only write the markdown of a recorded JSON")
    parser.add_argument("--interleave", nargs=2, default=None, metavar="NAME", help="time two repairs alternately")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.interleave:
        out = Path(args.output or RESULTS / f"repairs_side_by_side_{args.zoo}_seed{args.zoo_seed}_interleaved.json")
        folder = zoo_folder(args.zoo, args.zoo_seed, args.zoo_cache_dir)
        spec = run_spec(args.zoo, folder, Path(args.work_dir) / args.merges[0], args.merges[0])
        interleave(spec, args.interleave, args.repeats, out)
        return
    if args.render:
        recorded = json.loads(Path(args.render).read_text())
        text = markdown(recorded["zoo"], recorded["zoo_seed"], recorded["merges"], recorded.get("not_defined"))
        Path(args.render).with_suffix(".md").write_text(text)
        print(text)
        return
    output = Path(args.output or RESULTS / f"repairs_side_by_side_{args.zoo}_seed{args.zoo_seed}.json")
    folder = zoo_folder(args.zoo, args.zoo_seed, args.zoo_cache_dir)
    merges: dict[str, list[dict]] = {}
    not_defined: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        for merge in args.merges:
            spec = run_spec(args.zoo, folder, work / merge, merge)
            loads = {}
            for repair in args.repairs:
                before = os.getloadavg()
                start = time.perf_counter()
                try:
                    run_compared(spec, [repair])
                except InvalidParameterError as exc:  # refused for the family, before any work
                    if exc.name not in ("merge_method", "repair"):
                        raise
                    not_defined.append({"merge": merge, "repair": repair if exc.name == "repair" else None,
                                        "reason": str(exc)})  # fmt: skip
                    print(f"{merge} {repair}: not defined: {exc}", flush=True)
                    if exc.name == "merge_method":
                        break
                    continue
                loads[repair] = {"load_before": before, "load_after": os.getloadavg(),
                                 "call_s": time.perf_counter() - start}  # fmt: skip
                print(f"{merge} {repair}: done, load {before[0]:.2f} → {os.getloadavg()[0]:.2f}", flush=True)
            if loads:
                rows = read_comparison(work / merge)
                merges[merge] = [{**row, **loads.get(row_label(row), {})} for row in rows]
    output.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "zoo": args.zoo, "zoo_seed": args.zoo_seed, "zoo_folder": folder.name, "threads": 1,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version()},
        "merges": merges, "not_defined": not_defined,
    }  # fmt: skip
    output.write_text(json.dumps(record, indent=1) + "\n")
    output.with_suffix(".md").write_text(markdown(args.zoo, args.zoo_seed, merges, not_defined))
    print(output.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
