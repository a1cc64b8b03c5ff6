"""ColPali / ColQwen2 admission: what a folder's processor says about its inputs (`ColFolder`) and the input
processor that checks queries and page images against it (`ColRetrievalInput`), cheaply, before anything is tokenized
or decoded. The rest of the pipeline is in wde/components/col_retrieval.py (docs/images.md, "Page retrieval")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

import numpy as np

from wde.components.base import BuildContext
from wde.components.image_input import ImagePreprocessor, ImageTextInputProcessor, is_image, load_image_processor
from wde.components.image_limits import BAD_IMAGE, TOO_LARGE, check_formats
from wde.components.input_processor import InputName, TextInputProcessor
from wde.components.multi_vector_config import TASKS
from wde.components.params import ImageTextInputParams
from wde.components.qwen2_vl_pixels import QWEN2_VL_PROCESSORS, Qwen2VLPreprocessor
from wde.errors import ModelLoadError, RequestError
from wde.request import ImagePrompt, PoolingParams, Prompt

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

PROCESSOR_KEYS = frozenset({"processor_class", "image_processor", "query_prefix", "visual_prompt_prefix",
                            "chat_template"})
"""processor_config.json keys WDE reads (a `chat_template` is allowed and unused: `process_queries` and
`process_images` never apply one); any other (an option of a newer processor) is refused by name, as the inputs
would not be the ones the folder asks for."""


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
        self.image_token: str = getattr(hf, "image_token", None) or self.folder.image_token
        """The processor's image token: the tokenizer's `image_token` where it names one, else the family's."""
        self.image_token_id = self._token_id(hf, self.image_token, where)
        if hf.pad_token is None:
            raise ModelLoadError(f"{ctx.source.path}: the tokenizer has no pad token, which the processor appends to"
                                 " every query (its augmentation buffer)")
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
            template = f"{self.image_token}{bos}{self.folder.visual_prompt_prefix}\n"
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
        ids = hf(template, add_special_tokens=False)["input_ids"]
        if ids.count(self.image_token_id) != 1:
            raise ModelLoadError(f"{where}: the visual prompt {template!r} must hold the image token"
                                 f" {self.image_token!r} once")
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
