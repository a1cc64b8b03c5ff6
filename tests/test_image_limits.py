"""Images bounded before they cost anything (wde/components/image_limits.py, image_decode.py; docs/images.md "Limits
and errors"): strips of pixels and decompression bombs refused from their header with the limit named, memory
bounded even where a raised limit lets a strip through, formats outside the allow-list refused by name without
their parser running, a request's images within a pixel budget, and a call's images decoded off the engine loop so
other clients (and /health) are served while they decode."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.test_server import serve
from tests.tiny_clip import CAPTIONS, encoded, image_of_mode
from wde import Engine, PoolingParams, RequestError
from wde.async_engine import AsyncEngine
from wde.components.image_input import BAD_IMAGE, TOO_LARGE
from wde.errors import ModelLoadError
from wde.request import ImagePrompt, Request

MB = 2 ** 20


def strip(width: int, height: int) -> bytes:
    """A one-colour PNG of width x height: 125-300 bytes for a 1 x 100,000 strip."""
    data = encoded(Image.new("L", (width, height), 200), optimize=True)
    assert len(data) < 400 or width * height > 10 ** 6
    return data


def peak_rss_growth(work: Callable[[], Any]) -> tuple[Any, int]:
    """(work's result, how far this process's peak resident memory rose above its resident memory before, in
    bytes): the peak is reset first (/proc/self/clear_refs), so the growth is `work`'s own."""
    def hwm() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * 4096
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = work()
    return result, hwm() - before


def uri(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def fits() -> bytes:
    """A FITS file (the astronomy format Pillow reads): 80-column header cards, then 16-bit data."""
    cards = ["SIMPLE  =                    T", "BITPIX  =                   16", "NAXIS   =                    2",
             "NAXIS1  =                  256", "NAXIS2  =                  256", "END"]
    header = "".join(c.ljust(80) for c in cards).ljust(2880).encode()
    return header + bytes(256 * 256 * 2)


def eps() -> bytes:
    """An EPS file as Pillow writes one (decoding it would start Ghostscript)."""
    return encoded(image_of_mode("RGB", 16, 12), "EPS")


# -- strips, bombs, and the memory of resizing ---------------------------------------------------------------------

@pytest.mark.parametrize("size", [(1, 10_000), (10_000, 1), (1, 100_000)])
def test_strips_are_refused_by_the_aspect_limit_from_their_header(clip: Engine, size: tuple[int, int]) -> None:
    data = strip(*size)
    with pytest.raises(RequestError) as info:
        clip.encode(["a caption", data])
    message = str(info.value)
    ratio = max(size) // min(size)
    assert message.startswith("input[1]: input is") and f"aspect ratio of {ratio}:1; the limit is 200:1" in message
    assert "input_processor.params.max_image_aspect_ratio" in message and info.value.kind == TOO_LARGE
    assert not clip.has_unfinished()


def test_a_strip_let_through_costs_only_its_crop_at_clip_real_size(clip_path: Path) -> None:
    """With the aspect limit raised, a 1 x 100,000 strip still costs little: only what the center crop keeps is
    resized (transformers' order, the whole strip first, would make 224 x 22,400,000 pixels: 15 GB)."""
    params = {"params": {"max_image_aspect_ratio": 1e6}}
    with Engine.from_workflow("clip", clip_path, input_processor=params) as engine:
        real = dataclasses.replace(engine.input_processor.preprocessor, size=(("shortest_edge", 224),),
                                   crop_size=(224, 224))
        for size in [(1, 2_000), (1, 100_000), (100_000, 1)]:  # resized whole, 1 x 2,000 alone would take 955 MB
            image = Image.open(io.BytesIO(strip(*size)))
            pixels, growth = peak_rss_growth(lambda: real(image))
            assert pixels.shape == (3, 224, 224) and np.isfinite(pixels).all()
            assert growth < 200 * MB, f"{size}: {growth / MB:.0f} MB"
        vector, growth = peak_rss_growth(lambda: engine.embed(strip(1, 100_000)))
        assert vector.shape == (24,) and np.isfinite(vector).all() and growth < 200 * MB


def test_elongated_images_within_the_limit_match_transformers(clip: Engine) -> None:
    """Images within 16:1 (all the parity tests' images) are resized whole, bit for bit as transformers does;
    more elongated ones, resized only where the crop keeps them, within a few intensity levels."""
    from transformers import AutoImageProcessor

    ref = AutoImageProcessor.from_pretrained(clip.source.path, backend="pil")
    pre = clip.input_processor.preprocessor
    levels = np.array(ref.image_std, dtype=np.float32)[:, None, None] * 255
    for (w, h), exact in [((480, 30), True), ((30, 480), True), ((700, 20), False), ((20, 700), False),
                          ((7, 1000), False), ((1000, 7), False)]:
        assert (pre.kept_region(*pre.resized_size(h, w)) is None) == exact
        image = image_of_mode("RGB", w, h, seed=w)
        diff = np.abs(pre(image) - ref(images=[image], return_tensors="np").pixel_values[0]) * levels
        assert diff.max() <= (1e-4 if exact else 8), ((w, h), diff.max())


def test_the_pixel_limit_default_and_option(clip_path: Path) -> None:
    bomb = strip(8000, 5000)  # 40 MP, 1.6:1, 50 kB
    params = {"params": {"max_image_pixels": 1000}}
    with Engine.from_workflow("clip", clip_path, input_processor=params) as small:
        with pytest.raises(RequestError, match=r"is 40x40 = 1600 pixels; the limit is 1000 \(input_processor"):
            small.make_request(strip(40, 40))
    with Engine.from_workflow("clip", clip_path) as engine:
        (_, growth) = peak_rss_growth(lambda: pytest.raises(RequestError, engine.make_request, bomb))
        with pytest.raises(RequestError, match="40000000 pixels; the limit is 33554432") as info:
            engine.make_request(bomb)
        assert info.value.kind == TOO_LARGE and growth < 50 * MB


# -- formats ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,data", [("FITS", fits()), ("EPS", eps()),
                                       ("ICO", encoded(image_of_mode("RGB", 16, 16), "ICO"))])
