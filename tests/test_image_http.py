"""Image inputs over HTTP (one process): vLLM's chat-style `messages` on /v1/embeddings, Cohere's /v2/embed `images`
and image_url content, Infinity's `modality: "image"`; through the openai, cohere and infinity clients too. Each
vector equals `Engine.embed` of the same image and transformers' normalized `get_image_features`. Hostile images
are refused with their status and the field named, and the server answers the next request right; URLs are
fetched only from `--allow-image-fetch` hosts (a local HTTP server stands in for the web)."""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.test_hostile_inputs import H, fill
from tests.test_server import serve
from tests.tiny_clip import CAPTIONS, encoded, gradient, scene
from wde import Engine
from wde.server import ServerConfig
from wde.server.config import default_payload_limit

MAX_IMAGE_BYTES = 60_000
"""The served engines' byte limit (input_processor.params.max_image_bytes), small so over-limit images are cheap."""
LIMIT = [f"input_processor.params.max_image_bytes={MAX_IMAGE_BYTES}"]
MODEL = "tiny-clip"


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


PICTURES = [encoded(scene(k)) for k in range(3)]
PNG, JPEG = PICTURES[0], encoded(Image.fromarray(gradient(45, 31, seed=3)), "JPEG")
GOOD = data_uri(PNG)


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


# -- servers ---------------------------------------------------------------------------------------------------------

class ImageSite:
    """A local web server standing in for an image host: it records every request it gets (path and Host header),
    so a test can tell that a refused URL never caused a connection."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.release = threading.Event()
        """Set at the end: the slow route holds its connection open until then."""
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                site.requests.append((self.path, self.headers.get("host", "")))
                route = site.routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404)
                    return
                route(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.routes: dict[str, Callable[[BaseHTTPRequestHandler], None]] = {
            "/cat.png": lambda h: self._send(h, PNG),
            "/photo.jpg": lambda h: self._send(h, JPEG, "image/jpeg"),
            "/big.png": lambda h: self._send(h, b"\x89PNG" + b"\0" * MAX_IMAGE_BYTES),
            "/big-unsized.png": lambda h: self._send(h, b"\x89PNG" + b"\0" * MAX_IMAGE_BYTES, length=False),
            "/gzip.png": lambda h: self._send(h, zlib.compress(PNG), extra={"Content-Encoding": "gzip"}),
            "/to-cat": lambda h: self._redirect(h, "/cat.png"),
            "/to-other-host": lambda h: self._redirect(h, f"http://localhost:{self.port}/cat.png"),
            "/to-ftp": lambda h: self._redirect(h, "ftp://127.0.0.1/cat.png"),
            "/loop": lambda h: self._redirect(h, "/loop"),
            "/slow.png": self._slow,
        }
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, body: bytes, kind: str = "image/png", length: bool = True,
              extra: dict[str, str] | None = None) -> None:
        h.send_response(200)
        h.send_header("Content-Type", kind)
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        if length:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            h.wfile.write(body)  # HTTP/1.0 without a length: the body ends when the connection closes
        except OSError:  # the fetcher stopped reading (a refusal, a cancelled fetch): what the tests cause
            pass

    @staticmethod
    def _redirect(h: BaseHTTPRequestHandler, location: str) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _slow(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.send_header("Content-Length", str(len(PNG)))
        h.end_headers()
        h.wfile.write(PNG[:20])
        h.wfile.flush()
        self.release.wait(60)  # never sends the rest while the test runs: only the fetch timeout ends it

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def site() -> Iterator[ImageSite]:
    running = ImageSite()
    yield running
    running.close()


@pytest.fixture(scope="module")
def url(clip_path: Path) -> Iterator[str]:
    """Tiny CLIP served the default way: no image URL is fetched."""
    with Engine.from_workflow(None, clip_path, overrides=LIMIT) as engine, \
            serve(engine, served_model_name=MODEL) as (base, _):
        yield base


@pytest.fixture(scope="module")
def fetching(clip_path: Path, site: ImageSite) -> Iterator[str]:
    """Tiny CLIP fetching image URLs from 127.0.0.1 only, within 3 s (the slow route never finishes)."""
    with Engine.from_workflow(None, clip_path, overrides=LIMIT) as engine, \
            serve(engine, allow_image_fetch=("127.0.0.1",), image_fetch_timeout=3.0) as (base, _):
        yield base


@pytest.fixture(scope="module")
def text_url(tiny_bert: Path) -> Iterator[str]:
    with Engine.from_workflow("bert", tiny_bert, overrides=["pooler.params.pooling=mean"]) as engine, \
            serve(engine) as (base, _):
        yield base


@pytest.fixture(scope="module")
def reference(clip_path: Path) -> Callable[[list[bytes]], np.ndarray]:
    """transformers' normalized `get_image_features` of encoded images (PIL-backend image processor)."""
    from transformers import AutoImageProcessor, AutoModel

    model = AutoModel.from_pretrained(clip_path).eval()
    processor = AutoImageProcessor.from_pretrained(clip_path, backend="pil")

    @torch.no_grad()
    def embed(files: list[bytes]) -> np.ndarray:
        pixels = processor(images=[Image.open(io.BytesIO(f)) for f in files], return_tensors="pt").pixel_values
        out = model.get_image_features(pixel_values=pixels)
        out = getattr(out, "pooler_output", out)
        return torch.nn.functional.normalize(out, dim=-1).numpy()

    return embed


