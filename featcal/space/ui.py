"""The Gradio page: upload an image, pick a task (or all), read the top classes, compare with CLIP."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from featcal.errors import ServeError
from featcal.space.examples import collect_examples
from featcal.space.model import ALL_TASKS, SpaceModel
from featcal.space.predict import MAX_TOP_K, classify
from featcal.space.settings import PAPER_URL, SpaceSettings

CSS = ".task-row {gap: 12px} footer {display: none !important}"


def _model_link(ref: str) -> str:
    """A Hub id as a link; a local folder by its last two path parts (the page never shows full paths)."""
    path = Path(ref).expanduser()
    if path.exists():
        return f"`{'/'.join(path.resolve().parts[-2:])}`"
    return f"[{ref}](https://huggingface.co/{ref})"


def intro(model: SpaceModel) -> str:
    """The explanation at the top of the page."""
    n = len(model.tasks)
    return (
        f"# FeatCal: one CLIP vision tower for {n} tasks\n"
        f"{_model_link(model.settings.model_id)} is a CLIP vision tower merged from {n} task experts and "
        f"calibrated with **FeatCal**, which re-solves the merged model layer by layer in closed form so its "
        f"features match the experts' ([paper, arXiv 2605.13030]({PAPER_URL})). Upload or paste an image, "
        f"pick a task (or all of them) and read the most likely classes. The text side is the original CLIP "
        f"({_model_link(model.base_ref)}): tick *compare* to see, side by side, what the original vision tower "
        "says, and so what merging and calibration changed."
    )


def render(model: SpaceModel, reply: Mapping[str, Any] | None) -> list[Any]:
    """Page updates for a :func:`classify` reply: the status line, then two labels per task."""
    import gradio as gr

    reply = reply or {}
    results = reply.get("results") or {}
    if reply.get("error"):
        status = f"**Could not classify this image.** {reply['error']}"
    elif results:
        image = reply.get("image") or {}
        status = f"Top classes for {len(results)} task(s) · image {image.get('width')}×{image.get('height')} px"
    else:
        status = ""
    status += "".join(f"\n- {note}" for note in reply.get("notes") or [])
    updates: list[Any] = [gr.Markdown(status)]
    for name in model.tasks:
        row = results.get(name)
        updates.append(
            gr.Label(
                value=row["model"] if row else None,
                visible=row is not None,
                label=f"{name} · {Path(model.settings.model_id).name}",
            )
        )
        updates.append(
            gr.Label(
                value=row.get("base") if row else None,
                visible=bool(row and "base" in row),
                label=f"{name} · original CLIP",
            )
        )
    return updates


def build_demo(model: SpaceModel, examples: Mapping[str, Path]):
    """The Blocks app for ``model``, with one example image per task where there is one."""
    import gradio as gr

    settings = model.settings
    choices = [(f"All {len(model.tasks)} tasks", ALL_TASKS), *[(name, name) for name in model.tasks]]
    with gr.Blocks(title="FeatCal zero-shot CLIP") as demo:
        gr.Markdown(intro(model))
        with gr.Row():
            with gr.Column(scale=2):
                image = gr.Image(type="filepath", label="Image", sources=["upload", "clipboard"], elem_id="image")
                task = gr.Dropdown(choices, value=ALL_TASKS, label="Task", elem_id="task")
                with gr.Row():
                    top_k = gr.Slider(
                        1, MAX_TOP_K, value=settings.top_k, step=1, label="Classes shown", elem_id="top-k"
                    )
                    compare = gr.Checkbox(value=True, label="compare with the original CLIP", elem_id="compare")
                button = gr.Button("Classify", variant="primary", elem_id="classify")
                if examples:
                    gr.Examples(
                        [[str(path), name] for name, path in examples.items()],
                        inputs=[image, task],
                        label="Examples, one per task (from its test split)",
                    )
            with gr.Column(scale=3):
                status = gr.Markdown(elem_id="status")
                labels = []
                for name in model.tasks:
                    with gr.Row(elem_classes="task-row"):
                        labels.append(gr.Label(num_top_classes=MAX_TOP_K, visible=False, elem_id=f"model-{name}"))
                        labels.append(gr.Label(num_top_classes=MAX_TOP_K, visible=False, elem_id=f"base-{name}"))
                with gr.Accordion("Raw reply (what the API returns)", open=False):
                    raw = gr.JSON(label="reply")
        # The page calls the public `/predict` endpoint, then draws its reply: API users get the same numbers.
        button.click(
            partial(classify, model),
            inputs=[image, task, top_k, compare],
            outputs=raw,
            api_name="predict",
            preprocess=False,
            concurrency_limit=settings.concurrency_limit,
        ).then(partial(render, model), inputs=raw, outputs=[status, *labels], api_visibility="private")
    demo.queue(default_concurrency_limit=settings.concurrency_limit, max_size=settings.queue_size)
    return demo


class _QuietBindFailure(logging.Filter):
    """Drops uvicorn's log line for a bind that failed: :meth:`Space.launch` raises a ServeError saying it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "attempting to bind" not in record.getMessage()


