"""Images with the engine core in its own process (`wde serve --api-servers N`): the API server decodes and
preprocesses them and sends raw float32 pixel values; the core checks them against its model and runs them.

The core runs here on a thread of the test process (`EngineCore.run`, as `wde serve`'s core process runs it) behind
an ipc socket, and each test talks to it through a `CoreClient` on its own event loop, as an API server does; the
answers are compared with a one-process `Engine` built from the same tiny CLIP folder (tests/tiny_clip.py). The
last test goes through HTTP: `wde serve --api-servers 2` in a subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from PIL import Image

from tests.test_server import serve_split
from tests.tiny_clip import CAPTIONS, encoded, image_of_mode
from wde import Engine, PoolingParams, RequestError
from wde.components.image_input import BAD_IMAGE
from wde.core import wire
from wde.core.client import CoreClient
from wde.core.engine_core import EngineCore, socket
from wde.core.frontend import Frontend, core_image_request
from wde.engine import resolve
from wde.engine_info import EngineInfo
from wde.request import ImagePrompt, Request, RequestOutput, TokensPrompt

T = TypeVar("T")
SIZE = 30
"""The tiny CLIP's image size (6 px patches: 25 patches and a class token)."""
TOKENS = (SIZE // 6) ** 2 + 1


class Core:
    """An engine core serving on a thread, recording every request its scheduler receives."""

    def __init__(self, folder: Path, address: str) -> None:
        self.address = address
        self.engine = Engine.from_workflow(None, folder)
        self.received: list[Request] = []
        add = self.engine.scheduler.add

        def recording(request: Request) -> None:
            self.received.append(request)
            add(request)

        self.engine.scheduler.add = recording  # type: ignore[method-assign]
        self.core = EngineCore(self.engine, address)
        self.thread = threading.Thread(target=self.core.run, name="test-engine-core", daemon=True)
        self.thread.start()
        workflow, source = resolve(None, folder)
        self.frontend = Frontend(workflow, source, EngineInfo.of(self.engine))

    def close(self) -> None:
        self.core.stopping = True
        self.thread.join(30)
        self.engine.close()


@pytest.fixture(scope="module")
def core(clip_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Core]:
    served = Core(clip_path, f"ipc://{tmp_path_factory.mktemp('core')}/core.sock")
    yield served
    served.close()
    assert not served.thread.is_alive()


def with_client(core: Core, work: Callable[[CoreClient], Awaitable[T]]) -> T:
    """Run `work` against the core through a fresh `CoreClient` on a fresh event loop (an API server)."""
    async def main() -> T:
        client = CoreClient(core.frontend, core.address, tag="t.")
        client.start()
        try:
            return await work(client)
        finally:
            client.stop()

    return asyncio.run(main())


def encode(core: Core, inputs: list[Any], params: PoolingParams = PoolingParams()) -> list[RequestOutput]:
    async def call(client: CoreClient) -> list[RequestOutput]:
        return await client.encode(inputs, params)

    return with_client(core, call)


def vectors(outputs: list[RequestOutput]) -> np.ndarray:
    assert all(o.ok for o in outputs), [o.error for o in outputs if not o.ok]
    return np.stack([o.outputs["dense"] for o in outputs])


def one_process(engine: Engine, inputs: list[Any], params: PoolingParams = PoolingParams()) -> np.ndarray:
    return vectors(engine.encode(inputs, params))


def png(i: int, mode: str = "RGB") -> bytes:
    """A PNG of an odd size, different for each `i`."""
    return encoded(image_of_mode(mode, 23 + i % 17, 41 - i % 13, seed=i))


def test_wire_carries_pixel_arrays_of_any_shape_as_raw_bytes_and_texts_as_before() -> None:
    rng = np.random.default_rng(0)
    shapes = [(3, 224, 224), (3, SIZE, SIZE), (16, 24, 3 * 16 * 16), (5,), ()]  # CLIP 224, tiny, NaFlex patches
    images = [wire.AdmittedImage(f"i{k}", rng.standard_normal(s).astype(np.float32), k + 1,
                                 PoolingParams(normalize=False)) for k, s in enumerate(shapes)]
    payload = wire.encoder.encode(wire.SubmitImages(images))
    assert len(payload) < 3 * 224 * 224 * 4 + 200 + sum(i.pixel_values.nbytes + 200 for i in images[1:])
    back = wire.to_core.decode(payload)
    assert isinstance(back, wire.SubmitImages)
    for sent, got in zip(images, back.requests):
        assert got.pixel_values.dtype == np.float32 and got.pixel_values.shape == sent.pixel_values.shape
        assert np.array_equal(got.pixel_values, sent.pixel_values)  # bit for bit
        assert (got.request_id, got.image_tokens, got.params) == (sent.request_id, sent.image_tokens, sent.params)
    assert not back.requests[0].pixel_values.flags.owndata  # read in place from the message, not copied

    strided = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::2, ::3]  # not contiguous
    got = wire.to_core.decode(wire.encoder.encode(wire.SubmitImages([wire.AdmittedImage("s", strided, 1,
                                                                                        PoolingParams())])))
    assert np.array_equal(got.requests[0].pixel_values, strided)

    # a text's bytes are what they were before images: a 4-element array, no image field
    params = PoolingParams(dimensions=8)
    text = wire.Submit([wire.Admitted("a", [101, 7, 102], None, params)])
    expected = msgspec.msgpack.encode(["Submit", [["a", [101, 7, 102], None, dataclasses.asdict(params)]]])
    assert wire.encoder.encode(text) == expected

    # the field is an array, nothing else (a float list would be a bug on the API server's side)
    floats = msgspec.msgpack.encode(["SubmitImages", [["x", [0.5] * 4, 1, dataclasses.asdict(params)]]])
    with pytest.raises(msgspec.ValidationError, match="numpy array"):
        wire.to_core.decode(floats)


