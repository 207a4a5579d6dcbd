"""The Space served on 127.0.0.1 and called through gradio_client, on the tiny 3-task fixture.

The model is the fixture's expert t0 (a CLIPVisionModel folder), the base its tiny CLIPModel, the
tasks its tasks.json with local parquet datasets: nothing touches the network.
"""

from __future__ import annotations

import copy
import io
import json
import struct
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from featcal.errors import FeatcalError, ModelInputError
from featcal.families.clip_vision.entries import image_classes
from featcal.families.clip_vision.evaluation import ZeroShotClassifier, load_base_clip
from featcal.families.clip_vision.folders import load_vision_folder
from featcal.families.clip_vision.images import load_task_split, pixel_values, to_rgb
from featcal.space import SpaceModel, SpaceSettings, classify, create_space, resolve_model_source
from featcal.space.model import base_model_ref
from featcal.suites import task_table

gradio_client = pytest.importorskip("gradio_client")

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
MODEL = FIXTURE / "experts" / "t0"
# The served probabilities against the library's on the CPU: up to float rounding on the CPU, up to the
# GPU's rounding on CUDA (the bound of test_the_space_model_runs_on_each_device).
ATOL = {"cpu": 2e-6, "cuda": 1e-5}


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> SpaceSettings:
    return SpaceSettings(
        model_id=str(MODEL),
        base_model_id=str(FIXTURE / "base"),
        tasks_file=str(FIXTURE / "tasks.json"),
        device="cpu",
        heads_cache=str(tmp_path_factory.mktemp("heads")),
    )


@pytest.fixture(scope="module")
def served(settings, device):
    space = create_space(replace(settings, device=device), progress=False)
    space.launch(host="127.0.0.1", prevent_thread_lock=True)
    client = gradio_client.Client(space.demo.local_url, verbose=False)
    yield space.model, client
    space.close()


@pytest.fixture(scope="module")
def library():
    """The library's own zero-shot classifier on the same model: what the Space must agree with."""
    clip, tokenizer, processor = load_base_clip(FIXTURE / "base")
    return ZeroShotClassifier(clip, tokenizer), processor, load_vision_folder(MODEL), clip.vision_model


def _save(image: Image.Image, path: Path, **kwargs) -> Path:
    image.save(path, **kwargs)
    return path


def test_probabilities_match_the_library_evaluation(served, library, tmp_path, device):
    model, client = served
    classifier, processor, vision, base_vision = library
    task = task_table(FIXTURE / "tasks.json", replace=True).tasks["t1"]
    path = _save(load_task_split(task, "test")[3]["image"], tmp_path / "t1.png")

    reply = client.predict(gradio_client.handle_file(str(path)), "all", 20, True, api_name="/predict")

    assert reply["error"] is None and list(reply["results"]) == ["t0", "t1", "t2"]
    pixels = pixel_values(processor, [to_rgb(Image.open(path))])
    for name, table in task_table(FIXTURE / "tasks.json", replace=True).tasks.items():
        for key, tower in (("model", vision), ("base", base_vision)):
            expected = classifier.logits(tower, pixels, table)[0].softmax(-1)
            got = reply["results"][name][key]
            assert list(got) == [image_classes(table).classnames[i] for i in expected.argsort(descending=True).tolist()]
            probs = torch.tensor([got[c] for c in image_classes(table).classnames])
            torch.testing.assert_close(probs, expected, atol=ATOL[device], rtol=0)
    # The expert differs from the base, so the two columns must too.
    assert reply["results"]["t0"]["model"] != reply["results"]["t0"]["base"]


def test_one_task_top_k_and_no_comparison(served, tmp_path):
    _, client = served
    path = _save(Image.new("RGB", (40, 30), (200, 30, 30)), tmp_path / "red.png")
    reply = client.predict(gradio_client.handle_file(str(path)), "t2", 2, False, api_name="/predict")
    assert reply["error"] is None
    assert list(reply["results"]) == ["t2"] and list(reply["results"]["t2"]) == ["model"]
    probs = list(reply["results"]["t2"]["model"].values())
    assert len(probs) == 2 and probs[0] >= probs[1] > 0
    assert reply["image"] == {"width": 40, "height": 30, "mode": "RGB"}


