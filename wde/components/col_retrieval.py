"""ColPali (`ColPaliForRetrieval`) and ColQwen2 (`ColQwen2ForRetrieval`): page images (documents) and text queries
to one vector per token, scored by MaxSim (docs/images.md, "Page retrieval").

These components put WDE's admission, image limits, scheduler and outputs around the model folder's transformers
modules (wde/components/models/col_retrieval.py); each input becomes the sequence transformers' processor makes:

- a query (a text): `ColPaliProcessor.process_queries` renders `{bos}{query_prefix}{text}{pad * 10}\\n`, ColQwen2's
  `{query_prefix}{text}{pad * 10}\\n` (the ten pad tokens are the query augmentation buffer); tokenized with no
  special tokens added, as the processors leave their tokenizers;
- a document (a page image): ColPali's `{<image> * image_seq_length}{bos}{visual_prompt_prefix}\\n` with the image
  at the SigLIP tower's fixed size; ColQwen2's `visual_prompt_prefix` (a chat-formatted "Describe the image.") with
  its one `<|image_pad|>` expanded to the image's tokens, the image at its own resolution within the processor's
  min/max pixels (wde/components/qwen2_vl_pixels.py).

Texts are queries and images documents, as the processors render them: a text sent with `task=document` or an
image with `task=query` is refused by name, and a request that names no task gets its input's side. The folder's
`processor_config.json` is read as transformers reads it; a setting these components do not implement is refused
by name at start-up.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from wde.components.base import BuildContext, Params
from wde.components.kinds import Pooler
from wde.components.col_retrieval_input import ColRetrievalInput
from wde.components.model_input_builder import ModelInput, PackedInputBuilder
from wde.components.models.fused import l2_normalize
from wde.components.multi_vector_config import TASKS
from wde.components.multimodal import ImageTextRequestProcessor, stack_padded
from wde.components.params import ImageTextRequestParams, MultiVectorPoolerParams
from wde.components.pooler import Pooled
from wde.components.request_processor import Result
from wde.components.scheduler import SchedulerOutput
from wde.components.tokenizer import HFTokenizerParams
from wde.errors import ModelLoadError, RequestError, internal_error
from wde.request import ImagePrompt, Request, SchedulableRequest, TextPrompt, TokensPrompt

OUTPUT = "colbert"
"""The output: one vector per token, as every late-interaction workflow names it."""


class ColRetrievalTokenize(ImageTextRequestProcessor):
    """`image_text` for ColPali / ColQwen2: a query is rendered and tokenized as its processor does; a page image is
    decoded and preprocessed (on the worker threads) and becomes its visual prompt's token ids, its image token
    repeated for its patches. A query over the length limit is refused (truncating it would cut its augmentation
    buffer)."""

    name = "col_retrieval"
    Params = ImageTextRequestParams

    def __init__(self, params: ImageTextRequestParams, ctx: BuildContext) -> None:
        if params.pad_text != "none":
            raise ModelLoadError("request_processor.params.pad_text is not taken by ColPali / ColQwen2 (queries are"
                                 " never padded: padding would change their vectors)")
        tok = ctx.tokenizer.params
        if isinstance(tok, HFTokenizerParams) and (tok.add_eos or tok.padding_side is not None):
            raise ModelLoadError("tokenizer.params add_eos and padding_side are not taken by ColPali / ColQwen2 (queries"
                                 " and pages are tokenized as their processors render them, never padded)")
        super().__init__(params, ctx)
        self.input: ColRetrievalInput = ctx.input_processor
        if not isinstance(self.input, ColRetrievalInput):
            raise ModelLoadError("request processor 'col_retrieval' needs input processor 'col_retrieval_input'")

    def process(self, requests: Sequence[Request], token_budget: int) -> list[Result]:
        t0 = time.perf_counter()
        limit = min(self.max_length, token_budget)
        results: list[Result | None] = [None] * len(requests)
        texts = [i for i, r in enumerate(requests) if isinstance(r.prompt, TextPrompt)]
        if texts:
            try:
                hf = self._tokenizer.hf_tokenizer
                encoded = hf([self.input.query_text(requests[i].prompt.text) for i in texts],  # type: ignore[union-attr]
                             add_special_tokens=False)["input_ids"]
            except Exception as e:  # noqa: BLE001 - ours, not the input's
                encoded = [internal_error(requests[i].request_id, e, "tokenizer") for i in texts]
            for i, ids in zip(texts, encoded):
                results[i] = ids if isinstance(ids, RequestError) else self._fits(requests[i], list(ids), limit)
        for i, r in enumerate(requests):
            if isinstance(r.prompt, TokensPrompt):
                results[i] = self._fits(r, list(r.prompt.token_ids), limit)
        images = [i for i, r in enumerate(requests) if isinstance(r.prompt, ImagePrompt)]
        fits = []
        for i in images:
            tokens = requests[i].prompt.num_tokens  # type: ignore[union-attr]
            if tokens > limit:
                results[i] = RequestError(f"an image takes {tokens} tokens, more than the limit of {limit} (the model's"
                                          " max length or scheduler.params.max_num_batched_tokens)", "input",
                                          kind="too_long")
            else:
                fits.append(i)
        for i, pixels in zip(fits, self._pixels([requests[i] for i in fits])):
            r = requests[i]
            if isinstance(pixels, RequestError):
                results[i] = pixels
                continue
            ids = self.input.image_ids(r.prompt.num_tokens - sum(map(len, self.input.image_affixes)))  # type: ignore[union-attr]
            results[i] = SchedulableRequest(r, ids, None, pixels, len(ids))
        dt = (time.perf_counter() - t0) / max(len(requests), 1)
        for r in requests:
            r.tokenization_time = dt
        return results  # type: ignore[return-value]

    def _fits(self, request: Request, ids: list[int], limit: int) -> Result:
        cap = request.params.max_tokens
        limit = limit if cap is None else min(limit, cap)
        if len(ids) <= limit:
            return SchedulableRequest(request, ids)
        return RequestError(f"query has {len(ids)} tokens (with the processor's prefix and augmentation buffer),"
                            f" more than the limit of {limit}; shorten it (ColPali / ColQwen2 queries are not"
                            " truncated: truncate and max_tokens would cut the augmentation buffer)", "input",
                            kind="too_long")


class ColRetrievalInputBuilder(PackedInputBuilder):
    """`packed` (each sequence its real token ids: the model places image features at its image tokens), with the
    images' pixels stacked into `pixel_values` in batch order and `image_mask` marking image sequences.

    ColPali's images are [3, H, W], stacked as they are. ColQwen2's are [h_patches, w_patches, values] of different
    grids: each is zero-padded to the batch's largest grid, with one more channel that is 1 on the image's own
    patches, so the model reads each image's grid back (`qwen2_vl_images`)."""

    name = "col_retrieval_packed"

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.grids = getattr(ctx.source.hf_config, "model_type", None) == "colqwen2"

    def build(self, batch: SchedulerOutput) -> ModelInput:
        built = super().build(batch)
        arrays = [s.pixel_values for s in batch.scheduled if s.pixel_values is not None]
        if not arrays:
            return built
        if self.grids:
            arrays = [np.concatenate([a, np.ones((*a.shape[:2], 1), dtype=a.dtype)], axis=2) for a in arrays]
        pixels = torch.from_numpy(stack_padded(arrays))
        built.pixel_values = pixels.pin_memory() if self._pin else pixels
        built.image_mask = [s.pixel_values is not None for s in batch.scheduled]
        return built


