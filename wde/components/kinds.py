"""The contract of each component kind: one base class per kind, with every attribute and method that callers of
that kind may use, and its default.

A component of kind K subclasses K's base (`KIND_BASES`; the registry refuses one that does not, by name), so the
engine, the server and other components read these attributes plainly: a default written here is what a component
that does not set the attribute has, never a `getattr(component, name, default)` guess at the call site. A method
whose default raises `NotImplementedError` is one every component of the kind implements.

This module imports no torch (validating a workflow checks kinds without it); the torch-side bases build on these:
`PrefillModel` is a `Model`, `AttentionBackend` an `Attention`, and the `scorer` kind's base is
`wde.components.scorer.Scorer`.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterator, Literal, Mapping, Sequence, TypeVar

from wde.components.base import Component
from wde.errors import RequestError

if TYPE_CHECKING:
    from concurrent.futures import Future

    from wde.request import PairPrompt, PoolingParams, Prompt, Request, RequestOutput, SchedulableRequest

T = TypeVar("T")


class Tokenizer(Component):
    """`tokenizer`: turns prompts into token ids (built first; the request processor is its one caller per batch)."""

    kind = "tokenizer"
    max_length: int
    """The longest input in tokens, special tokens included (required: set it in `__init__`)."""
    hf_tokenizer: Any = None
    """The Hugging Face tokenizer behind it (`tokenize`, `/tokenize` and the prompt-token count use it); None when
    there is none."""
    vocab_size: int
    """The model's vocabulary size: token ids a caller gives must be below it (required)."""

    def encode(self, prompts: Sequence[Prompt], max_length: int | None = None, direction: str = "right",
               options: Sequence[Mapping[str, str] | None] | None = None) -> list[tuple[list[int], list[int] | None]]:
        """(token ids, token type ids or None) per prompt, truncated to `max_length` from `direction`; `options`
        are each prompt's per-request options (None: none), in order."""
        raise NotImplementedError

    def min_pair_length(self, prompt: PairPrompt) -> int:
        """The fewest tokens `prompt` can be truncated to (its first text whole, special tokens, one token of the
        second); 0 by default (a tokenizer that takes no pairs)."""
        return 0


class InputProcessor(Component):
    """`input_processor`: validates what a caller sent and wraps it as a `Request`, cheaply (no tokenizing)."""

    kind = "input_processor"
    prompts: Mapping[str, str] = {}
    """Named instruction prefixes (`prompt_name`), listed by the server's `/info`; none by default."""
    pairs: Literal["forbid", "allow", "require"] = "forbid"
    """Whether inputs are (text, text_pair) pairs: forbidden (an embedder), allowed, or required (a cross-encoder)."""
    takes_images: ClassVar[bool] = False
    """Whether `image_prompt` and `preprocess` accept images; False: a text-only input processor."""
    image_token_id: int | None = None
    """The token id an image takes in the text sequence, for models that splice images into text; None otherwise."""

    def process(self, request_id: str, inputs: Any, params: PoolingParams | None = None,
                field: Any = "input") -> Request:
        """One validated request; `RequestError` naming `field` when the input is refused."""
        raise NotImplementedError

    def check_text(self, value: Any, field: str) -> str:
        """`value` when it is a usable text, else `RequestError` naming `field`; by default any str."""
        if not isinstance(value, str):
            raise RequestError(f"{field} must be a string, got {type(value).__name__}", field)
        return value

    def check_request(self, requests: Sequence[Request], names: Sequence[Any]) -> None:
        """Refuse a whole server request (e.g. images adding up to too many pixels), naming the input; nothing by
        default."""

    def image_prompt(self, value: Any, field: str) -> Any:
        """Check one image input and return its prompt; by default (`takes_images` False) the input is refused."""
        raise RequestError(f"{field} is an image, but input processor {self.name!r} of this workflow takes texts"
                           " only", field, kind="bad_image")

    def preprocess(self, prompt: Any, field: str = "input") -> Any:
        """The pixel values of an admitted image prompt; by default (`takes_images` False) refused."""
        raise RequestError(f"{field} is an image, but input processor {self.name!r} of this workflow takes texts"
                           " only", field, kind="bad_image")