def test_unknown_task_and_missing_image_are_messages(served, tmp_path):
    model, client = served
    path = _save(Image.new("RGB", (8, 8)), tmp_path / "x.png")
    reply = client.predict(gradio_client.handle_file(str(path)), "sun397", 5, False, api_name="/predict")
    assert "Unknown task 'sun397'" in reply["error"] and reply["results"] == {}
    assert "upload or paste an image" in classify(model, None, "all")["error"]


def _odd_images(folder: Path) -> dict[str, tuple[Path, str, str]]:
    """name → (file, 'ok' or 'error', text the reply's notes or error must contain)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    gradient = np.linspace(0, 255, 2800, dtype=np.float32)
    large = Image.fromarray(np.stack([np.add.outer(gradient, gradient) / 2] * 3, -1).astype(np.uint8))
    jpeg = io.BytesIO()
    Image.fromarray(noise).save(jpeg, "JPEG")
    rotated = Image.fromarray(noise)
    exif = rotated.getexif()
    exif[0x0112] = 6
    frames = [Image.fromarray(noise).convert("P"), Image.fromarray(255 - noise).convert("P")]
    cases = {
        "grayscale": (_save(Image.fromarray(noise[..., 0]), folder / "gray.png"), "ok", "grayscale"),
        "rgba": (_save(Image.fromarray(np.dstack([noise, noise[..., :1]])), folder / "rgba.png"), "ok", "RGBA"),
        "cmyk": (_save(Image.fromarray(noise).convert("CMYK"), folder / "cmyk.jpg"), "ok", "CMYK"),
        "16-bit": (
            _save(Image.fromarray(noise[..., 0].astype(np.uint16) * 257), folder / "deep.png"),
            "ok",
            "16-bit",
        ),
        "1x1": (_save(Image.new("RGB", (1, 1), (9, 99, 199)), folder / "dot.png"), "ok", "only 1×1"),
        "2800x2800": (_save(large, folder / "large.jpg", quality=80), "ok", ""),
        "exif-rotated": (_save(rotated, folder / "rot.jpg", exif=exif), "ok", "Rotated"),
        "animated": (
            _save(frames[0], folder / "anim.gif", save_all=True, append_images=frames[1:]),
            "ok",
            "first frame",
        ),
        "corrupt": (folder / "corrupt.png", "error", "not an image"),
        "truncated": (folder / "truncated.jpg", "error", "corrupt or truncated"),
        "text": (folder / "notes.jpg", "error", "not an image"),
        "empty": (folder / "empty.png", "error", "empty"),
        "strip": (_save(Image.new("RGB", (3000, 10)), folder / "strip.png"), "error", "crop"),
        "48 MP": (_save(Image.new("L", (8000, 6000)), folder / "big.png"), "error", "megapixels"),
        "4K frame": (
            _save(Image.new("RGB", (3840, 2160)), folder / "4k.png"),
            "error",
            "(8.3 MP); this Space accepts up to 8 megapixels.",
        ),
    }
    (folder / "corrupt.png").write_bytes(rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    (folder / "truncated.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 3])
    (folder / "notes.jpg").write_text("not a picture\n")
    (folder / "empty.png").write_bytes(b"")
    return cases


def test_odd_images_are_converted_or_explained_never_a_crash(served, library, tmp_path, device):
    model, client = served
    classifier, processor, vision, _ = library
    t0 = model.tasks["t0"]
    for name, (path, outcome, text) in _odd_images(tmp_path).items():
        reply = client.predict(gradio_client.handle_file(str(path)), "t0", 3, False, api_name="/predict")
        if outcome == "ok":
            assert reply["error"] is None, (name, reply["error"])
            assert text in " ".join(reply["notes"]), (name, reply["notes"])
            # Converted as the library converts dataset images (featcal.data.to_rgb), after EXIF rotation; a
            # large JPEG decoded at the reduced scale the Space asks for.
            image = Image.open(path)
            image.draft("RGB", (model.input_side, model.input_side))
            image = ImageOps.exif_transpose(image)
            expected = classifier.logits(vision, pixel_values(processor, [to_rgb(image)]), t0)[0].softmax(-1)
            values, indices = expected.topk(3)
            assert reply["results"]["t0"]["model"] == pytest.approx(
                {image_classes(t0).classnames[i]: float(v) for v, i in zip(values, indices.tolist())}, abs=ATOL[device]
            ), name
        else:
            assert reply["results"] == {} and text in reply["error"], (name, reply["error"])
    # The server still answers normally afterwards.
    ok = client.predict(gradio_client.handle_file(str(tmp_path / "dot.png")), "all", 1, True, api_name="/predict")
    assert ok["error"] is None and len(ok["results"]) == 3


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(width: int, height: int, data: bytes, *, depth: int = 8, color: int = 2, interlace: int = 0) -> bytes:
    """A PNG declaring ``width``×``height`` whose compressed stream, complete and valid, inflates to ``data``
    (the rows' bytes, each after its filter byte)."""
    header = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(data)) + _chunk(b"IEND", b"")