def test_images_texts_and_mixed_lists_equal_one_process(core: Core, clip: Engine) -> None:
    images = [png(0), png(1, "RGBA"), png(2, "L"), png(3, "P")]
    uri = "data:image/png;base64," + base64.b64encode(png(4)).decode()
    wrapped = {"image": base64.b64encode(png(5)).decode()}
    mixed = [CAPTIONS[0], images[0], uri, CAPTIONS[1], wrapped, images[3], CAPTIONS[2]]
    threads: list[tuple[bool, int]] = []
    tokenize = core.frontend.tokenize

    def recording(requests: list[Request]) -> Any:
        threads.append((core.frontend.holds_images(requests), threading.get_ident()))
        return tokenize(requests)

    core.frontend.tokenize = recording  # type: ignore[method-assign]
    loop_thread = threading.get_ident()  # asyncio.run runs the event loop on this thread
    core.received.clear()
    try:
        for inputs in (images, list(CAPTIONS), mixed):
            for params in (PoolingParams(), PoolingParams(normalize=False, dimensions=16)):
                outputs = encode(core, inputs, params)
                got, want = vectors(outputs), one_process(clip, inputs, params)
                assert got.shape == want.shape and np.abs(got - want).max() <= 1e-6
                reference = clip.encode(inputs, params)
                assert [o.num_prompt_tokens for o in outputs] == [o.num_prompt_tokens for o in reference]
                assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in reference]
    finally:
        core.frontend.tokenize = tokenize  # type: ignore[method-assign]

    # images were decoded in the API server, off its event loop; texts alone are tokenized inline as before
    assert threads and all((ident != loop_thread) == held for held, ident in threads)
    # the core received token ids and finished float32 pixels, never an encoded image
    prompts = [r.prompt for r in core.received]
    assert len(prompts) == 2 * (len(images) + len(CAPTIONS) + len(mixed))
    pixels = [p for p in prompts if isinstance(p, ImagePrompt)]
    assert len(pixels) == 2 * (len(images) + 4)  # the mixed list holds 4 images
    assert all(isinstance(p, (TokensPrompt, ImagePrompt)) for p in prompts)
    for p in pixels:
        assert isinstance(p.data, np.ndarray) and p.data.dtype == np.float32 and p.data.shape == (3, SIZE, SIZE)
        assert p.num_tokens == TOKENS


