"""The Space server's resident memory when idle: fresh, then after bursts of eight large uploads.

`featcal space` serves the tests' tiny 3-task fixture (tests/fixtures/tiny-clip-3task: its expert t0
against its base, its tasks file) on 127.0.0.1 in a process of its own, as a visitor's browser would
reach it. The script reads that process's resident set (``/proc/PID/statm``) once it answers, sends
one small image and reads it again, then sends ``--bursts`` bursts of eight concurrent uploads near
the Space's pixel limit (8 MP: two JPEGs, an RGB, an RGBA and a 16-bit grayscale PNG, a lossless
WebP, a deflated TIFF and an 8-bit BMP, each under the 10 MB file limit), each burst followed by
``--idle`` seconds without requests and a reading of the resident set. Its high-water mark
(``VmHWM``) is read at the end. The model is tiny, so what is measured is the server (Gradio, torch,
the image decoding and conversion), not a ViT-B/32's weights, which a real Space adds to every reading.

    .venv/bin/python benchmarks/space_memory.py --workdir /tmp/space_memory --out benchmarks/results/space_memory.json

``--featcal-root DIR`` serves the featcal package of another tree (e.g. one made with ``git archive``
of an earlier commit) for a before/after comparison with the same uploads.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from calibration_floor import environment
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-clip-3task"
MIB = 2**20
SIZE = (3264, 2448)  # 7.99 MP, under the 8 MP limit
PAGE = os.sysconf("SC_PAGE_SIZE")


def uploads(folder: Path) -> list[Path]:
    """Eight files of 3264 × 2448 pixels: a smooth picture with a little noise, each under 10 MB."""
    rng = np.random.default_rng(0)
    width, height = SIZE
    x, y = np.meshgrid(np.linspace(0, 1, width, dtype=np.float32), np.linspace(0, 1, height, dtype=np.float32))
    channels = [128 + 100 * np.sin(6 * x + k) * np.cos(4 * y - k) for k in range(3)]
    rgb = np.clip(np.stack(channels, -1) + rng.normal(0, 4, (height, width, 3)), 0, 255).astype(np.uint8)
    picture = Image.fromarray(rgb)
    alpha = Image.fromarray((255 * x).astype(np.uint8))
    files = {
        "photo.jpg": (picture, {"quality": 92}),
        "photo-progressive.jpg": (picture, {"quality": 85, "progressive": True}),
        "picture.png": (picture.quantize(64).convert("RGB"), {}),
        "transparent.png": (Image.merge("RGBA", (*picture.quantize(64).convert("RGB").split(), alpha)), {}),
        "deep.png": (Image.fromarray(np.asarray(picture.convert("L"), np.uint16) // 16 * 4096), {}),
        "picture.webp": (picture.quantize(64).convert("RGB"), {"lossless": True}),
        "picture.tiff": (picture.quantize(64).convert("RGB"), {"compression": "tiff_adobe_deflate"}),
        "palette.bmp": (picture.quantize(64), {}),
    }
    paths = []
    for name, (image, options) in files.items():
        path = folder / name
        image.save(path, **options)
        size = path.stat().st_size
        if size > 10e6:
            raise SystemExit(f"{name} is {size / 1e6:.1f} MB, over the Space's 10 MB limit")
        paths.append(path)
    return paths


def rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / MIB


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(workdir: Path, featcal_root: Path, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(featcal_root),
        "FEATCAL_CACHE": str(workdir / "cache"),  # the class heads' cache: computed at the first start
        "HF_HUB_OFFLINE": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    command = [sys.executable, "-m", "featcal", "-q", "space", "--model", str(FIXTURE / "experts" / "t0")]
    command += ["--base-model-id", str(FIXTURE / "base"), "--tasks-file", str(FIXTURE / "tasks.json")]
    command += ["--device", "cpu", "--port", str(port)]
    log = (workdir / "server.log").open("w")
    return subprocess.Popen(command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)


def wait_until_served(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}: see server.log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer at {url} within {timeout} s")


def settled_rss(pid: int, idle: float) -> float:
    """The resident set after ``idle`` seconds without requests (the last of one reading a second)."""
    readings = []
    for _ in range(max(1, int(idle))):
        time.sleep(1)
        readings.append(rss_mib(pid))
    return readings[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="an empty or missing folder")
    parser.add_argument("--bursts", type=int, default=4, help="bursts of eight concurrent uploads (default 4)")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds without requests before a reading")
    parser.add_argument("--featcal-root", type=Path, default=ROOT, help="the tree whose featcal package serves")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import gradio_client

    args.workdir.mkdir(parents=True, exist_ok=False)
    files = uploads(args.workdir)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    before = environment(os.cpu_count() or 1)  # the server's torch threads: its default, one per core
    server = start_server(args.workdir, args.featcal_root.resolve(), port)
    try:
        wait_until_served(url, server)
        fresh = settled_rss(server.pid, args.idle)
        print(f"fresh        {fresh:8.1f} MiB", flush=True)
        client = gradio_client.Client(url, verbose=False)
        small = args.workdir / "small.png"
        Image.new("RGB", (64, 48), (200, 30, 30)).save(small)
        reply = client.predict(gradio_client.handle_file(str(small)), "all", 5, True, api_name="/predict")
        if reply["error"]:
            raise SystemExit(f"the first request failed: {reply['error']}")
        warm = settled_rss(server.pid, args.idle)
        print(f"warm         {warm:8.1f} MiB (after one small image)", flush=True)
        bursts = []
        for burst in range(args.bursts):
            start = time.monotonic()
            with ThreadPoolExecutor(len(files)) as pool:
                replies = list(
                    pool.map(
                        lambda path: client.predict(
                            gradio_client.handle_file(str(path)), "all", 5, True, api_name="/predict"
                        ),
                        files,
                    )
                )
            seconds = time.monotonic() - start
            errors = {path.name: r["error"] for path, r in zip(files, replies) if r["error"]}
            if errors:
                raise SystemExit(f"burst {burst + 1}: uploads refused: {errors}")
            idle = settled_rss(server.pid, args.idle)
            bursts.append({"seconds": round(seconds, 2), "idle_rss_mib": round(idle, 1)})
            print(f"burst {burst + 1}      {idle:8.1f} MiB idle after it ({seconds:.1f} s for 8 uploads)", flush=True)
        peak = peak_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    last = bursts[-1]["idle_rss_mib"]
    results = {
        "featcal_root": str(args.featcal_root.resolve()),
        "uploads": [
            {"file": path.name, "pixels": list(SIZE), "megabytes": round(path.stat().st_size / 1e6, 2)}
            for path in files
        ],
        "idle_seconds": args.idle,
        "fresh_rss_mib": round(fresh, 1),
        "warm_rss_mib": round(warm, 1),
        "bursts": bursts,
        "peak_rss_mib": round(peak, 1),
        "last_idle_over_fresh": round(last / fresh, 3),
        "max_idle_over_fresh": round(max(b["idle_rss_mib"] for b in bursts) / fresh, 3),
        "environment": before,
        "load_average_after": os.getloadavg(),
    }
    print(f"peak         {peak:8.1f} MiB; idle after the last burst {last / fresh:.2f} × fresh")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