class RequestProcessor(Component):
    """`request_processor`: tokenizes scheduled requests and checks their length."""

    kind = "request_processor"
    max_length: int
    """The longest input in tokens (the tokenizer's; required)."""
    workers: int = 1
    """Threads that decode images at once; 1 for a text-only request processor."""

    def is_large(self, request: Request) -> bool:
        """Whether `request` is tokenized off the scheduling thread (and off the server's event loop); False by
        default."""
        return False

    def process(self, requests: Sequence[Request], token_budget: int) -> list[SchedulableRequest | RequestError]:
        """One result per request, in order: a tokenized request or the error refusing it. Never raises.
        `token_budget`: the longest input the scheduler admits (`Scheduler.longest_input`)."""
        raise NotImplementedError


class Scheduler(Component):
    """`scheduler`: queues requests and picks each batch (plain Python, no torch)."""

    kind = "scheduler"
    token_budget: int
    """The most tokens in one batch (required), but for a batch of one sequence longer than that (up to
    `longest_input`)."""
    longest_input: int | None = None
    """The longest input admitted, in tokens; None: `token_budget`."""
    max_num_requests: int | None = None
    """The most requests in one batch; None: only the token budget bounds it."""
    num_waiting: int = 0
    """Requests queued and not yet scheduled (a property in a real scheduler; /metrics and load reports read it)."""
    queued_tokens: int = 0
    """Tokens of the queued requests tokenized so far."""

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Drop a request not yet scheduled; an unknown id is ignored."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def schedule(self) -> Any:
        """The next `SchedulerOutput` (possibly empty)."""
        raise NotImplementedError

    def clear(self) -> list[str]:
        """Drop every queued request (the engine resets after an internal failure) and return their ids; the
        default drops nothing."""
        return []


class ModelInputBuilder(Component):
    """`model_input_builder`: packs a scheduled batch into the one `ModelInput` the runner hands the model."""

    kind = "model_input_builder"

    def build(self, batch: Any) -> Any:
        raise NotImplementedError


class Attention(Component):
    """`attention`: the attention backend (its torch-side base is `AttentionBackend`). The flags say what a backend
    supports; a model that needs what its backend lacks refuses to build. Its `Params` subclass `AttentionParams`
    (`causal`: the mask a workflow asks for; models read `params.causal`)."""

    kind = "attention"
    supports_bias: ClassVar[bool] = False
    """Whether it accepts an additive attention bias."""
    supports_window: ClassVar[bool] = False
    """Whether it accepts a local-attention window."""
    supports_key_mask: ClassVar[bool] = False
    """Whether it honours a batch's key mask."""


class Model(Component):
    """`model`: hidden states of packed tokens (its torch-side base is `PrefillModel`)."""

    kind = "model"
    uses_attention_bias: ClassVar[bool] = False
    """Whether it hands its attention backend an additive bias (the backend must support it)."""
    uses_attention_window: ClassVar[bool] = False
    """Whether it uses local attention windows."""
    pools: ClassVar[bool] = False
    """True: `forward` returns one embedding per sequence (width `embedding_size`), not token states."""
    has_mlm_head: ClassVar[bool] = False
    """True: `mlm_logits(hidden)` gives vocabulary logits per token, `mlm_vocab_size` wide (the SPLADE pooler needs
    it)."""
    mlm_vocab_size: int | None = None
    """The width of `mlm_logits`; None without an MLM head."""
    dtype: Any = None
    """The torch dtype its outputs have; None: not stated (then the dtype of its first parameter is reported)."""
    lora: Any = None
    """Its LoRA adapters (`LoraSet`), when it takes any; None otherwise."""
    hidden_size: int
    """Width of the hidden states `forward` returns (required)."""

    def parameters(self) -> Iterator[Any]:
        """Its weights (torch parameters; `nn.Module.parameters` in a torch model); none by default. `/info`
        reports the first one's device, and its dtype where `dtype` is None."""
        return iter(())

    def mlm_logits(self, hidden: Any) -> Any:
        """Vocabulary logits per token; only a model with `has_mlm_head` has them."""
        raise NotImplementedError(f"model {self.name!r} has no MLM head")