def test_a_truncated_image_fails_alone_with_bad_image(core: Core, clip: Engine) -> None:
    truncated = png(7)[:400]  # its header is intact: admitted, refused when decoded
    inputs = [CAPTIONS[0], png(8), truncated, png(9), CAPTIONS[1]]
    outputs = encode(core, inputs)
    failed = outputs[2]
    assert failed.error is not None and failed.error.kind == BAD_IMAGE and failed.error.field == "input"
    assert "truncated or corrupt" in str(failed.error)
    good = [0, 1, 3, 4]
    got = vectors([outputs[i] for i in good])
    assert np.abs(got - one_process(clip, [inputs[i] for i in good])).max() <= 1e-6
    assert np.abs(vectors(encode(core, [png(8)])) - one_process(clip, [png(8)])).max() <= 1e-6  # serving on


def _submit_raw(address: str, images: list[wire.AdmittedImage]) -> dict[str, wire.Output]:
    """Send `SubmitImages` over a bare socket, as an API server would, and collect one output per image."""
    sock = socket(address, zmq.DEALER, bind=False, context=zmq.Context.instance())
    try:
        sock.send(wire.encoder.encode(wire.SubmitImages(images)))
        answers: dict[str, wire.Output] = {}
        while len(answers) < len(images):
            assert sock.poll(60_000), f"no answer from the core for {set(i.request_id for i in images) - set(answers)}"
            results = wire.from_core.decode(sock.recv())
            assert results.failure is None
            answers.update((o.request_id, o) for o in results.outputs)
        return answers
    finally:
        sock.close(0)


def test_the_core_refuses_pixel_values_that_do_not_fit_its_model(core: Core, clip: Engine, tiny_bert: Path) -> None:
    pixels = clip.input_processor.preprocess(clip.input_processor.image_prompt(png(10), "input"))
    assert pixels.shape == (3, SIZE, SIZE)
    wrong = {
        "small": np.zeros((3, 8, 8), np.float32),
        "float64": pixels.astype(np.float64),
        "patches": np.zeros((5, 5, 3 * 6 * 6), np.float32),  # a NaFlex layout: not what CLIP takes
        "flat": pixels.reshape(-1),
    }
    sent = [wire.AdmittedImage(name, array, TOKENS, PoolingParams()) for name, array in wrong.items()]
    sent.append(wire.AdmittedImage("fits", pixels, TOKENS, PoolingParams()))
    answers = _submit_raw(core.address, sent)
    for name in wrong:
        message, field, kind = answers[name].error  # type: ignore[misc]
        assert (field, kind) == ("input", BAD_IMAGE), answers[name]
        assert message.startswith("input: ") and f"(3, {SIZE}, {SIZE})" in message and "float32" in message
    fits = answers["fits"]
    assert fits.error is None and fits.num_prompt_tokens == TOKENS
    assert np.abs(fits.outputs["dense"] - one_process(clip, [png(10)])[0]).max() <= 1e-6
    assert core.thread.is_alive()

    # a core whose workflow takes no images refuses them by name rather than reading them as something else
    with Engine.from_workflow("bert", tiny_bert, pooler={"params": {"pooling": "mean"}}) as text_engine:
        with pytest.raises(RequestError, match="takes texts only") as info:
            core_image_request("x", pixels, TOKENS, PoolingParams(), text_engine.input_processor)
        assert (info.value.field, info.value.kind) == ("input", BAD_IMAGE)


