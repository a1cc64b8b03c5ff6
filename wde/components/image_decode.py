"""Decoding a served call's images before they enter the engine, so the engine loop never decodes.

In one process (`wde serve` without `--api-servers`), the engine loop runs on one thread for every client: if it
decoded and preprocessed images when the scheduler picked them (as the `image_text` request processor does for
offline `Engine.encode`), a call with many large photos would hold the loop for as long as they take (35 s for a
request of 4-megapixel images on a shared 2-core CPU), every other client's batches would wait behind it, and
/health would answer 503 for a loop that only looks stuck. `AsyncEngine.encode` therefore hands a call holding
images to `ImageDecoder` first: the call's images are decoded and preprocessed on a pool of `calls` threads (each
call on one of them, its images on the request processor's own `workers` threads), off the event loop and off the
engine loop, and enter the engine as finished float32 pixel values, which the scheduler only checks and packs. This
is what an API server of split mode (`--api-servers N`) does before it sends pixels to the core
(wde/core/client.py), so both modes treat images alike.

Work stays bounded: at most `calls` calls decode at once (the rest wait their turn in the pool's queue, holding the
encoded files admission already checked), each on at most `workers` threads, each image within the per-image pixel
limit and each call within the per-request pixel budget (wde/components/image_limits.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from wde.errors import RequestError
from wde.request import ImagePrompt, Request, RequestOutput


def undecoded(request: Request) -> bool:
    """Whether a request is an image whose pixels are not made yet (an encoded file or a PIL image)."""
    return isinstance(request.prompt, ImagePrompt) and not isinstance(request.prompt.data, np.ndarray)


class ImageDecoder:
    """Decodes the images of a call on a bounded pool before the call's requests are queued in the engine."""

    def __init__(self, request_processor: Any, token_budget: int) -> None:
        self._request_processor = request_processor
        self._budget = token_budget
        self.calls: int = request_processor.workers
        """Calls whose images are decoded at once: the request processor's `workers`, as it resolved "auto"."""
        self._pool: ThreadPoolExecutor | None = None
        """Started with the first call that holds an image: a text workflow never has it."""

    @classmethod
    def of(cls, engine: Any) -> "ImageDecoder | None":
        """The decoder of an engine whose input processor `takes_images` (the `image_text` workflows); None for a
        workflow that takes texts only."""
        if not engine.input_processor.takes_images:
            return None
        return cls(engine.components["request_processor"], engine.longest_input)

    @staticmethod
    def wanted(requests: Sequence[Request]) -> bool:
        return any(undecoded(r) for r in requests)

    def prepare(self, requests: Sequence[Request]) -> "asyncio.Future[list[Request | RequestOutput]]":
        """On the running event loop: a future of `decode(requests)`, run on the pool."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.calls, thread_name_prefix="wde-image-call")
        return asyncio.get_running_loop().run_in_executor(self._pool, self.decode, list(requests))

    def decode(self, requests: Sequence[Request]) -> list[Request | RequestOutput]:
        """Each request as it goes to the engine: an image as its pixel values (an `ImagePrompt` holding the
        float32 array), or the output refusing it (a file found truncated or corrupt as it was decoded, an image
        longer than the batch token budget); a text as it is. Never raises."""
        images = [i for i, r in enumerate(requests) if undecoded(r)]
        out: list[Request | RequestOutput] = list(requests)
        results = self._request_processor.process([requests[i] for i in images], self._budget)
        for i, res in zip(images, results):
            r = requests[i]
            if isinstance(res, RequestError):
                out[i] = RequestOutput(r.request_id, error=res, tokenization_time=r.tokenization_time)
            else:
                out[i] = Request(r.request_id, ImagePrompt(res.pixel_values, res.image_tokens), r.params,
                                 r.arrival_time, r.tokenization_time)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