def post(base: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    body = r.json()
    if "embeddings" in body:  # Cohere
        return np.array(body["embeddings"]["float"], dtype=np.float32)
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and float(np.abs(a - b).max()) <= tol


def error(r: httpx.Response) -> tuple[str, str | None, str]:
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    return err["message"], err["param"], err["code"]


# -- the routes, against Engine.embed and transformers ---------------------------------------------------------------

def test_messages_image_and_text(url: str, clip: Engine, reference: Callable) -> None:
    image = vectors(post(url, "/v1/embeddings", {"model": MODEL, "messages": image_message(GOOD)}))
    assert close(image, clip.embed([PNG])) and close(image, reference([PNG]), 1e-4)
    jpeg = vectors(post(url, "/v1/embeddings", {"messages": image_message(data_uri(JPEG, "image/jpeg"))}))
    assert close(jpeg, clip.embed([JPEG])) and close(jpeg, reference([JPEG]), 1e-4)
    parts = {"role": "user", "content": [{"type": "text", "text": CAPTIONS[0]}]}
    plain = {"role": "user", "content": CAPTIONS[0]}
    for message in (parts, plain):
        text = vectors(post(url, "/v1/embeddings", {"messages": [message]}))
        assert close(text, clip.embed([CAPTIONS[0]]))
    # a caption that starts like a data URI is still a text where the body says text
    odd = "data:image/png;base64, is how a picture is inlined"
    assert close(vectors(post(url, "/v1/embeddings", {"messages": [{"role": "user", "content": odd}]})),
                 clip.embed([{"text": odd}]))
    b64 = post(url, "/v1/embeddings", {"messages": image_message(GOOD), "encoding_format": "base64"}).json()
    assert close(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")[None], image)
    assert b64["usage"]["prompt_tokens"] == 26  # (30 / 6)^2 patches + the class token


def test_infinity_modality_image(url: str, clip: Engine) -> None:
    uris = [data_uri(p) for p in PICTURES]
    got = vectors(post(url, "/embeddings", {"input": uris, "modality": "image"}))
    assert close(got, clip.embed(PICTURES))
    one = vectors(post(url, "/embeddings", {"input": uris[1], "modality": "image", "dimensions": 8}))
    assert close(one, clip.embed([PICTURES[1]], dimensions=8))
    text = vectors(post(url, "/embeddings", {"input": CAPTIONS, "modality": "text"}))
    assert close(text, clip.embed(CAPTIONS))


def test_cohere_images_and_inputs(url: str, clip: Engine) -> None:
    uris = [data_uri(p) for p in PICTURES]
    r = post(url, "/v2/embed", {"model": MODEL, "images": uris, "input_type": "image", "embedding_types": ["float"]})
    assert close(vectors(r), clip.embed(PICTURES))
    assert r.json()["meta"]["billed_units"]["images"] == 3 and r.json()["texts"] == []
    mixed = {"inputs": [{"content": [{"type": "image_url", "image_url": {"url": uris[2]}}]},
                        {"content": [{"type": "text", "text": CAPTIONS[1]}]},
                        {"content": [{"type": "image_url", "image_url": {"url": uris[0]}}]}]}
    r = post(url, "/v2/embed", mixed)
    assert close(vectors(r), clip.embed([PICTURES[2], CAPTIONS[1], PICTURES[0]]))
    assert r.json()["texts"] == [CAPTIONS[1]]


def test_openai_client(url: str, clip: Engine) -> None:
    import openai
    from openai.types import CreateEmbeddingResponse

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    # vLLM's documented way to send its chat-style body with the openai client
    chat = client.post("/embeddings", cast_to=CreateEmbeddingResponse,
                       body={"model": MODEL, "messages": image_message(GOOD), "encoding_format": "float"})
    assert close([chat.data[0].embedding], clip.embed([PNG]))
    # Infinity's way: images in `input`, modality in extra_body (the client asks for base64 by default)
    batch = client.embeddings.create(model=MODEL, input=[data_uri(p) for p in PICTURES],
                                     extra_body={"modality": "image"})
    assert close([d.embedding for d in batch.data], clip.embed(PICTURES))


def test_cohere_client(url: str, clip: Engine) -> None:
    import cohere
    from cohere import EmbedImageUrl, EmbedInput, ImageUrlEmbedContent, TextEmbedContent

    co = cohere.ClientV2(api_key="unused", base_url=url, timeout=60)
    uris = [data_uri(p) for p in PICTURES[:2]]
    images = co.embed(model=MODEL, images=uris, input_type="image", embedding_types=["float", "int8"])
    assert close(images.embeddings.float_, clip.embed(PICTURES[:2]))
    assert np.array(images.embeddings.int8).shape == (2, 24)
    inputs = co.embed(model=MODEL, input_type="search_document", embedding_types=["float"], inputs=[
        EmbedInput(content=[ImageUrlEmbedContent(image_url=EmbedImageUrl(url=uris[1]))]),
        EmbedInput(content=[TextEmbedContent(text=CAPTIONS[2])])])
    assert close(inputs.embeddings.float_, clip.embed([PICTURES[1], CAPTIONS[2]]))


def test_infinity_client(url: str, clip: Engine) -> None:
    from infinity_client import Client
    from infinity_client.api.default import embeddings
    from infinity_client.models import OpenAIEmbeddingInputImage

    with Client(base_url=url, raise_on_unexpected_status=True, timeout=60) as client:
        result = embeddings.sync(client=client, body=OpenAIEmbeddingInputImage(input_=[data_uri(p) for p in PICTURES]))
    assert close([d.embedding for d in result.data], clip.embed(PICTURES))


# -- what a two-tower model cannot embed, refused by name -----------------------------------------------------------

def _msg(*content: dict, role: str = "user") -> dict:
    return {"role": role, "content": list(content)}


IMG, TXT = {"type": "image_url", "image_url": {"url": GOOD}}, {"type": "text", "text": "a cat"}
COHERE_IMG = {"type": "image_url", "image_url": {"url": GOOD}}


@pytest.mark.parametrize(("path", "body", "status", "param", "needle"), [
    ("/v1/embeddings", {"messages": [_msg(IMG, TXT)]}, 422, "messages[0].content", "separately"),
    ("/v1/embeddings", {"messages": [_msg(IMG, IMG)]}, 422, "messages[0].content", "2 image_url parts"),
    ("/v1/embeddings", {"messages": [_msg(IMG), _msg(IMG)]}, 422, "messages", "2 messages"),
    ("/v1/embeddings", {"messages": [_msg(IMG, role="system")]}, 422, "messages[0].role", "'system'"),
    ("/v1/embeddings", {"messages": []}, 400, "messages", "empty"),
    ("/v1/embeddings", {"messages": [_msg()]}, 400, "messages[0].content", "empty"),
    ("/v1/embeddings", {"messages": [_msg(IMG)], "chat_template": "{{ x }}"}, 422, "chat_template", "chat template"),
    ("/v1/embeddings", {"messages": [_msg(IMG)], "input": "x"}, 422, "messages", "one of them"),
    ("/v1/embeddings", {"messages": [_msg({"type": "image_url", "image_url": {"url": GOOD, "detail": "high"}})]},
     422, "messages.0.content", "detail"),
    ("/v1/embeddings", {"messages": [_msg({"type": "input_audio", "input_audio": {}})]}, 422, "messages.0.content",
     "input_audio"),
    ("/v1/embeddings", {"input": ["fine", GOOD]}, 422, "input[1]", "carries texts"),
    ("/embed", {"inputs": GOOD}, None, None, "carries texts"),
    ("/embeddings", {"input": [GOOD], "modality": "audio"}, 424, "modality", "not audio"),
    ("/embeddings", {"input": [GOOD], "modality": "image", "prompt_name": "query"}, 422, "prompt_name", "texts"),
    ("/v1/embeddings", {"messages": [_msg(IMG)], "prompt_name": "query"}, 422, "prompt_name", "is an image"),
    ("/embeddings", {"input": [1, 2], "modality": "image"}, 422, "input", "token ids"),
    ("/v2/embed", {"inputs": [{"content": [COHERE_IMG, {"type": "text", "text": "a cat"}]}]}, 422,
     "inputs[0].content", "separately"),
    ("/v2/embed", {"texts": ["a cat"], "input_type": "image"}, 422, "input_type", "is for images"),
    ("/v2/embed", {"texts": ["a cat"], "images": [GOOD]}, 422, "images", "one of them"),
    ("/v2/embed", {"images": []}, 400, "images", "empty"),
])
def test_what_two_towers_cannot_embed(url: str, path: str, body: dict, status: int | None, param: str | None,
                                      needle: str) -> None:
    r = post(url, path, body)
    if status is None:  # TEI's error shape
        assert r.status_code == 422 and needle in r.json()["error"], r.text
        return
    message, got_param, _ = error(r)
    assert r.status_code == status and got_param == param and needle in message, r.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"messages": image_message(GOOD)}, "messages[0].content[0].image_url"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "a cat"}]}, "messages"),
    ("/embeddings", {"input": [GOOD], "modality": "image"}, "modality"),
    ("/v2/embed", {"images": [GOOD]}, "images"),
    ("/v2/embed", {"inputs": [{"content": [COHERE_IMG]}]}, "inputs[0].content"),
])
def test_text_model_refuses_images(text_url: str, path: str, body: dict, param: str) -> None:
    r = post(text_url, path, body)
    message, got_param, code = error(r)
    assert r.status_code == 424 and code == "unsupported" and got_param == param, r.text
    assert "text" in message and "bert" in message
    r = post(text_url, "/v1/embeddings", {"input": GOOD, "truncate": True})  # a text model's text field: a text
    assert r.status_code == 200, r.text