class Pooler(Component):
    """`pooler`: pools a batch's hidden states into outputs (`forward(hidden, batch) -> Pooled`)."""

    kind = "pooler"
    outputs: tuple[str, ...] = ()
    """The outputs it produces ('dense', 'sparse', 'score', 'colbert', ...; required in practice)."""
    dense_size: int | None = None
    """The width of its 'dense' output; a pooler producing 'dense' sets it (the engine refuses to build without)."""
    labels: Sequence[str] | None = None
    """A classifier's label names, by class index; None: the engine reports the config's `id2label`."""
    mode: str | None = None
    """How it pools ('mean', 'cls', ...), as `/info` reports it; None: the workflow's pooler name is reported."""

    def forward(self, hidden: Any, batch: Any) -> Any:
        raise NotImplementedError


class Runner(Component):
    """`runner`: the device side of a step: runs the model and pooler on a `ModelInput`."""

    kind = "runner"

    def run(self, batch: Any) -> tuple[Any, float]:
        """(pooled outputs on CPU, seconds spent)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release threads (e.g. the CPU streams'); the engine calls it when closed. Nothing by default."""


class Executor(Component):
    """`executor`: how runner calls are issued. `submit` returns a future of (pooled outputs, seconds)."""

    kind = "executor"
    max_inflight: int = 1
    """Batches pending at once."""

    def submit(self, batch: Any) -> "Future[tuple[Any, float]]":
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release threads; the engine calls it when closed. Nothing by default."""

    @classmethod
    def place(cls, fn: Callable[[], T]) -> T:
        """Run `fn` where this executor runs its batches and return its result (or raise its error): the engine
        builds its components and runs its load probe through it, so that a model loads, packs its weights and first
        runs on the thread that will compute with it. The calling thread by default."""
        return fn()

    def host_work(self) -> ContextManager[None]:
        """Entered by `Engine.step` around its own work (scheduling, packing, output conversion) on the thread that
        steps the engine. Nothing by default (a `sync` executor computes inside it); an executor that computes on
        a thread of its own keeps the stepping thread's torch ops off the cores' thread pool there."""
        return contextlib.nullcontext()


class OutputProcessor(Component):
    """`output_processor`: slices a batch's pooled outputs into one `RequestOutput` per request."""

    kind = "output_processor"

    def process(self, batch: Any, pooled: Any, inference_time: float) -> list[RequestOutput]:
        raise NotImplementedError


KIND_BASES: dict[str, str] = {
    "tokenizer": "wde.components.kinds:Tokenizer",
    "input_processor": "wde.components.kinds:InputProcessor",
    "request_processor": "wde.components.kinds:RequestProcessor",
    "scheduler": "wde.components.kinds:Scheduler",
    "model_input_builder": "wde.components.kinds:ModelInputBuilder",
    "attention": "wde.components.kinds:Attention",
    "model": "wde.components.kinds:Model",
    "pooler": "wde.components.kinds:Pooler",
    "scorer": "wde.components.scorer:Scorer",
    "runner": "wde.components.kinds:Runner",
    "executor": "wde.components.kinds:Executor",
    "output_processor": "wde.components.kinds:OutputProcessor",
}
"""Each kind's base class ("module:Name"); none of these modules imports torch."""


def kind_base(kind: str) -> type[Component]:
    """The base class every component of `kind` subclasses."""
    module, _, name = KIND_BASES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def public_base_name(kind: str) -> str:
    """How a plugin imports `kind`'s base: its name in `wde.api`."""
    return KIND_BASES[kind].partition(":")[2]