def _serve_error(host: str | None, port: int | None) -> ServeError:
    """The one-line error for a server that could not bind to ``host`` and ``port`` (None: Gradio's)."""
    host = host or os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    if port is None and not os.environ.get("GRADIO_SERVER_PORT"):
        return ServeError(host, None, f"Cannot serve on {host}: no port from 7860 on is free; choose a free `port`.")
    port = port or int(os.environ["GRADIO_SERVER_PORT"])
    return ServeError(
        host,
        port,
        f"Cannot serve on {host} port {port}: the port is in use (taken since it was checked, if it was free "
        f"then), or {host} is not an address of this machine: choose a free `port`, or stop what holds it.",
    )


@dataclass
class Space:
    """A built Space: its page, its model, the folders its example images live in, and the temporary
    folder of gathered examples (removed by :meth:`close`)."""

    demo: Any
    model: SpaceModel
    example_folders: list[Path]
    scratch: Path | None = None

    def launch(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        share: bool = False,
        prevent_thread_lock: bool = False,
    ) -> None:
        """Serve the page with the Space's limits: upload size, queue, access to the example folders.

        ``host`` and ``port`` default to Gradio's (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT, else
        127.0.0.1 and 7860 or the next free port).

        Raises:
            ServeError: when the server cannot bind: the port is taken (even if it was free when checked
                a moment before) or the host is not an address of this machine.
        """
        import gradio as gr

        quiet = _QuietBindFailure()
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(quiet)
        try:
            self.demo.launch(
                server_name=host,
                server_port=port,
                share=share,
                prevent_thread_lock=prevent_thread_lock,
                max_file_size=int(self.model.settings.max_file_mb * 1e6),
                show_error=True,
                allowed_paths=[str(f) for f in self.example_folders],
                theme=gr.themes.Soft(),
                css=CSS,
            )
        except OSError as exc:  # Gradio's "Cannot find empty port", after its own and uvicorn's bind failed
            raise _serve_error(host, port) from exc
        finally:
            uvicorn_log.removeFilter(quiet)

    def close(self) -> None:
        """Stop serving and remove the temporary folder of gathered example images."""
        try:
            self.demo.close()
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)


def create_space(settings: SpaceSettings, *, progress: bool = True) -> Space:
    """Load the model and its class embeddings, gather one example image per task, build the page."""
    model = SpaceModel(settings, progress=progress)
    shipped = settings.path(settings.examples_dir)
    cache = Path(tempfile.mkdtemp(prefix="featcal-space-examples-"))
    try:
        examples = collect_examples(list(model.tasks.values()), cache, shipped=shipped, progress=progress)
        if not any(cache.iterdir()):  # every example shipped: no temporary folder to keep and remove
            cache.rmdir()
            return Space(build_demo(model, examples), model, [shipped])
        return Space(build_demo(model, examples), model, [shipped, cache], scratch=cache)
    except BaseException:
        shutil.rmtree(cache, ignore_errors=True)
        raise