def _encoded(image: Image.Image, format: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **kwargs)
    return buffer.getvalue()


def _tiff_declaring(data: bytes, height: int) -> bytes:
    """A TIFF written by Pillow, its ImageLength and RowsPerStrip changed to ``height``."""
    patched = bytearray(data)
    ifd = struct.unpack("<I", data[4:8])[0]
    for i in range(struct.unpack("<H", data[ifd : ifd + 2])[0]):
        entry = ifd + 2 + 12 * i
        tag, kind = struct.unpack("<HH", data[entry : entry + 4])
        if tag in (257, 278):  # ImageLength, RowsPerStrip
            patched[entry + 8 : entry + 12] = struct.pack(
                "<HH" if kind == 3 else "<I", *([height, 0] if kind == 3 else [height])
            )
    return bytes(patched)


def _bmp_rle8(width: int, height: int, rows: int) -> bytes:
    """An 8-bit run-length BMP declaring ``width``×``height`` whose data ends (end-of-bitmap) after ``rows`` rows."""
    row = b"".join(bytes([min(255, width - x), 7]) for x in range(0, width, 255)) + b"\x00\x00"
    data = row * rows + b"\x00\x01"
    offset = 14 + 40 + 1024
    header = b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(data), 2835, 2835, 256, 0)
    return header + info + bytes(1024) + data


def _truncated_files() -> dict[str, bytes]:
    """Image files whose data ends before their last pixel: cut anywhere, or ending cleanly too early."""
    rng = np.random.default_rng(1)
    noise = Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8))
    row = b"\x00" + bytes(range(256)) * 3 * 8  # one filter byte, then a 2048-pixel RGB row
    files = {
        # The reported kind: a complete, valid compressed stream of one row under a header of many.
        "png, one row of 1500": _png(2048, 1500, row),
        "png, 16-bit, half the rows": _png(300, 200, (b"\x00" + bytes(300 * 6)) * 100, depth=16),
        "png, palette, one row of 200": _png(300, 200, b"\x00" + bytes(300), color=3),
        "png, interlaced, first passes only": _png(64, 64, bytes(200), interlace=1),
        "gif, one row of 120": _encoded(noise.crop((0, 0, 160, 1)).convert("P"), "GIF"),
        "bmp, run-length, end of bitmap after 3 rows": _bmp_rle8(160, 120, 3),
        "tiff, deflate, one row of 120": _tiff_declaring(
            _encoded(noise.crop((0, 0, 160, 1)), "TIFF", compression="tiff_adobe_deflate"), 120
        ),
    }
    gif = bytearray(files["gif, one row of 120"])
    gif[8:10] = struct.pack("<H", 120)  # the screen, then the frame, declare 120 rows
    frame = gif.index(0x2C, 13 + 3 * (2 << (gif[10] & 7)))
    gif[frame + 7 : frame + 9] = struct.pack("<H", 120)
    files["gif, one row of 120"] = bytes(gif)
    for name, kwargs in {
        "png": {},
        "png, interlaced": {"interlace": 1},
        "jpeg": {},
        "jpeg, progressive": {"progressive": True},
        "webp": {},
        "webp, lossless": {"lossless": True},
        "gif": {},
        "bmp": {},
        "tiff": {},
        "tiff, lzw": {"compression": "tiff_lzw"},
    }.items():
        data = _encoded(noise, name.split(",")[0].upper(), **kwargs)
        for fraction in (0.1, 0.5, 0.9):
            files[f"{name}, cut at {fraction:.0%}"] = data[: int(len(data) * fraction)]
        if name.startswith(("jpeg", "bmp", "tiff", "webp")):  # no trailer that may go: the last byte is data
            files[f"{name}, last byte cut"] = data[:-1]
    return files