def qwen2_vl_images(pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches [sum of h*w, values] in transformers' order, image_grid_thw [images, 3]) of the padded grids
    `ColRetrievalInputBuilder` stacks for ColQwen2."""
    valid = pixel_values[..., -1] > 0
    rows, cols = valid[:, :, 0].sum(1).tolist(), valid[:, 0, :].sum(1).tolist()
    patches = [pixel_values[i, :h, :w, :-1].reshape(h * w, -1) for i, (h, w) in enumerate(zip(rows, cols))]
    grid = torch.tensor([[1, h, w] for h, w in zip(rows, cols)], device=pixel_values.device)
    return torch.cat(patches), grid


class ColRetrievalPooler(Pooler):
    """The model's projected token vectors, one per token of each input (the query's prefix and augmentation
    buffer, the page's image and prompt tokens: every position transformers' attention mask keeps),
    L2-normalized unless a request sets `normalize=false`. Output 'colbert', scored by MaxSim (summed)."""

    kind = "pooler"
    name = "col_retrieval"
    Params = MultiVectorPoolerParams
    outputs = (OUTPUT,)
    similarity_fn_name = "maxsim"
    """How `maxsim` adds up (read by the scorer): summed over the query's tokens, as `score_retrieval` does."""

    def __init__(self, params: MultiVectorPoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.normalize: bool = True if params.normalize == "auto" else params.normalize
        self.vector_size: int = int(ctx.model.hidden_size)

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": TASKS}

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        x = hidden.float()
        norms = [self.normalize if p.normalize is None else p.normalize for p in batch.pooling_params]
        if all(norms):
            x = l2_normalize(x)
        elif any(norms):
            per_token = torch.tensor(norms, device=x.device).repeat_interleave(
                torch.tensor(batch.seq_lens, device=x.device))[:, None]
            x = torch.where(per_token, l2_normalize(x), x)
        return Pooled(ragged={OUTPUT: (x, batch.cu_seqlens.tolist())})