# -- hostile images --------------------------------------------------------------------------------------------------

def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb(width: int = 30_000, height: int = 30_000) -> bytes:
    """A valid PNG header declaring width x height RGB pixels, with a few bytes of data: a decompression bomb."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def noise(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels))


TRUNCATED = noise(40, 40)[:3000]  # the header is intact: refused when decoded, not at admission
OVERSIZE = noise(160, 160)
assert len(OVERSIZE) > MAX_IMAGE_BYTES and len(TRUNCATED) == 3000

# hostile image (a data URI or URL) → status, words of the message
HOSTILE: dict[str, tuple[str, int, str]] = {
    "not_an_image": (data_uri(b"this is plain text, not a picture"), 400, "not an image"),
    "truncated_png": (data_uri(TRUNCATED), 400, "truncated or corrupt"),
    "decompression_bomb": (data_uri(bomb()), 413, "decompression bomb"),
    "over_pixel_limit": (data_uri(bomb(8000, 8000)), 413, "pixels"),
    "mode_I_tiff": (data_uri(encoded(Image.fromarray(np.arange(77, dtype=np.int32).reshape(7, 11) * 99999), "TIFF"),
                             "image/tiff"), 400, "mode 'I'"),
    "mode_F_tiff": (data_uri(encoded(Image.fromarray(np.linspace(0, 1, 77, dtype=np.float32).reshape(7, 11)),
                                     "TIFF"), "image/tiff"), 400, "mode 'F'"),
    "over_byte_limit": (data_uri(OVERSIZE), 413, f"limit is {MAX_IMAGE_BYTES} bytes"),
    "bad_base64": ("data:image/png;base64,iVBOR%%%not*base64", 400, "not valid base64"),
    "not_base64_encoded": ("data:image/png,rawbytes", 400, "base64"),
    "other_media_type": (data_uri(b"hello", "text/plain"), 400, "media type 'text/plain'"),
    "empty": ("data:image/png;base64,", 400, "empty"),
    "url_not_fetched": ("https://images.example.com/cat.png", 400, "does not fetch"),
    "other_scheme": ("file:///etc/passwd", 400, "file: URL"),
    "not_a_reference": ("iVBORw0KGgo=", 400, "neither a data:image"),
}
# route, body template (H where the hostile image goes), the field errors must name, the good body's vectors
ROUTES = [
    ("/v1/embeddings", {"messages": image_message(H)}, "messages[0].content[0].image_url", [PNG]),
    ("/v2/embed", {"images": [GOOD, H], "input_type": "image"}, "images[1]", [PNG, PNG]),
    ("/v2/embed", {"inputs": [{"content": [{"type": "text", "text": CAPTIONS[0]}]},
                              {"content": [{"type": "image_url", "image_url": {"url": H}}]}]},
     "inputs[1].content[0].image_url", [{"text": CAPTIONS[0]}, PNG]),
    ("/embeddings", {"input": [GOOD, H], "modality": "image"}, "input[1]", [PNG, PNG]),
]


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize(("path", "template", "field", "good"), ROUTES, ids=[f"{p}:{f}" for p, _, f, _ in ROUTES])
def test_hostile_image_is_refused_by_name_and_the_next_request_succeeds(
        url: str, clip: Engine, path: str, template: dict, field: str, good: list, hostile: str) -> None:
    value, status, needle = HOSTILE[hostile]
    r = post(url, path, fill(template, value))
    message, param, _ = error(r)
    assert r.status_code == status and needle in message, r.text
    assert param == field and message.startswith(field), (message, param)
    after = post(url, path, fill(template, GOOD))
    assert close(vectors(after), clip.embed(good))
    assert httpx.get(f"{url}/health").status_code == 200


def test_hostile_images_cost_no_other_request(url: str, clip: Engine) -> None:
    """Truncated images (refused only when decoded, inside a batch) sent at once with good ones: every good
    request gets its own right vector."""
    want = clip.embed(PICTURES)

    def good(i: int) -> np.ndarray:
        return vectors(post(url, "/v2/embed", {"images": [data_uri(PICTURES[i % 3])]}))[0]

    def bad(_: int) -> int:
        return post(url, "/v2/embed", {"images": [GOOD, data_uri(TRUNCATED)]}).status_code

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(12)]
        bads = [pool.submit(bad, i) for i in range(12)]
        assert [f.result() for f in bads] == [400] * 12
        assert all(close(f.result(), want[i % 3]) for i, f in enumerate(goods))


def _mutated(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        out[position % len(out)] = value
    return bytes(out[:cut] if cut else out)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(
    st.binary(max_size=600),
    st.builds(_mutated, st.sampled_from([PNG, JPEG, encoded(scene(1), "GIF"), encoded(scene(2), "WEBP")]),
              st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
              st.one_of(st.none(), st.integers(1, 2000)))),
    media=st.sampled_from(["image/png", "image/jpeg", "image/x-anything"]))
def test_fuzzed_images_are_never_a_server_error(url: str, payload: bytes, media: str) -> None:
    r = post(url, "/v2/embed", {"images": [data_uri(payload, media)]})
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    if r.status_code != 200:
        assert error(r)[1] == "images[0]"


def test_after_the_fuzz_the_server_serves(url: str, clip: Engine) -> None:
    assert close(vectors(post(url, "/v1/embeddings", {"messages": image_message(GOOD)})), clip.embed([PNG]))


# -- image URLs: --allow-image-fetch -----------------------------------------------------------------------------------

def test_allowed_host_is_fetched(fetching: str, site: ImageSite, clip: Engine, reference: Callable) -> None:
    got = vectors(post(fetching, "/v1/embeddings", {"messages": image_message(site.url("/cat.png"))}))
    assert close(got, clip.embed([PNG])) and close(got, reference([PNG]), 1e-4)
    batch = vectors(post(fetching, "/embeddings", {"input": [site.url("/photo.jpg"), GOOD, site.url("/to-cat")],
                                                    "modality": "image"}))
    assert close(batch, clip.embed([JPEG, PNG, PNG]))  # a redirect within the allowed host is followed
    cohere = vectors(post(fetching, "/v2/embed", {"inputs": [{"content": [
        {"type": "image_url", "image_url": {"url": site.url("/cat.png")}}]}]}))
    assert close(cohere, clip.embed([PNG]))


@pytest.mark.parametrize(("target", "status", "needle", "connections"), [
    ("/cat.png@localhost", 400, "host 'localhost'", 0),  # same server, other name: never connected
    ("/to-other-host", 400, "host 'localhost'", 1),  # the redirect is read, its target never connected
    ("/to-ftp", 400, "not an http(s) URL", 1),
    ("/loop", 400, "redirects more than 3 times", 4),
    ("/big.png", 413, f"limit is {MAX_IMAGE_BYTES} bytes", 1),  # by its Content-Length
    ("/big-unsized.png", 413, f"over {MAX_IMAGE_BYTES} bytes", 1),  # counted while it streams
    ("/gzip.png", 400, "Content-Encoding 'gzip'", 1),
    ("/missing.png", 400, "404", 1),
    ("/slow.png", 400, "longer than 3 s", 1),
])
def test_fetch_refusals(fetching: str, site: ImageSite, clip: Engine, target: str, status: int, needle: str,
                        connections: int) -> None:
    path, _, host = target.partition("@")
    link = site.url(path, host or "127.0.0.1")
    before = len(site.requests)
    r = post(fetching, "/v2/embed", {"images": [GOOD, link]})
    message, param, _ = error(r)
    assert r.status_code == status and needle in message and param == "images[1]", r.text
    assert len(site.requests) - before == connections, site.requests[before:]
    assert all(h.startswith("127.0.0.1") for _, h in site.requests[before:])  # only the allowed host was asked
    assert close(vectors(post(fetching, "/v2/embed", {"images": [GOOD]})), clip.embed([PNG]))


def test_url_refused_without_fetching_by_default(url: str, site: ImageSite) -> None:
    before = len(site.requests)
    r = post(url, "/v1/embeddings", {"messages": image_message(site.url("/cat.png"))})
    message, param, code = error(r)
    assert r.status_code == 400 and code == "bad_image" and "--allow-image-fetch" in message
    assert param == "messages[0].content[0].image_url" and len(site.requests) == before


# -- configuration -------------------------------------------------------------------------------------------------

def test_fetch_hosts_are_names_only() -> None:
    assert ServerConfig(allow_image_fetch=("Images.Example.com.", "[::1]")).allow_image_fetch == (
        "images.example.com", "::1")
    for bad in ("*", "*.example.com", "https://images.example.com", "images.example.com:8080", "host/path", " "):
        with pytest.raises(ValueError, match="allow_image_fetch"):
            ServerConfig(allow_image_fetch=(bad,))
    with pytest.raises(ValueError, match="image_fetch_timeout"):
        ServerConfig(image_fetch_timeout=0)


def test_default_body_limit_fits_one_largest_image() -> None:
    """A body holding one image of the largest legal size (20 MiB by default, as base64) gets past the body
    limit, so the engine refuses a larger one by name rather than the body limit without one."""
    twenty = 20 * 2**20
    assert default_payload_limit(2048, 77, twenty) >= len(data_uri(b"\0" * twenty)) + 1000
    assert default_payload_limit(2048, 256) == default_payload_limit(2048, 256, None)  # text models: unchanged


def test_serve_help_names_the_fetch_option() -> None:
    from click.testing import CliRunner

    from wde.cli import main

    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--allow-image-fetch" in out and "--image-fetch-timeout" in out
    bad = CliRunner().invoke(main, ["serve", "--allow-image-fetch", "*", "--api-servers", "0"])
    assert bad.exit_code == 2 and "--allow-image-fetch" in bad.output and "wildcards" in bad.output