@pytest.mark.parametrize("name", list(_truncated_files()))
def test_a_truncated_image_is_refused_however_it_is_cut(name):
    """Pillow never pads the missing rows (a PNG's short stream is the case it would): one line, no image."""
    from PIL import ImageFile

    from featcal.space.images import open_upload

    data = _truncated_files()[name]
    with pytest.raises(FeatcalError) as refused:
        open_upload(data, max_bytes=10**7, max_pixels=8 * 10**6, min_side=32)
    message = str(refused.value)
    assert "\n" not in message and ("corrupt or truncated" in message or "not an image" in message), message
    assert not ImageFile.LOAD_TRUNCATED_IMAGES


def _declaring_many_pixels() -> dict[str, bytes]:
    """Small files whose header declares 4000×2500 pixels (10 MP), one per format the Space reads."""
    flat = Image.new("RGB", (4000, 2500), (90, 140, 40))
    files = {
        "png, 150 bytes, 6000×6600 (the report)": _png(6000, 6600, b"\x00" + bytes(6000 * 3)),
        "png": _encoded(flat, "PNG"),
        "jpeg": _encoded(flat, "JPEG"),
        "webp": _encoded(flat, "WEBP", lossless=True),
        "gif": _encoded(flat.convert("P"), "GIF"),
        "tiff": _encoded(flat, "TIFF", compression="tiff_adobe_deflate"),
        "bmp, header only": _bmp_rle8(4000, 2500, 0),
    }
    # A GIF whose screen is 8×8 and whose first frame spreads over 4000×2500.
    gif = bytearray(_encoded(Image.new("P", (8, 8)), "GIF"))
    frame = gif.index(0x2C, 13 + (3 * (2 << (gif[10] & 7)) if gif[10] & 0x80 else 0))
    gif[frame + 5 : frame + 9] = struct.pack("<HH", 4000, 2500)
    files["gif, frame larger than its screen"] = bytes(gif)
    return files


