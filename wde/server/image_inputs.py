"""Image inputs of the HTTP routes (OpenAI/vLLM `messages` image_url parts, Cohere `images` and image_url
content, Infinity `modality: "image"`), turned into the inputs the engine takes.

A request names an image by a string: a `data:image/...;base64,...` URI, passed to the engine as it is (the engine
checks its base64, its size and its header, and names the input in every refusal), or an http(s) URL, fetched
only from the hosts `--allow-image-fetch` lists (wde/server/image_fetch.py) and passed as the fetched bytes. These
are the input forms `Engine.embed` takes, so the routes work the same in one process and with `--api-servers`.
Texts that travel next to images go to the engine as `{"text": ...}`, so a caption that happens to start with
"data:image/" is still a text.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from wde.async_engine import EngineOverloaded, check_capacity
from wde.server.errors import ApiError
from wde.server.service import unless_disconnected

if TYPE_CHECKING:
    from fastapi import Request

    from wde.server.service import Service

IMAGE_MODELS = "an image-text model such as CLIP or SigLIP (docs/images.md)"

_SCHEME = re.compile(r"([a-z][a-z0-9+.-]*):", re.IGNORECASE)


def require_images(svc: "Service", field: str, what: str) -> None:
    """The 424 for an image sent to a model whose workflow embeds texts only (`what` says what was sent)."""
    if not svc.takes_images:
        raise ApiError("unsupported", f"{what}: this model embeds text only (workflow {svc.info.workflow!r}); images"
                       f" need {IMAGE_MODELS}", field)


def check_one_part(where: str, images: int, parts: int, hint: str) -> None:
    """Refuse content (a chat message's, a Cohere input's) that is not exactly one text or one image_url part:
    `images` of its `parts` are image_url parts; `hint` ends the message for several parts of one kind."""
    if images and images < parts:
        raise ApiError("validation", f"{where} mixes {images} image_url and {parts - images} text part(s): CLIP and"
                       " SigLIP embed a text and an image separately (two towers, one vector each), never together;"
                       " send them as separate inputs", where)
    if parts != 1:
        raise ApiError("validation", f"{where} has {parts} {'image_url' if images else 'text'} parts; {hint}", where)


def text_input(text: str) -> dict[str, str]:
    """A text sent next to images: always a text to the engine, whatever it starts with."""
    return {"text": text}


async def image_inputs(svc: "Service", request: "Request", values: Sequence[Any], names: Sequence[str], field: str,
                       total: int | None = None) -> list[str | bytes]:
    """The engine inputs of image references `values` (data: URIs as they are, allowed URLs fetched), or the
    `ApiError` naming the first one that cannot be served.

    `field` is the request's field of inputs and `total` how many inputs the request carries (`values`' count when
    not given): the batch limit is checked on it before anything is fetched. URLs are fetched under one of the
    server's request slots (--max-concurrent-requests: a request fetching is a request in flight, so the slots
    bound how many fetch at once), and given up, connections closed, as soon as the client hangs up."""
    svc.check_batch_size(len(values) if total is None else total, field)
    inputs: list[str | bytes | None] = []
    urls: list[tuple[int, str, str]] = []
    for i, (value, name) in enumerate(zip(values, names)):
        if not isinstance(value, str):
            raise ApiError("validation", f"{name} must be an image URL or data:image/...;base64,... URI string, got"
                           f" {type(value).__name__}", name)
        text = value.strip()
        scheme = _SCHEME.match(text)
        kind = scheme.group(1).lower() if scheme else None
        if kind == "data":
            media = text[5:].split(",", 1)[0].split(";", 1)[0].strip().lower()
            if not media.startswith("image/"):
                raise ApiError("bad_image", f"{name} is a data: URI of media type {media or 'text/plain'!r}, not an"
                               " image: expected data:image/...;base64,...", name)
            inputs.append(text)
        elif kind in ("http", "https"):
            if svc.fetcher is None:
                raise ApiError("bad_image", f"{name} is an image URL, and this server does not fetch URLs (so a"
                               " request cannot make it connect anywhere): send the image as a"
                               " data:image/...;base64,... URI, or start the server with --allow-image-fetch HOSTS",
                               name)
            urls.append((i, text, name))
            inputs.append(None)
        elif kind is not None:
            raise ApiError("bad_image", f"{name} is a {kind}: URL; an image is a data:image/...;base64,... URI"
                           " (or an http(s) URL from a host the server fetches from)", name)
        else:
            raise ApiError("bad_image", f"{name} is neither a data:image/...;base64,... URI nor an image URL", name)
    if urls:
        fetcher = svc.fetcher
        assert fetcher is not None
        links, fields = [u for _, u, _ in urls], [n for _, _, n in urls]
        fetcher.vet(links, fields, field)  # their number and every URL, before a slot is taken
        with request_slot(svc.engine):
            bodies = await unless_disconnected(request, fetcher.fetch_all(links, fields, field))
        for (i, _, _), body in zip(urls, bodies):
            inputs[i] = body
    return inputs  # type: ignore[return-value]


@contextmanager
def request_slot(engine: Any) -> Iterator[None]:
    """Hold one of the engine's request slots (`max_concurrent_requests`, counted in `active_calls`, as `encode`
    counts the requests it serves) while the block runs, or refuse (429) when none is free. So requests fetching
    and requests in the engine share the one limit, and no more requests fetch at once than it allows. The slot is
    released as the fetched inputs go to `encode`, which takes its own when its task starts, one loop iteration
    later: in that gap another request may take the last slot, and this one is answered 429 as any request is
    when the server is full."""
    try:
        check_capacity(engine)
    except EngineOverloaded as e:
        raise ApiError("overloaded", str(e)) from None
    engine.active_calls += 1
    try:
        yield
    finally:
        engine.active_calls -= 1
