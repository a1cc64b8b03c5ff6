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
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import torch

from wde.components.base import BuildContext, Component, Params
from wde.components.image_input import ImagePreprocessor, ImageTextInputProcessor, is_image, load_image_processor
from wde.components.image_limits import BAD_IMAGE, TOO_LARGE, check_formats
from wde.components.input_processor import InputName, TextInputProcessor
from wde.components.model_input_builder import ModelInput, PackedInputBuilder
from wde.components.models.fused import l2_normalize
from wde.components.multi_vector_config import TASKS
from wde.components.multimodal import ImageTextRequestProcessor, stack_padded
from wde.components.params import ImageTextInputParams, ImageTextRequestParams, MultiVectorPoolerParams
from wde.components.pooler import Pooled
from wde.components.qwen2_vl_pixels import QWEN2_VL_PROCESSORS, Qwen2VLPreprocessor
from wde.components.request_processor import Result
from wde.components.scheduler import SchedulerOutput
from wde.errors import ModelLoadError, RequestError, internal_error
from wde.request import ImagePrompt, PoolingParams, Prompt, Request, SchedulableRequest, TextPrompt, TokensPrompt

OUTPUT = "colbert"
"""The output: one vector per token, as every late-interaction workflow names it."""

AUGMENTATION_TOKENS = 10
"""Query augmentation buffer: the processors append the pad token this many times to every query."""

FAMILIES: dict[str, dict[str, Any]] = {
    "colpali": {"architecture": "ColPaliForRetrieval", "image_processors": ("SiglipImageProcessor",),
                "query_prefix": "Question: ", "visual_prompt_prefix": "Describe the image.", "image_token": "<image>"},
    "colqwen2": {"architecture": "ColQwen2ForRetrieval", "image_processors": QWEN2_VL_PROCESSORS,
                 "query_prefix": "Query: ", "image_token": "<|image_pad|>",
                 "visual_prompt_prefix": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the"
                                         " image.<|im_end|><|endoftext|>"},
}
"""Config `model_type` → its architecture, image processors and the processor's defaults (transformers 5.24's
`ColPaliProcessor` / `ColQwen2Processor`), used where processor_config.json does not set them."""

PROCESSOR_KEYS = frozenset({"processor_class", "image_processor", "query_prefix", "visual_prompt_prefix"})
"""processor_config.json keys WDE implements; any other (a chat template, an option of a newer processor) is refused
by name: the prompts would not be the ones the folder asks for."""


@dataclass(frozen=True)
class ColFolder:
    """What a ColPali / ColQwen2 folder's processor says about its inputs."""

    family: Literal["colpali", "colqwen2"]
    query_prefix: str
    visual_prompt_prefix: str
    image_token: str

    @classmethod
    def read(cls, source: Any) -> "ColFolder":
        model_type = getattr(source.hf_config, "model_type", None)
        if model_type not in FAMILIES:
            raise ModelLoadError(f"{source.path}: config model_type {model_type!r} is not ColPali or ColQwen2"
                                 f" ({', '.join(FAMILIES)})")
        defaults = FAMILIES[model_type]
        cfg = source.read_json("processor_config.json") or {}
        if not isinstance(cfg, Mapping):
            raise ModelLoadError(f"{source.path / 'processor_config.json'} is not a JSON object")
        unknown = sorted(set(cfg) - PROCESSOR_KEYS)
        if unknown:
            raise ModelLoadError(f"{source.path / 'processor_config.json'}: {', '.join(unknown)} is not implemented"
                                 f" by WDE's {model_type} workflow (it reads {', '.join(sorted(PROCESSOR_KEYS))})")
        values = {k: cfg.get(k) or defaults[k] for k in ("query_prefix", "visual_prompt_prefix")}
        for key, value in values.items():
            if not isinstance(value, str):
                raise ModelLoadError(f"{source.path / 'processor_config.json'}: {key} must be a string")
        return cls(model_type, values["query_prefix"], values["visual_prompt_prefix"], defaults["image_token"])