def test_formats_outside_the_allow_list_are_refused_by_name_unparsed(clip: Engine, monkeypatch: pytest.MonkeyPatch,
                                                                     name: str, data: bytes) -> None:
    from PIL import EpsImagePlugin, FitsImagePlugin, IcoImagePlugin

    for plugin in (FitsImagePlugin.FitsImageFile, EpsImagePlugin.EpsImageFile, IcoImagePlugin.IcoImageFile):
        monkeypatch.setattr(plugin, "_open", lambda self: pytest.fail("a refused format's parser ran"))
    with pytest.raises(RequestError) as info:
        clip.encode([data])
    message = str(info.value)
    assert f"input is in the {name} format, which this server does not decode" in message, message
    assert "PNG, JPEG, WEBP, GIF, BMP, TIFF" in message and info.value.kind == BAD_IMAGE


def test_allowed_formats_decode_and_a_gif_gives_its_first_frame(clip: Engine, clip_path: Path) -> None:
    picture = image_of_mode("RGB", 41, 29, seed=5)
    want = clip.embed(encoded(picture))
    for fmt in ("BMP", "TIFF", "WEBP"):
        kwargs = {"lossless": True} if fmt == "WEBP" else {}
        assert np.array_equal(clip.embed(encoded(picture, fmt, **kwargs)), want), fmt
    first = picture.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    second = image_of_mode("RGB", 41, 29, seed=6).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    gif = encoded(first, "GIF", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    assert np.array_equal(clip.embed(gif), clip.embed(encoded(first.convert("RGB"))))
    assert clip.embed(encoded(picture, "JPEG")).shape == (24,)
    with Engine.from_workflow("clip", clip_path, input_processor={"params": {"image_formats": ["png"]}}) as only_png:
        with pytest.raises(RequestError, match=r"is in the JPEG format, which this server does not decode \(it decodes"
                                               r" PNG: input_processor.params.image_formats\)"):
            only_png.make_request(encoded(picture, "JPEG"))
    with pytest.raises(ModelLoadError, match="Pillow cannot open NOPE"):
        Engine.from_workflow("clip", clip_path, input_processor={"params": {"image_formats": ["PNG", "nope"]}})


# -- a request's images ------------------------------------------------------------------------------------------------

def test_a_request_over_its_pixel_budget_is_refused_before_decoding(clip_path: Path) -> None:
    params = {"params": {"max_request_image_pixels": 3000}}
    images = [encoded(image_of_mode("RGB", 40, 30, seed=i)) for i in range(3)]  # 1,200 pixels each

    async def main(engine: AsyncEngine) -> None:
        with pytest.raises(RequestError) as info:
            await engine.encode([images[0], CAPTIONS[0], images[1], images[2]], PoolingParams())
        assert str(info.value).startswith("input[3]: the images of this request add up to 3600 pixels with this one;"
                                          " the limit per request is 3000 (input_processor.params.max_request_image")
        assert info.value.kind == TOO_LARGE and info.value.field == "input[3]"
        outs = await engine.encode(images[:2] + [CAPTIONS[0]], PoolingParams())
        assert all(o.ok for o in outs)

    run_async(clip_path, main, input_processor=params)


def run_async(folder: Path, main: Callable[[AsyncEngine], Any], **overrides: Any) -> AsyncEngine:
    with Engine.from_workflow("clip", folder, **overrides) as engine:
        served = AsyncEngine(engine)
        served.start()
        try:
            asyncio.run(main(served))
        finally:
            served.stop()
    return served


class Gate:
    """Holds every image decode of an engine's request processor until opened, recording where each ran."""

    def __init__(self, engine: Engine) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        rp = engine.components["request_processor"]
        preprocess = rp._preprocess

        def gated(prompt: ImagePrompt, field: str = "input") -> Any:
            if not isinstance(prompt.data, np.ndarray):  # a decode, not the check of finished pixels
                self.threads.append(threading.current_thread().name)
                self.entered.set()
                assert self.open.wait(120), "the gate was never opened"
            return preprocess(prompt, field)

        rp._preprocess = gated


def test_a_call_of_many_images_decodes_off_the_engine_loop(clip_path: Path, clip: Engine) -> None:
    """While a call's images are decoding (held there by a gate), another client's texts are embedded and the
    engine loop keeps beating; the scheduler only ever receives finished pixel values."""
    images = [encoded(image_of_mode("RGB", 200 + i, 150, seed=i)) for i in range(12)]
    want = clip.embed(images)

    async def main(engine: AsyncEngine) -> None:
        gate = Gate(engine.engine)
        queued: list[Request] = []
        add = engine.engine.scheduler.add
        engine.engine.scheduler.add = lambda r: (queued.append(r), add(r))  # type: ignore[method-assign]
        busy = asyncio.ensure_future(engine.encode(images, PoolingParams()))
        try:
            assert await asyncio.to_thread(gate.entered.wait, 120)
            text = await asyncio.wait_for(engine.encode(CAPTIONS, PoolingParams()), 120)  # answered meanwhile
            assert all(o.ok for o in text) and not busy.done()
            assert engine.seconds_since_step < 60 and engine.healthy
        finally:
            gate.open.set()
        outs = await busy
        got = np.stack([o.outputs["dense"] for o in outs])
        assert np.abs(got - want).max() <= 1e-6
        assert gate.threads and not any(t.startswith("wde-engine-loop") for t in gate.threads), gate.threads
        images_queued = [r for r in queued if isinstance(r.prompt, ImagePrompt)]
        assert len(images_queued) == 12 and all(isinstance(r.prompt.data, np.ndarray) for r in images_queued)

    run_async(clip_path, main)


def test_a_truncated_image_fails_alone_when_decoded_before_the_engine(clip_path: Path) -> None:
    good = encoded(image_of_mode("RGB", 40, 30))

    async def main(engine: AsyncEngine) -> None:
        outs = await engine.encode([good, encoded(image_of_mode("RGB", 64, 64))[:400], CAPTIONS[0]], PoolingParams())
        assert outs[0].ok and outs[2].ok and not outs[1].ok
        assert outs[1].error.kind == BAD_IMAGE and "truncated or corrupt" in str(outs[1].error)

    run_async(clip_path, main)


# -- over HTTP ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(clip_path: Path) -> Iterator[tuple[str, Engine]]:
    overrides = ["input_processor.params.max_request_image_pixels=100000"]
    with Engine.from_workflow(None, clip_path, overrides=overrides) as engine, \
            serve(engine, stall_timeout=2.0) as (base, _):
        yield base, engine


@pytest.mark.parametrize("body,status,needle,param", [
    ([uri(strip(1, 10_000))], 413, "aspect ratio of 10000:1; the limit is 200:1", "input"),
    ([uri(strip(1, 100_000))], 413, "aspect ratio of 100000:1", "input"),
    ([uri(encoded(image_of_mode("RGB", 8, 8))), uri(fits())], 400, "is in the FITS format", "input[1]"),
    ([uri(eps())], 400, "is in the EPS format", "input"),
    ([uri(strip(200, 200)), uri(strip(200, 200)), uri(strip(200, 200))], 413,
     "add up to 120000 pixels with this one; the limit per request is 100000", "input[2]"),
])
def test_limits_over_http_are_4xx_naming_the_input_and_the_limit(served: tuple[str, Engine], body: list[str],
                                                                  status: int, needle: str, param: str) -> None:
    base, _ = served
    r = httpx.post(f"{base}/embeddings", json={"input": body if len(body) > 1 else body[0], "modality": "image"},
                   timeout=120)
    assert r.status_code == status and needle in r.text, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(f"{base}/health", timeout=60).status_code == 200


def test_health_and_texts_are_answered_while_a_request_of_images_decodes(served: tuple[str, Engine]) -> None:
    """One process: a request of many images is held while decoding; /health (whose stall limit here is 2 s) and a
    text request are answered meanwhile, after more than the stall limit has passed."""
    base, engine = served
    gate = Gate(engine)
    images = [uri(encoded(image_of_mode("RGB", 60 + i, 50, seed=i))) for i in range(16)]
    with httpx.Client(base_url=base, timeout=120) as client:
        holder: list[httpx.Response] = []
        busy = threading.Thread(target=lambda: holder.append(
            client.post("/embeddings", json={"input": images, "modality": "image"})))
        busy.start()
        try:
            assert gate.entered.wait(120)
            assert not gate.open.wait(3.0)  # longer than the stall limit: a loop stuck decoding would be a 503
            assert client.get("/health").status_code == 200
            text = client.post("/v1/embeddings", json={"input": CAPTIONS})
            assert text.status_code == 200 and len(text.json()["data"]) == 3
            assert busy.is_alive()
        finally:
            gate.open.set()
            busy.join(120)
    assert holder and holder[0].status_code == 200 and len(holder[0].json()["data"]) == 16


def test_serve_options_are_the_input_processor_params() -> None:
    from click.testing import CliRunner

    from wde.cli import image_limit_overrides, main

    assert image_limit_overrides(max_image_pixels=1000, max_image_aspect_ratio=None, max_request_image_pixels=5) == [
        "input_processor.params.max_image_pixels=1000", "input_processor.params.max_request_image_pixels=5"]
    for option, value in [("--max-image-aspect-ratio", "0.5"), ("--max-image-pixels", "0"),
                          ("--max-request-image-pixels", "-3")]:
        result = CliRunner().invoke(main, ["serve", option, value])  # refused before anything loads
        assert result.exit_code == 1 and f"Error: {option} must be " in result.output, result.output
