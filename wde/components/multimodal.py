"""The components between admission and the model that let one engine take texts and images together (CLIP,
SigLIP; docs/images.md):

- `image_text` (request processor): tokenizes texts as `lazy_tokenize` does (optionally padded to the max length,
  as SigLIP's text tower expects), and decodes and preprocesses the images the scheduler picks (admission only
  checked them), on worker threads; an image counts its vision-tower length against the token budget. A served
  call's images reach it already decoded (wde/components/image_decode.py runs this same `process` on them before
  the call enters the engine), so in a server it only checks and passes on their pixel values;
- `packed_multimodal` (model input builder): packs a mixed batch as one `ModelInput`: an image is one sequence of
  placeholder tokens (its patches, plus a class token where the model has one) with its pixels in
  `ModelInput.pixel_values` (NaFlex patch grids of different shapes zero-padded to one) and `image_mask` marking
  which sequences are images. A text-only batch is built exactly as `packed` builds it;
- `projected` (pooler): the model already pooled and projected each sequence into the shared space (a row per
  sequence, in batch order); this applies per-request `dimensions` and normalization.

A model with a tower per modality calls `ModelInput.by_modality()` to get a text batch and an image batch (each
with the indices of its sequences), runs each through its tower, and writes the results back in batch order.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.model_input_builder import ModelInput, PackedInputBuilder
from wde.components.params import ImageTextRequestParams, ProjectedPoolerParams
from wde.components.pooler import Pooled, finish_embeddings
from wde.components.request_processor import LazyTokenizeRequestProcessor, Result
from wde.components.scheduler import SchedulerOutput
from wde.errors import ModelLoadError, RequestError, internal_error
from wde.request import ImagePrompt, Request, SchedulableRequest


class ImageTextRequestProcessor(LazyTokenizeRequestProcessor):
    """`lazy_tokenize` for texts; each image is decoded and preprocessed here, when the scheduler picks it (the
    input processor's `preprocess`, the images of a call on up to `workers` threads at once), and passes on with its
    pixel values and its vision-tower length. An image that turns out truncated or corrupt fails alone."""

    name = "image_text"
    Params = ImageTextRequestParams

    def __init__(self, params: ImageTextRequestParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        if not ctx.input_processor.takes_images:
            raise ModelLoadError("request processor 'image_text' needs an input processor that admits images"
                                 " (image_text_input)")
        self._preprocess = ctx.input_processor.preprocess
        self.workers: int = min(4, os.cpu_count() or 1) if params.workers == "auto" else params.workers
        """Threads decoding one batch's images ("auto": up to 4); the serving ImageDecoder runs as many calls."""
        self._pad_id: int | None = None
        if params.pad_text == "max_length":
            pad = ctx.tokenizer.hf_tokenizer.pad_token_id
            if pad is None:
                cfg = ctx.source.hf_config
                pad = getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "pad_token_id", None)
            if pad is None:
                raise ModelLoadError("request_processor.params.pad_text is max_length but neither the tokenizer nor"
                                     " the text config names a pad token")
            self._pad_id = int(pad)
        self._pad_left = getattr(ctx.tokenizer.hf_tokenizer, "padding_side", "right") == "left"
        """Pad before the text, as a tokenizer whose `padding_side` is left pads with padding="max_length"."""

    def is_large(self, request: Request) -> bool:
        if isinstance(request.prompt, ImagePrompt):
            limit = self.params.background_image_pixels
            return bool(limit) and request.prompt.pixels > limit
        return super().is_large(request)

    def process(self, requests: Sequence[Request], token_budget: int) -> list[Result]:
        images = [i for i, r in enumerate(requests) if isinstance(r.prompt, ImagePrompt)]
        if not images:
            return self._padded(super().process(requests, token_budget))
        texts = [i for i, r in enumerate(requests) if not isinstance(r.prompt, ImagePrompt)]
        results: list[Result | None] = [None] * len(requests)
        if texts:
            for i, res in zip(texts, self._padded(super().process([requests[i] for i in texts], token_budget))):
                results[i] = res
        t0 = time.perf_counter()
        fits = [i for i in images if requests[i].prompt.num_tokens <= token_budget]  # type: ignore[union-attr]
        for i in images:
            if i not in fits:
                tokens = requests[i].prompt.num_tokens  # type: ignore[union-attr]
                results[i] = RequestError(f"an image takes {tokens} tokens, more than the batch token budget of"
                                          f" {token_budget} (scheduler.params.max_num_batched_tokens)", "input",
                                          kind="too_long")
        for i, pixels in zip(fits, self._pixels([requests[i] for i in fits])):
            r = requests[i]
            results[i] = pixels if isinstance(pixels, RequestError) else \
                SchedulableRequest(r, [], None, pixels, r.prompt.num_tokens)  # type: ignore[union-attr]
        dt = (time.perf_counter() - t0) / max(len(images), 1)
        for i in images:
            requests[i].tokenization_time = dt
        return results  # type: ignore[return-value]

    def _pixels(self, requests: list[Request]) -> list:
        """Each request's pixel values, or the `RequestError` refusing it; several at once on the pool."""
        def one(r: Request) -> object:
            try:
                return self._preprocess(r.prompt, "input")
            except RequestError as e:
                return e
            except Exception as e:  # noqa: BLE001 - ours, not the image's: this request alone fails
                return internal_error(r.request_id, e, "image preprocessing")

        prepared = all(isinstance(r.prompt.data, np.ndarray) for r in requests)  # type: ignore[union-attr]
        if len(requests) < 2 or self.workers < 2 or prepared:  # pixels sent by an API server: checks only
            return [one(r) for r in requests]
        # a pool per call: threads start in microseconds against milliseconds of decoding, and none outlive it
        with ThreadPoolExecutor(min(self.workers, len(requests)), thread_name_prefix="wde-image") as pool:
            return list(pool.map(one, requests))

    def _padded(self, results: list[Result]) -> list[Result]:
        if self._pad_id is None:
            return results
        out: list[Result] = []
        for res in results:
            if isinstance(res, SchedulableRequest) and res.num_tokens < self.max_length:
                pad = self.max_length - res.num_tokens

                def padded(values: list[int], fill: int) -> list[int]:
                    return [fill] * pad + values if self._pad_left else values + [fill] * pad

                res = replace(res, token_ids=padded(res.token_ids, self._pad_id),
                              token_type_ids=None if res.token_type_ids is None else padded(res.token_type_ids, 0))
            out.append(res)
        return out