@pytest.mark.parametrize("name", list(_declaring_many_pixels()))
def test_the_pixel_limit_is_checked_from_the_header_before_decoding(name, monkeypatch):
    from PIL import ImageFile

    from featcal.space.images import open_upload

    def no_decoding(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(FeatcalError, match="this Space accepts up to 8 megapixels"):
        open_upload(_declaring_many_pixels()[name], max_bytes=10**7, max_pixels=8 * 10**6, min_side=224)


def test_the_served_space_refuses_the_reported_uploads(served, tmp_path):
    """Through the API: the 150-byte PNG of 6000×6600 pixels, and one within the limit holding one row."""
    _, client = served
    reported = tmp_path / "reported.png"
    reported.write_bytes(_png(6000, 6600, b"\x00" + bytes(6000 * 3)))
    one_row = tmp_path / "one-row.png"
    one_row.write_bytes(_png(2048, 1500, b"\x00" + bytes(2048 * 3)))
    for path, text in ((reported, "megapixels"), (one_row, "corrupt or truncated")):
        reply = client.predict(gradio_client.handle_file(str(path)), "t0", 3, False, api_name="/predict")
        assert reply["results"] == {} and text in reply["error"], reply["error"]


def test_a_large_jpeg_is_decoded_at_reduced_scale(tmp_path):
    from featcal.space.images import open_upload

    data = _encoded(Image.new("RGB", (2800, 2000), (200, 30, 30)), "JPEG")
    reduced = open_upload(data, max_bytes=10**7, max_pixels=8 * 10**6, min_side=224)
    assert reduced.image.size == (350, 250) and reduced.original_size == (2800, 2000)
    assert open_upload(data, max_bytes=10**7, max_pixels=8 * 10**6, min_side=1000).image.size == (1400, 1000)
    assert open_upload(data, max_bytes=10**7, max_pixels=8 * 10**6).image.size == (2800, 2000)
    png = _encoded(Image.new("RGB", (2800, 2000)), "PNG")  # no reduced decoding in PNG
    assert open_upload(png, max_bytes=10**7, max_pixels=8 * 10**6, min_side=224).image.size == (2800, 2000)


def test_frames_are_noted_for_animations_and_pages_not_for_a_phones_mpo():
    from featcal.space.images import open_upload

    frames = [Image.new("RGB", (64, 48), color) for color in ((200, 30, 30), (30, 200, 30))]
    notes = {
        name: open_upload(
            _encoded(frames[0], format, save_all=True, append_images=frames[1:]),
            max_bytes=10**7,
            max_pixels=8 * 10**6,
            min_side=32,
        ).notes
        for name, format in (("gif", "GIF"), ("webp", "WEBP"), ("png", "PNG"), ("tiff", "TIFF"), ("mpo", "MPO"))
    }
    for name in ("gif", "webp", "png"):
        assert "Animated image: classified its first frame of 2." in notes[name], (name, notes[name])
    assert "Multi-page TIFF: classified its first page of 2." in notes["tiff"]
    assert notes["mpo"] == []  # a phone's JPEG with a preview or depth map after it: one photo


def test_each_request_hands_freed_memory_back(served, tmp_path, monkeypatch):
    import featcal.space.predict as predict

    model, _ = served
    trims = []
    monkeypatch.setattr(predict, "trim_heap", lambda: trims.append(1))
    path = _save(Image.new("RGB", (40, 30)), tmp_path / "small.png")
    assert classify(model, str(path), "t0")["error"] is None
    assert classify(model, str(tmp_path / "missing.png"), "t0")["error"]
    assert len(trims) == 2


@pytest.mark.parametrize(
    ("top_k", "compare", "message"),
    [
        (10**400, True, "top_k=1000000000000000000000000000000000000000… (401 characters) is invalid"),
        (0, True, "top_k=0 is invalid"),
        (-1, True, "top_k=-1 is invalid"),
        (10**9, True, "top_k=1000000000 is invalid"),
        (2.6, True, "top_k=2.6 is invalid"),
        (True, True, "top_k=True is invalid"),
        ("five", True, "top_k='five' is invalid"),
        ("1e999", True, "top_k='1e999' is invalid"),
        (3, "maybe", "compare='maybe' is invalid: it must be true or false (or the words yes/no, 1/0)."),
        (3, 2, "compare=2 is invalid"),
        (3, None, "compare=None is invalid"),
    ],
)
def test_api_inputs_out_of_range_or_of_the_wrong_type_get_one_line(served, tmp_path, caplog, top_k, compare, message):
    _, client = served
    path = _save(Image.new("RGB", (40, 30)), tmp_path / "ok.png")
    with caplog.at_level("WARNING"):
        reply = client.predict(gradio_client.handle_file(str(path)), "t0", top_k, compare, api_name="/predict")
    assert reply["results"] == {} and reply["image"] is None and message in reply["error"], reply["error"]
    assert "\n" not in reply["error"] and not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def _raw_predict(url: str, path: Path, top_k: str, compare: str) -> dict:
    """Call /predict with ``top_k`` and ``compare`` written into the JSON body as they are (``1e999`` is a
    number JSON allows and Python's client cannot send)."""
    import httpx

    uploaded = httpx.post(f"{url}gradio_api/upload", files={"files": path.open("rb")}).json()[0]
    image = json.dumps({"path": uploaded, "meta": {"_type": "gradio.FileData"}})
    body = f'{{"data": [{image}, "t0", {top_k}, {compare}]}}'
    headers = {"content-type": "application/json"}
    event = httpx.post(f"{url}gradio_api/call/predict", content=body, headers=headers).json()["event_id"]
    stream = httpx.get(f"{url}gradio_api/call/predict/{event}", timeout=60).text
    assert "event: complete" in stream, stream
    return json.loads(stream.split("data: ", 1)[1].splitlines()[0])[0]


@pytest.mark.parametrize(
    ("top_k", "message"),
    [
        ("1e999", "top_k=inf is invalid: it must be a whole number from 1 to 20."),
        ("-1e999", "top_k=-inf is invalid"),
        ("1" + "0" * 400, "top_k=1000000000000000000000000000000000000000… (401 characters) is invalid"),
        ("2.6", "top_k=2.6 is invalid"),
    ],
)
def test_numbers_beyond_a_float_get_the_same_line(served, tmp_path, caplog, top_k, message):
    _, client = served
    path = _save(Image.new("RGB", (40, 30)), tmp_path / "ok.png")
    with caplog.at_level("WARNING"):
        reply = _raw_predict(client.src.rstrip("/") + "/", path, top_k, "true")
    assert reply["results"] == {} and message in reply["error"], reply["error"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize(
    ("top_k", "compare", "k", "with_base"),
    [(2, "no", 2, False), ("3", "yes", 3, True), (4.0, "FALSE", 4, False), (1, 1, 1, True), (" 2 ", "0", 2, False)],
)
def test_api_inputs_that_hold_an_integer_or_a_boolean_are_read_as_such(served, tmp_path, top_k, compare, k, with_base):
    _, client = served
    path = _save(Image.new("RGB", (40, 30)), tmp_path / "ok.png")
    reply = client.predict(gradio_client.handle_file(str(path)), "t0", top_k, compare, api_name="/predict")
    assert reply["error"] is None and len(reply["results"]["t0"]["model"]) == k
    assert ("base" in reply["results"]["t0"]) is with_base


def test_file_size_limit(served, settings, tmp_path):
    model, client = served
    path = _save(Image.new("RGB", (64, 64)), tmp_path / "small.png")
    strict = copy.copy(model)
    strict.settings = replace(model.settings, max_file_mb=path.stat().st_size / 2e6)
    assert "accepts images up to" in classify(strict, str(path), "t0")["error"]
    # Gradio refuses uploads over max_file_size before the endpoint runs; the server stays up.
    big = tmp_path / "big.png"
    big.write_bytes(path.read_bytes() + bytes(int(settings.max_file_mb * 1e6) + 1))
    with pytest.raises(Exception, match="(?i)size|large|413"):
        client.predict(gradio_client.handle_file(str(big)), "t0", 3, False, api_name="/predict")
    assert client.predict(gradio_client.handle_file(str(path)), "t0", 3, False, api_name="/predict")["error"] is None


def test_data_url_upload(served, tmp_path):
    model, _ = served
    buffer = io.BytesIO()
    Image.new("L", (20, 20), 128).save(buffer, "PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    reply = classify(model, {"path": None, "url": url}, "t1", 5, True)
    assert reply["error"] is None and set(reply["results"]["t1"]) == {"model", "base"}
    assert "not valid base64" in classify(model, {"url": "data:image/png;base64,@@@"}, "t1")["error"]


def test_run_folders_resolve(settings, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(MODEL, run / "featcal-ta")
    (run / "run_config.json").write_text(json.dumps({"base_model_id": str(FIXTURE / "base")}))
    source = resolve_model_source(str(run))
    assert source.folder == run / "featcal-ta" and source.run_folder == run
    assert base_model_ref(replace(settings, base_model_id=None), source) == str(FIXTURE / "base")
    assert base_model_ref(settings, source) == settings.base_model_id
    # A recorded base that is a folder of another machine is named, with the option that replaces it.
    (run / "run_config.json").write_text(json.dumps({"base_model_id": "/elsewhere/clip"}))
    with pytest.raises(ModelInputError, match=r"the folder /elsewhere/clip, which is not on this machine: set `base"):
        base_model_ref(replace(settings, base_model_id=None), source)
    (run / "run_config.json").write_text(json.dumps({}))  # no base recorded: the default CLIP
    assert base_model_ref(replace(settings, base_model_id=None), source) == "openai/clip-vit-base-patch32"

    shutil.copytree(MODEL, run / "featcal-ties")
    with pytest.raises(FeatcalError, match="several calibrated models"):
        resolve_model_source(str(run))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatcalError, match="neither a model folder"):
        resolve_model_source(str(tmp_path / "empty"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny run folder from the fixture's local base, and its release as `featcal export` writes it."""
    from featcal.release import export_release
    from tests.support.release_runs import make_run

    run, _ = make_run(tmp_path_factory.mktemp("exported"))
    return run, export_release(run)


def _space_error(capsys, monkeypatch, *args: str) -> str:
    """`featcal space ARGS`: exit status 2 and one error line, never a server started; the line."""
    from featcal.cli import main
    from featcal.space.ui import Space

    monkeypatch.setattr(Space, "launch", lambda self, **kwargs: pytest.fail("the Space was served"))
    code = main(["-q", "space", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("featcal: error: "), lines
    return lines[0]


def test_a_release_made_from_a_local_base_says_which_base_to_pass(exported, settings, capsys, monkeypatch):
    run, release = exported
    assert json.loads((release / "run_config.json").read_text())["base_model_id"] == "local:base"
    line = _space_error(capsys, monkeypatch, "--model", str(release))
    assert f"The model {release} was made from a base CLIP in a local folder it names only 'local:base'" in line
    assert "set --base-model-id (BASE_MODEL_ID in a Space) to that base's folder or Hub id." in line
    served = SpaceModel(replace(settings, model_id=str(release), base_model_id=str(FIXTURE / "base")), progress=False)
    assert served.source.folder == release
    # Its run folder records the base's path: no option needed.
    assert SpaceModel(replace(settings, model_id=str(run), base_model_id=None), progress=False).base_ref == str(
        (FIXTURE / "base").resolve()
    )


def test_a_release_made_from_a_hub_base_names_it(tmp_path, settings, monkeypatch):
    import featcal.release.export
    from featcal.release import export_release
    from tests.support.release_runs import make_run

    hub_id = "openai/clip-vit-base-patch32"
    monkeypatch.setattr(featcal.release.export, "resolve_model_folder", lambda ref, what: FIXTURE / "base")
    run, _ = make_run(tmp_path, base_model_id=hub_id)
    release = export_release(run)
    assert json.loads((release / "run_config.json").read_text())["base_model_id"] == hub_id
    assert base_model_ref(replace(settings, base_model_id=None), resolve_model_source(str(release))) == hub_id


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("config.json", "is not a complete release: config.json missing; rebuild it with `featcal export RUN_FOLDER`."),
        ("model.safetensors", "is not a complete release: model.safetensors missing"),
        ("preprocessor_config.json", "is not a complete release: preprocessor_config.json missing"),
        ("README.md", "is not a complete release: README.md missing"),
        ("metrics.json", "is not a complete release: metrics.json missing"),
        ("run_config.json", "is not a complete release: run_config.json missing"),
        ("release_manifest.json", "is not a complete release: release_manifest.json missing"),
        ("edited README.md", "README.md differs from what `featcal export` wrote"),
        ("extra notes.txt", "holds notes.txt, which `featcal export` did not write"),
    ],
)
@pytest.mark.parametrize("given", ["release", "run"])
def test_a_damaged_release_is_refused_before_it_is_served(
    exported, tmp_path, capsys, monkeypatch, damage, message, given
):
    import shutil

    run = Path(shutil.copytree(exported[0], tmp_path / "run"))
    release = run / "release"
    if damage.startswith("edited "):
        with (release / damage.split()[1]).open("a") as edited:
            edited.write("An edit after export.\n")
    elif damage.startswith("extra "):
        (release / damage.split()[1]).write_text("mine\n")
    else:
        (release / damage).unlink()
    line = _space_error(capsys, monkeypatch, "--model", str(run if given == "run" else release))
    assert message in line, line
    assert "no calibrated model" not in line


def _bare_space():
    """A Space of one line of text and no model: what launching needs."""
    from types import SimpleNamespace

    import gradio as gr

    from featcal.space.ui import Space

    with gr.Blocks() as demo:
        gr.Markdown("A bare page.")
    return Space(demo, SimpleNamespace(settings=SpaceSettings()), [])


@pytest.mark.parametrize("taken_on", ["127.0.0.1", "127.0.0.2"])
def test_a_port_taken_after_the_check_is_one_serve_error(capfd, taken_on):
    """Gradio finds the port taken itself (127.0.0.1), or uvicorn does when it binds (127.0.0.2, which Gradio's
    own check on 127.0.0.1 misses): either way one ServeError, and uvicorn's log line is not printed."""
    import socket

    from featcal.errors import ServeError

    space = _bare_space()
    with socket.socket() as taken:
        taken.bind((taken_on, 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(ServeError) as refused:
                space.launch(host=taken_on, port=port, prevent_thread_lock=True)
        finally:
            space.close()
    assert isinstance(refused.value, OSError) and (refused.value.host, refused.value.port) == (taken_on, port)
    assert str(refused.value).startswith(f"Cannot serve on {taken_on} port {port}: the port is in use")
    assert "choose a free `port`, or stop what holds it." in str(refused.value)
    assert "attempting to bind" not in capfd.readouterr().err


def test_settings_from_space_config_and_environment(tmp_path):
    (tmp_path / "space_config.json").write_text(
        json.dumps({"model_id": "me/model", "tasks_file": "tasks.json", "max_file_mb": 5})
    )
    settings = SpaceSettings.from_app_dir(tmp_path, environ={})
    assert (settings.model_id, settings.max_file_mb, settings.base_model_id) == ("me/model", 5, None)
    assert settings.path(settings.tasks_file) == tmp_path.resolve() / "tasks.json"
    settings = SpaceSettings.from_app_dir(tmp_path, environ={"MODEL_ID": "you/other", "BASE_MODEL_ID": "b/c"})
    assert (settings.model_id, settings.base_model_id) == ("you/other", "b/c")
    (tmp_path / "space_config.json").write_text(json.dumps({"modle_id": "typo"}))
    with pytest.raises(FeatcalError, match="keys among"):
        SpaceSettings.from_app_dir(tmp_path, environ={})


def test_mismatched_base_is_refused(settings, tmp_path):
    from tests.support.builders import save_base

    save_base(tmp_path / "other-base")  # hidden size 32, the fixture's model has 64
    with pytest.raises(FeatcalError, match="does not fit the base"):
        create_space(replace(settings, base_model_id=str(tmp_path / "other-base")), progress=False)


def test_class_embeddings_are_cached_on_disk(settings, tmp_path, monkeypatch, device):
    cached = replace(settings, device=device, heads_cache=str(tmp_path / "heads"))
    first = SpaceModel(cached, progress=False)
    assert len(list((tmp_path / "heads").glob("t*-*.safetensors"))) == 3

    def no_text_tower(self, task):
        raise AssertionError(f"recomputed the head of {task.name}")

    monkeypatch.setattr(ZeroShotClassifier, "head", no_text_tower)
    second = SpaceModel(cached, progress=False)
    for name, head in first.heads.items():
        torch.testing.assert_close(second.heads[name], head, rtol=0, atol=0)
    # Other templates make another key: that task is computed again.
    table = json.loads((FIXTURE / "tasks.json").read_text())
    table["tasks"]["t2"]["templates"] = ["a blurry photo of a {}."]
    for entry in table["tasks"].values():
        entry["dataset"]["path"] = str(FIXTURE / entry["dataset"]["path"])
    (tmp_path / "tasks.json").write_text(json.dumps(table))
    with pytest.raises(AssertionError, match="recomputed the head of t2"):
        SpaceModel(replace(cached, tasks_file=str(tmp_path / "tasks.json")), progress=False)


def test_the_space_model_runs_on_each_device(settings, device):
    import dataclasses

    import torch

    from featcal.space.model import SpaceModel

    task = task_table(FIXTURE / "tasks.json", replace=True).tasks["t2"]
    image = load_task_split(task, "test")[0]["image"]
    on_device = SpaceModel(dataclasses.replace(settings, device=device), progress=False)
    on_cpu = SpaceModel(settings, progress=False)
    assert next(on_device.vision.parameters()).device.type == device
    for name, probs in on_cpu.probabilities(image, ["t0", "t2"]).items():
        torch.testing.assert_close(on_device.probabilities(image, ["t0", "t2"])[name], probs, rtol=1e-4, atol=1e-5)


def test_close_removes_the_temporary_example_folder(settings):
    """Examples taken from the test splits live in a temporary folder that closing the Space removes."""
    space = create_space(settings, progress=False)
    scratch = space.scratch
    assert scratch is not None and sorted(p.name for p in scratch.iterdir()) == ["t0.png", "t1.png", "t2.png"]
    space.close()
    assert not scratch.exists()
