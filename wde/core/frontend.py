"""What an API server runs before a request reaches the engine core: the workflow's tokenizer, input processor
and request processor, built without the model. Validation, prompts, tokenization and length limits are the
same code as in one process, so answers and errors are the same; the core receives token ids only, and for an
image (CLIP, SigLIP: docs/images.md) its preprocessed pixel values: images are decoded here, off the core."""

from __future__ import annotations

from typing import Any

from wde.components.base import BuildContext
from wde.engine import check_params
from wde.engine_info import EngineInfo
from wde.late_chunking import check_spans
from wde.errors import RequestError
from wde.model_source import ModelSource
from wde.request import ImagePrompt, PoolingParams, Request, SchedulableRequest, TokensPrompt
from wde.workflow import ResolvedWorkflow

KINDS = ("tokenizer", "input_processor", "request_processor")
"""The components an API server builds (they come first in the build order and need no model)."""


class Frontend:
    def __init__(self, workflow: ResolvedWorkflow, source: ModelSource, info: EngineInfo) -> None:
        self.workflow = workflow
        self.source = source
        self.info = info
        ctx = BuildContext.of(source, workflow)
        for kind in KINDS:
            rc = workflow.components[kind]
            ctx.components[kind] = rc.cls(rc.params, ctx)
        self.tokenizer = ctx.tokenizer
        self.input_processor = ctx.input_processor
        self.request_processor = ctx.request_processor
        self._budget = info.longest_input
        self.image_workers: int = self.request_processor.workers
        """Calls holding images decoded at once (as many as the request processor's `workers`): Pillow releases the interpreter lock, so concurrent single-image calls decode in parallel."""

    def make_request(self, inputs: Any, params: PoolingParams, request_id: str,
                     field: str | tuple[str, str]) -> Request:
        """`Engine.make_request`, on this side of the split: raises `RequestError` naming the field."""
        check_params(params, self.info)
        request = self.input_processor.process(request_id, inputs, params, field=field)
        check_spans(request)
        return request

    def is_large(self, requests: list[Request]) -> bool:
        """Whether tokenizing these requests should leave the event loop (see `background_chars`)."""
        return any(self.request_processor.is_large(r) for r in requests)

    @staticmethod
    def holds_images(requests: list[Request]) -> bool:
        """Whether these requests hold an image: tokenizing them decodes it, which never runs on the event loop."""
        return any(isinstance(r.prompt, ImagePrompt) for r in requests)

    def tokenize(self, requests: list[Request]) -> list[SchedulableRequest | RequestError]:
        """Tokenize and check lengths against the core's limits, decode and preprocess images; one result per
        request (never raises)."""
        return self.request_processor.process(requests, self._budget)


def core_request(request_id: str, token_ids: list[int], token_type_ids: list[int] | None,
                 params: PoolingParams) -> Request:
    """The core's view of a request the API server tokenized."""
    prompt = TokensPrompt(tuple(token_ids), tuple(token_type_ids) if token_type_ids is not None else None)
    return Request(request_id, prompt, params)


def core_image_request(request_id: str, pixel_values: Any, image_tokens: int, params: PoolingParams,
                       input_processor: Any) -> Request:
    """The core's view of an image the API server decoded and preprocessed: its pixel values are checked against
    this model (dtype and shape) by the input processor, as a prepared `ImagePrompt` passed from Python is, so an
    array that does not fit fails alone here instead of failing a batch in the model. Raises `RequestError` naming
    the input (kind "bad_image") when they do not fit, or when this workflow takes no images."""
    prompt = input_processor.image_prompt(ImagePrompt(pixel_values, image_tokens), "input")  # refused: text only
    return Request(request_id, prompt, params)
