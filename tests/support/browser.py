"""The Space's page in headless Chromium, for the browser test and `scripts/space_screenshot.py`.

Debian's ``chromium`` (``apt-get install -y chromium``) driven by the ``playwright`` package through
``executable_path``; never ``playwright install``.
"""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1280, "height": 1000}


def launch_chromium(playwright):
    """Headless Chromium from ``/usr/bin/chromium``.

    Args:
        playwright: What ``playwright.sync_api.sync_playwright()`` gives.

    Returns:
        The browser.
    """
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)


def classify_on_page(page, url: str, image: Path, task: str | None = None, timeout_ms: int = 60_000) -> str:
    """Open the Space at ``url``, upload ``image``, pick ``task`` (None: leave "all"), press Classify.

    Args:
        page: A Playwright page.
        url: The Space's address.
        image: The image file to upload.
        task: A task's name as the dropdown lists it, or None for all tasks.
        timeout_ms: How long to wait for the answer.

    Returns:
        The status line the page shows once the answer is drawn.
    """
    page.goto(url)
    page.locator("#image input[type=file]").set_input_files(str(image))
    page.locator("#image img").first.wait_for(timeout=15_000)
    if task is not None:
        page.get_by_role("combobox", name="Task").click()
        page.get_by_role("option", name=task, exact=True).click()
    page.locator("#classify").click()
    status = page.locator("#status")
    # Gradio draws the answer under its "processing | 0.1s" overlay a moment before it removes the overlay:
    # wait for both, so the text returned is the status line alone.
    page.wait_for_function(
        "() => { const text = document.querySelector('#status')?.innerText || '';"
        " return /Top classes|Could not classify/.test(text) && !/processing/.test(text); }",
        timeout=timeout_ms,
    )
    return status.inner_text()