def test_many_images_in_one_call_and_in_concurrent_calls(core: Core, clip: Engine) -> None:
    images = [png(100 + i, ("RGB", "L", "RGBA")[i % 3]) for i in range(300)]  # more than a batch holds
    want = one_process(clip, images)
    assert np.abs(vectors(encode(core, images)) - want).max() <= 1e-6

    async def concurrently(client: CoreClient) -> list[list[RequestOutput]]:
        calls = [client.encode(images[i:i + 60], PoolingParams()) for i in range(0, 300, 60)]
        calls += [client.encode([image], PoolingParams()) for image in images[:20]]
        return await asyncio.gather(*calls)

    answers = with_client(core, concurrently)
    got = np.concatenate([vectors(a) for a in answers[:5]])
    assert np.abs(got - want).max() <= 1e-6
    assert np.abs(np.concatenate([vectors(a) for a in answers[5:]]) - want[:20]).max() <= 1e-6


def test_images_over_http_through_two_api_servers(clip_path: Path, clip: Engine) -> None:
    """`wde serve --api-servers 2`: OpenAI-style `messages`, Infinity's `modality: "image"` and Cohere's `images`
    give one-process vectors; a truncated image is a 400 naming it, and the server answers on. The image limits
    given as options hold in the API servers: a request's pixel budget and the aspect ratio, 413 naming the input."""
    pictures = [png(200), png(201, "RGBA"), png(202, "P")]
    uris = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pictures]
    truncated = "data:image/png;base64," + base64.b64encode(png(203)[:400]).decode()
    want = one_process(clip, pictures)

    def dense(r: httpx.Response) -> np.ndarray:
        assert r.status_code == 200, r.text
        body = r.json()
        rows = body["data"] if "data" in body else body["embeddings"]["float"]
        return np.array([row["embedding"] for row in rows] if "data" in body else rows, dtype=np.float32)

    assert sum(Image.open(io.BytesIO(p)).width * Image.open(io.BytesIO(p)).height for p in pictures) <= 4000
    limits = ("--max-request-image-pixels", "4000", "--max-image-aspect-ratio", "100")
    with serve_split(clip_path, 2, *limits) as (url, _):
        message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[0]}}]}]
        r = httpx.post(f"{url}/v1/embeddings", json={"messages": message}, timeout=60)
        assert np.abs(dense(r) - want[:1]).max() <= 1e-6
        assert r.json()["usage"]["prompt_tokens"] == TOKENS

        async def many() -> list[httpx.Response]:  # concurrent calls: both API servers take some
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(f"{url}/embeddings", json={"input": uris,
                                                                                     "modality": "image"})
                                              for _ in range(8)))

        for r in asyncio.run(many()):
            assert np.abs(dense(r) - want).max() <= 1e-6

        bad = httpx.post(f"{url}/v2/embed", json={"images": [uris[1], truncated]}, timeout=60)
        error = bad.json()["error"] if "error" in bad.json() else bad.json()
        assert bad.status_code == 400 and "images[1]" in str(error) and "truncated or corrupt" in str(error), bad.text
        r = httpx.post(f"{url}/v2/embed", json={"images": uris[1:], "embedding_types": ["float"]}, timeout=60)
        assert np.abs(dense(r) - want[1:]).max() <= 1e-6
        over = httpx.post(f"{url}/embeddings", json={"input": uris + uris[:1], "modality": "image"}, timeout=60)
        assert over.status_code == 413 and over.json()["error"]["param"] == "input[3]", over.text
        assert "the limit per request is 4000 (input_processor.params.max_request_image_pixels)" in over.text
        strip = "data:image/png;base64," + base64.b64encode(encoded(image_of_mode("L", 1, 150))).decode()
        long = httpx.post(f"{url}/embeddings", json={"input": [strip], "modality": "image"}, timeout=60)
        assert long.status_code == 413 and "aspect ratio of 150:1; the limit is 100:1" in long.text, long.text
