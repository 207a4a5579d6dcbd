"""Export and push of a ViT-B/32-sized release: the time and peak memory of each step.

A TA8 run folder (base: a local folder with ViT-B/32's configuration and image processor) with the
published reference accuracies as its metrics and random ViT-B/32-shaped weights
(``CLIPVisionModel(CLIPVisionConfig())``, 87.5 M parameters) as its merged and calibrated models, then,
in one process:

1. ``export_release`` (weights copied, model card and plot rendered, manifest written);
2. ``check_release`` (the manifest's hashes and the card's metadata read back);
3. ``push_release(..., dry_run=True)``;
4. ``push_release`` to the Hub protocol double of the tests (``tests/support/hub_double.py``, a local
   HTTP server on 127.0.0.1, NOT the Hub): repo creation, LFS upload of the weights and plot, commit,
   tree check;
5. the same push again (unchanged: no commit).

The kernel's peak RSS is reset before each step (``/proc/self/clear_refs``), so each step's peak is its
own; the resident set at the step's start is recorded beside it. Nothing is downloaded.

    .venv/bin/python benchmarks/release_speed.py --workdir /tmp/release_speed \
        --out benchmarks/results/release_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from calibration_floor import environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKEN = "hf_benchmark_write_token"  # the double's own token; no real token is read or printed
REPO = "me/clip-vit-base-patch32-ta8-featcal"


def _status_gib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _isolate_from_the_real_hub(workdir: Path) -> None:
    """No token from the environment or a stored login, online, LFS instead of Xet (the double's terms)."""
    import huggingface_hub.constants as constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        os.environ.pop(name, None)
    constants.HF_TOKEN_PATH = str(workdir / "no-login" / "token")
    constants.HF_HUB_OFFLINE = False
    constants.HF_HUB_DISABLE_XET = True


def build_run(root: Path) -> Path:
    """A TA8 run folder (reference metrics) with random ViT-B/32-shaped ``ta/`` and ``featcal-ta/`` weights;
    its base is a local folder with ViT-B/32's configuration and image processor (what the export copies)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    from tests.support.release_runs import make_ta8_run

    base = root / "base"
    CLIPConfig().save_pretrained(str(base))
    CLIPImageProcessor().save_pretrained(str(base))
    run = make_ta8_run(root, base_model_id=str(base))
    for seed, stage in enumerate(("ta", "featcal-ta")):
        torch.manual_seed(seed)
        CLIPVisionModel(CLIPVisionConfig()).save_pretrained(str(run / stage))
    return run


def timed(steps: dict, name: str, call):
    _reset_peak()
    at_start = _status_gib("VmRSS")  # what the process already holds (the models' build leaves a varying part)
    start = time.perf_counter()
    result = call()
    seconds, peak = round(time.perf_counter() - start, 2), _status_gib("VmHWM")
    steps[name] = {"seconds": seconds, "peak_rss_gib": round(peak, 3), "rss_at_start_gib": round(at_start, 3)}
    print(f"{name:<14} {seconds:6.2f} s  peak RSS {peak:.2f} GiB (+{peak - at_start:.2f} over its start)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="an empty or missing folder for the run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import torch

    from featcal.release import check_release, export_release, push_release
    from tests.support.hub_double import Account, HubDouble

    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=False)
    _isolate_from_the_real_hub(args.workdir)
    before = environment(args.threads)  # machine, versions, threads and the load average now
    run = build_run(args.workdir)
    weights = (run / "featcal-ta" / "model.safetensors").stat().st_size

    steps: dict = {}
    release = timed(steps, "export", lambda: export_release(run, repo_id=REPO))
    timed(steps, "check", lambda: check_release(release))
    with HubDouble() as hub:
        hub.add_token(TOKEN, Account("me"))
        timed(steps, "dry_run", lambda: push_release(release, REPO, token=TOKEN, endpoint=hub.url, dry_run=True))
        first = timed(steps, "push", lambda: push_release(release, REPO, token=TOKEN, endpoint=hub.url))
        again = timed(steps, "push_again", lambda: push_release(release, REPO, token=TOKEN, endpoint=hub.url))
        commits = len(hub.commits)
    if not first.changed or again.changed or commits != 1:
        raise SystemExit(f"unexpected pushes: first changed {first.changed}, again {again.changed}, {commits} commits")

    results = {
        "steps": steps,
        "weights_bytes": weights,
        "release_files": sorted(p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()),
        "commits": commits,
        "environment": before,
        "load_average_after": os.getloadavg(),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
