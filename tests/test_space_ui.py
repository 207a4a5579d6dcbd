"""The Space's page in headless Chromium: upload an image, pick a task, read the answer on the page.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and the ``playwright`` package; never
``playwright install``. Saves the page as test-artifacts/space.png; `scripts/space_screenshot.py`
takes the same steps on a release of your choice (the docs' screenshot).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from featcal.families.clip_vision.entries import image_classes
from featcal.families.clip_vision.images import load_task_split, to_rgb
from featcal.space import SpaceSettings, create_space
from featcal.suites import task_table
from tests.support.browser import CHROMIUM, VIEWPORT, classify_on_page, launch_chromium

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium: apt-get install -y chromium"),
]


def test_upload_pick_a_task_and_read_the_result(tmp_path, device):
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="needs the playwright package (pip install playwright)"
    )
    settings = SpaceSettings(
        model_id=str(FIXTURE / "experts" / "t0"),
        base_model_id=str(FIXTURE / "base"),
        tasks_file=str(FIXTURE / "tasks.json"),
        device=device,
        heads_cache=str(tmp_path / "heads"),
    )
    space = create_space(settings, progress=False)
    task = task_table(FIXTURE / "tasks.json", replace=True).tasks["t1"]
    image = tmp_path / "upload.png"
    load_task_split(task, "test")[2]["image"].resize((256, 256), Image.NEAREST).save(image)
    probs = space.model.probabilities(to_rgb(Image.open(image)), ["t1"])["t1"]
    expected = image_classes(task).classnames[int(probs.argmax())]

    space.launch(host="127.0.0.1", prevent_thread_lock=True)
    try:
        with playwright.sync_playwright() as p:
            browser = launch_chromium(p)
            page = browser.new_page(viewport=VIEWPORT)
            status = classify_on_page(page, space.demo.local_url, image, "t1", timeout_ms=30_000)
            assert status.startswith("Top classes for 1 task(s)")
            result = page.locator("#model-t1")
            result.wait_for(state="visible", timeout=30_000)
            page.locator("#base-t1").wait_for(state="visible", timeout=10_000)
            top = result.get_by_test_id("label-output-value").first
            top.wait_for(timeout=10_000)
            assert top.inner_text().strip() == expected
            assert not page.locator("#model-t0").is_visible() and not page.locator("#model-t2").is_visible()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "space.png"), full_page=True)

            # A file that is no image gets a message on the page, not a crash.
            (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
            page.reload()
            page.locator("#image input[type=file]").set_input_files(str(tmp_path / "broken.png"))
            page.locator("#classify").click()
            page.get_by_text("Could not classify this image.").wait_for(timeout=30_000)
            assert "not an image" in page.locator("#status").inner_text()
            assert not page.locator("#model-t1").is_visible()
            browser.close()
    finally:
        space.close()
    assert (ARTIFACTS / "space.png").stat().st_size > 10_000
