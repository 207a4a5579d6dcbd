"""Serve a model with the Space, classify one image in headless Chromium and save the page as a PNG.

The steps of the browser test (tests/test_space_ui.py), on the run, release or model folder you give:
the docs' screenshot (docs/space-screenshot.png) is the mini8 release that `featcal demo` writes,

    featcal demo --output-dir /tmp/mini8
    PYTHONPATH=. .venv/bin/python scripts/space_screenshot.py --model /tmp/mini8 \\
        --tasks-file ~/.cache/featcal/benchmark/mini8-v5-seed0/tasks.json --example scenes \\
        --output docs/space-screenshot.png

A run folder serves its release/ with the base its run_config.json records; the image is the example
of ``--example`` (a task's first test image, as the page's examples), or ``--image``. Needs Debian's
``chromium`` (``apt-get install -y chromium``) and the ``playwright`` package; never ``playwright
install``.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from featcal.errors import FeatcalError  # noqa: E402
from featcal.space import SpaceSettings, create_space  # noqa: E402
from tests.support.browser import CHROMIUM, VIEWPORT, classify_on_page, launch_chromium  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def screenshot(settings: SpaceSettings, output: Path, *, image: Path | None, example: str | None, task: str | None):
    """Serve ``settings``' model, classify ``image`` (else the example image of task ``example``, else of the
    first task) as ``task`` (None: all tasks), save the whole page to ``output``; returns the status line."""
    from playwright.sync_api import sync_playwright

    space = create_space(settings, progress=False)
    try:
        if image is None:
            name = example or next(iter(space.model.tasks))
            found = [folder / f"{name}.png" for folder in space.example_folders if (folder / f"{name}.png").is_file()]
            if not found:
                raise SystemExit(f"space_screenshot: error: no example image for task {name!r}: pass --image.")
            image = found[0]
        space.launch(host="127.0.0.1", port=free_port(), prevent_thread_lock=True)
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page = browser.new_page(viewport=VIEWPORT)
            status = classify_on_page(page, space.demo.local_url, image, task)
            if not status.startswith("Top classes"):
                raise SystemExit(f"space_screenshot: error: the page did not classify {image}: {status}")
            output.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(output), full_page=True)
            browser.close()
        return status
    finally:
        space.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR_OR_ID", help="run, release or model folder, or Hub id")
    parser.add_argument("--base-model-id", metavar="ID_OR_DIR", help="base CLIP (default: the run's)")
    parser.add_argument("--tasks-file", metavar="FILE", help="the tasks to offer (default: the built-in suite's)")
    parser.add_argument("--suite", help="built-in suite to offer (default: the run's, else ta8)")
    parser.add_argument("--image", type=Path, help="the image to classify (default: an example image)")
    parser.add_argument("--example", metavar="TASK", help="use this task's example image (default: the first task's)")
    parser.add_argument("--task", metavar="TASK", help="the task to pick in the dropdown (default: all of them)")
    parser.add_argument("--output", type=Path, default=Path("test-artifacts/space.png"), help="the PNG to write")
    args = parser.parse_args()
    if not CHROMIUM.exists():
        raise SystemExit(f"space_screenshot: error: needs {CHROMIUM}: apt-get install -y chromium")
    settings = SpaceSettings(
        model_id=args.model,
        base_model_id=args.base_model_id,
        tasks_file=args.tasks_file,
        suite=args.suite,
        app_dir=Path.cwd(),
        device="cpu",
    )
    try:
        status = screenshot(settings, args.output, image=args.image, example=args.example, task=args.task)
    except FeatcalError as exc:
        print(f"space_screenshot: error: {exc}", file=sys.stderr)
        return 2
    print(f"{status.splitlines()[0]}\nScreenshot: {args.output.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