def task_given(params: PoolingParams) -> str | None:
    """The request's `task` option, or None where it names none (its input's side then)."""
    return (params.options or {}).get("task")


class ColRetrievalInput(ImageTextInputProcessor):
    """`image_text_input` for ColPali / ColQwen2: a text is a query, an image a page; the task option, when given,
    must be the input's side. Prompts are the processor's own (`prompt`, `prompt_name` and `dimensions` are
    refused). An image's length (its `num_prompt_tokens`) is its whole language-model sequence: image tokens plus
    the visual prompt, known from its header."""

    name = "col_retrieval_input"
    Params = ImageTextInputParams

    def __init__(self, params: ImageTextInputParams, ctx: BuildContext) -> None:
        TextInputProcessor.__init__(self, params, ctx)
        if params.pairs != "forbid" or params.prompts or params.default_prompt_name:
            raise ModelLoadError("input_processor.params: pairs, prompts and default_prompt_name are not taken by"
                                 " ColPali / ColQwen2 (their processors' prompts apply)")
        self.folder = ColFolder.read(ctx.source)
        self.formats = check_formats(params.image_formats)
        self.naflex = None
        self.image_size: tuple[int, int] | None = None
        self.image_tokens: int | None = None
        name, proc, where = load_image_processor(ctx.source)
        family = FAMILIES[self.folder.family]
        if name not in family["image_processors"]:
            raise ModelLoadError(f"{where}: image processor {name} is not the one WDE implements for"
                                 f" {self.folder.family} ({', '.join(family['image_processors'])})")
        vision = ctx.source.hf_config.vlm_config.vision_config
        self.max_length: int = ctx.tokenizer.max_length
        hf = ctx.tokenizer.hf_tokenizer
        self.image_token_id = self._token_id(hf, self.folder.image_token, where)
        if self.folder.family == "colpali":
            self.preprocessor: Any = ImagePreprocessor.from_processor(name, proc, where)
            self.image_size = self.preprocessor.output_size
            side, patch = int(vision.image_size), int(vision.patch_size)
            seq = getattr(proc, "image_seq_length", None)
            if self.image_size != (side, side) or seq != (side // patch) ** 2:
                raise ModelLoadError(f"{where}: the image processor makes {self.image_size} images of"
                                     f" image_seq_length {seq}; the vision tower takes {side}x{side} images of"
                                     f" {(side // patch) ** 2} patches (vlm_config.vision_config)")
            self.image_tokens = seq
            bos = hf.bos_token or ""
            template = f"{self.folder.image_token}{bos}{self.folder.visual_prompt_prefix}\n"
            self.query_template = (f"{bos}{self.folder.query_prefix}", f"{hf.pad_token * AUGMENTATION_TOKENS}\n")
        else:
            self.preprocessor = Qwen2VLPreprocessor.from_processor(name, proc, where)
            pre = self.preprocessor
            for key, ours in (("patch_size", pre.patch_size), ("spatial_merge_size", pre.merge_size),
                              ("temporal_patch_size", pre.temporal_patch_size)):
                if int(getattr(vision, key)) != ours:
                    raise ModelLoadError(f"{where}: the image processor's {key} is {ours} but vlm_config.vision_config"
                                         f" says {getattr(vision, key)}")
            template = self.folder.visual_prompt_prefix
            self.query_template = (self.folder.query_prefix, f"{hf.pad_token * AUGMENTATION_TOKENS}\n")
        if hf.pad_token is None:
            raise ModelLoadError(f"{ctx.source.path}: the tokenizer has no pad token, which the processor appends to"
                                 " every query (its augmentation buffer)")
        ids = hf(template, add_special_tokens=False)["input_ids"]
        if ids.count(self.image_token_id) != 1:
            raise ModelLoadError(f"{where}: the visual prompt {template!r} must hold the image token"
                                 f" {self.folder.image_token!r} once")
        at = ids.index(self.image_token_id)
        self.image_affixes: tuple[list[int], list[int]] = (ids[:at], ids[at + 1:])
        """The token ids before and after an image's tokens in a document's sequence."""

    @staticmethod
    def _token_id(hf: Any, token: str, where: Any) -> int:
        token_id = hf.convert_tokens_to_ids(token)
        if token_id is None or (token_id == hf.unk_token_id and token != hf.unk_token):
            raise ModelLoadError(f"{where}: the tokenizer has no {token!r} token, which the processor's prompts use")
        return int(token_id)

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": TASKS}

    def vision_tokens(self, width: int, height: int) -> int:
        """Image tokens of a width x height image in the language model."""
        if self.folder.family == "colpali":
            return self.image_tokens  # type: ignore[return-value]
        return self.preprocessor.num_tokens(width, height)

    def num_tokens(self, width: int, height: int) -> int:
        return self.vision_tokens(width, height) + sum(map(len, self.image_affixes))

    def image_ids(self, vision_tokens: int) -> list[int]:
        """A document's token ids: the visual prompt with its image token repeated `vision_tokens` times."""
        before, after = self.image_affixes
        return [*before, *[self.image_token_id] * vision_tokens, *after]

    def query_text(self, text: str) -> str:
        """A query as the processor renders it."""
        return f"{self.query_template[0]}{text}{self.query_template[1]}"

    def to_prompt(self, inputs: Any, params: PoolingParams, field: InputName = "input") -> Prompt:
        name = field[1] if isinstance(field, tuple) else field
        for option in ("prompt", "prompt_name", "dimensions"):
            if getattr(params, option) is not None:
                raise RequestError(f"{option} is not taken by {self.folder.family}: its processor's query prefix and"
                                   " visual prompt apply, and its token vectors cannot be truncated", option)
        task, image = task_given(params), is_image(inputs)
        if task is not None and task != ("document" if image else "query"):
            what = ("an image: page images are documents" if image
                    else "a text: texts are queries (the processor renders every text as a query)")
            raise RequestError(f"{name} is {what}, and options.task is {task!r} ({self.folder.family} embeds text"
                               " queries and page-image documents)", "options.task")
        prompt = super().to_prompt(inputs, params, field)
        if isinstance(prompt, ImagePrompt) and prompt.num_tokens > self.max_length:
            raise RequestError(f"{name} makes a sequence of {prompt.num_tokens} tokens, more than the model's"
                               f" {self.max_length}", name, kind="too_long")
        return prompt

    def _check_prepared(self, prompt: ImagePrompt, field: str) -> ImagePrompt:
        data = prompt.data
        if not isinstance(data, np.ndarray):
            return self.image_prompt(data, field)
        if self.folder.family == "colpali":
            expected = (3, *self.image_size)  # type: ignore[misc]
            if data.dtype != np.float32 or data.shape != expected:
                raise RequestError(f"{field}: prepared pixel values must be a float32 array of shape {expected}",
                                   field, kind=BAD_IMAGE)
            return ImagePrompt(data, self.num_tokens(0, 0), 0)
        pre = self.preprocessor
        if (data.dtype != np.float32 or data.ndim != 3 or data.shape[2] != pre.patch_dim
                or 0 in data.shape[:2] or data.shape[0] % pre.merge_size or data.shape[1] % pre.merge_size):
            raise RequestError(f"{field}: prepared pixel values must be a float32 array of shape (h_patches,"
                               f" w_patches, {pre.patch_dim}), both multiples of {pre.merge_size}", field,
                               kind=BAD_IMAGE)
        pixels = data.shape[0] * data.shape[1] * pre.patch_size ** 2
        if pixels > pre.max_pixels:
            raise RequestError(f"{field}: prepared pixel values cover {pixels} pixels; the limit is {pre.max_pixels}"
                               " (the image processor's max_pixels)", field, kind=TOO_LARGE)
        vision = data.shape[0] * data.shape[1] // pre.merge_size ** 2
        return ImagePrompt(data, vision + sum(map(len, self.image_affixes)), 0)


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


class ColRetrievalPooler(Component):
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