class MultimodalInputBuilder(PackedInputBuilder):
    """`packed`, where a sequence may be an image: placeholder token ids, positions 0..n-1, its pixels stacked
    into `pixel_values` in batch order, `image_mask` marking the image sequences.

    Pixel arrays of one shape (CLIP, SigLIP: [3, height, width]) are stacked as they are. Arrays whose shapes differ
    (NaFlex: [h_patches, w_patches, values]) are zero-padded at the end of each axis to the batch's largest, then
    stacked; an image's placeholder token ids all hold the length of its array's first axis (NaFlex: its patch
    rows; with its token count that gives its grid, which is how the model finds its patches in the padding)."""

    name = "packed_multimodal"

    def build(self, batch: SchedulerOutput) -> ModelInput:
        seqs = batch.scheduled
        if all(s.pixel_values is None for s in seqs):
            return super().build(batch)
        placeholders = SchedulerOutput([
            s if s.pixel_values is None else replace(s, token_ids=[int(s.pixel_values.shape[0])] * s.num_tokens)
            for s in seqs])
        mi = super().build(placeholders)
        pixels = torch.from_numpy(stack_padded([s.pixel_values for s in seqs if s.pixel_values is not None]))
        if self._pin:
            pixels = pixels.pin_memory()
        return replace(mi, pixel_values=pixels, image_mask=[s.pixel_values is not None for s in seqs])


def stack_padded(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays stacked along a new first axis; where their shapes differ, each zero-padded at the end of every
    axis to the largest."""
    shape = arrays[0].shape
    if all(a.shape == shape for a in arrays):
        return np.stack(arrays)
    if len({a.ndim for a in arrays}) != 1:
        raise ValueError(f"pixel arrays of different ranks in one batch: {sorted({a.shape for a in arrays})}")
    top = tuple(max(sizes) for sizes in zip(*(a.shape for a in arrays)))
    out = np.zeros((len(arrays), *top), dtype=np.result_type(*arrays))
    for i, a in enumerate(arrays):
        out[(i, *(slice(0, n) for n in a.shape))] = a
    return out


class ProjectedPooler(Pooler):
    """For models whose forward returns one embedding per sequence, already pooled and projected into the shared
    text-image space ([num_seqs, dim]; `PrefillModel.pools = True`): per-request `dimensions` and normalization."""

    kind = "pooler"
    name = "projected"
    Params = ProjectedPoolerParams

    def __init__(self, params: ProjectedPoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        model = ctx.model
        if not model.pools:
            raise ModelLoadError(f"pooler 'projected' needs a model that pools and projects each sequence itself"
                                 f" (e.g. clip, siglip); model {model.name!r} returns per-token states")
        self.outputs: tuple[str, ...] = ("dense",)
        self.dense_size: int = int(model.embedding_size)

    def forward(self, embeddings: torch.Tensor, batch: ModelInput) -> Pooled:
        return Pooled(rows={"dense": finish_embeddings(embeddings, batch, self.params.normalize)})
