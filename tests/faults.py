"""Fault-injection components: a tokenizer, input builder, model, pooler, runner, output processor and scheduler
that fail on purpose, and a pooler whose output is NaN for one input.

Each fails on a batch that carries the poison word (default "poison"), so a test knows the culprit; the runner
can also fail every Nth batch (a transient fault, as the soak benchmark injects). The tokenizer can also hold
texts longer than `hold_chars` until `HOLD` is set, to prove a slow tokenization does not block other requests.
`fault_bert` is slow on "slow" (`SLOW_S`) and hangs on "hang" until `UNHANG` is set (a hung engine step); with
`LOAD_GATE` in its environment it does not finish loading until that file exists (a slow model load, across
processes).

`register()` adds them to the process registry (idempotent); then a workflow names them, e.g.
``overrides=["model.name=fault_bert"]``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import torch
from pydantic import Field

from wde.components.base import BuildContext, Params
from wde.components.model_input_builder import ModelInput
from wde.components.model_input_builder import PackedInputBuilder
from wde.components.params import TorchRunnerParams
from wde.components.models.bert import BertModel
from wde.components.output_processor import EmbeddingOutputProcessor
from wde.components.pooler import Pooled, SentencePooler, SentencePoolerParams, segment_ids
from wde.components.runner import TorchRunner
from wde.components.scheduler import FCFSParams, FCFSScheduler, SchedulerOutput
from wde.components.tokenizer import HFTokenizer, HFTokenizerParams
from wde.registry import get_registry
from wde.request import TextPrompt, TokensPrompt

HOLD = threading.Event()
"""Released (set) by a test when the held tokenizations may finish."""
SLOW_S = 2.0
"""How long `fault_bert` takes on a batch carrying the word "slow"."""
UNHANG = threading.Event()
"""Set by a test to end the hang of a `fault_bert` batch carrying the word "hang"."""
HANG_GUARD_S = 120.0
"""A hung batch goes on by itself after this long, should a test fail before it sets `UNHANG`."""
LOAD_GATE = "WDE_TEST_LOAD_GATE"
"""The environment variable naming a file `fault_bert` waits for (up to `HANG_GUARD_S`) before it finishes loading."""


class InjectedFault(RuntimeError):
    """Raised by the components below; never by real code."""


def poison_id(ctx: BuildContext, word: str) -> int:
    """The single token id of `word` in the model's vocabulary (the marker the model-side faults look for)."""
    (ids, _), = ctx.tokenizer.encode([TextPrompt(word)])
    inner = [i for i in ids if i not in ctx.tokenizer.special_ids]
    if len(inner) != 1:
        raise ValueError(f"poison word {word!r} must be one token in this vocabulary, got {inner}")
    return inner[0]


def check(input_ids: torch.Tensor, poison: int, where: str) -> None:
    if bool((input_ids == poison).any()):
        raise InjectedFault(f"injected fault in the {where}")


class FaultTokenizerParams(HFTokenizerParams):
    poison: str = "poison"
    hold_chars: int = Field(0, ge=0, description="hold texts longer than this until HOLD is set; 0: never")


class FaultTokenizer(HFTokenizer):
    kind = "tokenizer"
    name = "fault_hf_tokenizer"
    Params = FaultTokenizerParams

    def encode(self, prompts: Sequence[Any], max_length: int | None = None, direction: Any = "right",
               options: Any = None) -> list:
        texts = [getattr(p, "text", "") + getattr(p, "text_pair", "") for p in prompts]
        if any(self.params.poison in t for t in texts):
            raise InjectedFault("injected fault in the tokenizer")
        if self.params.hold_chars and any(len(t) > self.params.hold_chars for t in texts):
            HOLD.wait(60)
        return super().encode(prompts, max_length, direction, options)


class PoisonParams(Params):
    poison: str = "poison"


class FaultBert(BertModel):
    kind = "model"
    name = "fault_bert"

    def __init__(self, params: Any, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._poison = poison_id(ctx, "poison")
        self._slow = poison_id(ctx, "slow")
        self._hang = poison_id(ctx, "hang")
        gate = os.environ.get(LOAD_GATE)
        deadline = time.monotonic() + HANG_GUARD_S
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        check(batch.input_ids, self._poison, "model")
        if bool((batch.input_ids == self._slow).any()):
            time.sleep(SLOW_S)  # a batch that keeps the device busy (works across processes, unlike HOLD)
        if bool((batch.input_ids == self._hang).any()):
            UNHANG.wait(HANG_GUARD_S)  # a hung step: the engine loop makes no progress until a test releases it
        return super().forward(batch)


class FaultPoolerParams(SentencePoolerParams):
    poison: str = "poison"


class FaultPooler(SentencePooler):
    kind = "pooler"
    name = "fault_sentence"
    Params = FaultPoolerParams

    def __init__(self, params: FaultPoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._poison = poison_id(ctx, params.poison)

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        check(batch.input_ids, self._poison, "pooler")
        return super().forward(hidden, batch)


class NaNPoolerParams(SentencePoolerParams):
    word: str = "nan"


class NaNPooler(SentencePooler):
    """A pooler whose rows are NaN for the sequences carrying the word (default "nan"): a model that gives a
    non-finite output for one input, which must fail that request alone and never reach a response body."""

    kind = "pooler"
    name = "nan_sentence"
    Params = NaNPoolerParams

    def __init__(self, params: NaNPoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._word = poison_id(ctx, params.word)

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        out = super().forward(hidden, batch)
        hit = torch.zeros(batch.num_seqs, dtype=torch.bool, device=hidden.device)
        hit[segment_ids(batch)[batch.input_ids == self._word]] = True
        out.rows = {k: torch.where(hit[:, None], float("nan"), v) for k, v in out.rows.items()}
        return out


class FaultRunnerParams(PoisonParams, TorchRunnerParams):
    fail_every: int = Field(0, ge=0, description="fail every Nth batch (a transient fault); 0: never")


class FaultRunner(TorchRunner):
    kind = "runner"
    name = "fault_torch"
    Params = FaultRunnerParams  # type: ignore[assignment]

    def __init__(self, params: FaultRunnerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._poison = poison_id(ctx, params.poison)
        self.calls = 0
        self.faults = 0

    def run(self, batch: ModelInput) -> tuple[Pooled, float]:
        self.calls += 1
        if self.params.fail_every and self.calls % self.params.fail_every == 0:
            self.faults += 1
            raise InjectedFault(f"injected transient fault in batch {self.calls}")
        check(batch.input_ids, self._poison, "runner")
        return super().run(batch)


def _poisoned(batch: SchedulerOutput, word: str) -> bool:
    return any(word in getattr(s.request.prompt, "text", "") for s in batch.scheduled)


class FaultInputBuilder(PackedInputBuilder):
    kind = "model_input_builder"
    name = "fault_packed"
    Params = PoisonParams

    def build(self, batch: SchedulerOutput) -> ModelInput:
        if _poisoned(batch, self.params.poison):
            raise InjectedFault("injected fault in the model input builder")
        return super().build(batch)


class FaultOutputProcessor(EmbeddingOutputProcessor):
    kind = "output_processor"
    name = "fault_embedding"
    Params = PoisonParams

    def process(self, batch: SchedulerOutput, pooled: Pooled, inference_time: float) -> list:
        if _poisoned(batch, self.params.poison):
            raise InjectedFault("injected fault in the output processor")
        return super().process(batch, pooled, inference_time)


class FaultSchedulerParams(FCFSParams):
    crash_word: str = "crash"


class FaultScheduler(FCFSScheduler):
    """Raises out of `schedule()` itself (a scheduler bug, not one request's fault) while a waiting request
    contains the crash word: the engine loop's supervisor must restart the loop."""

    kind = "scheduler"
    name = "fault_fcfs"
    Params = FaultSchedulerParams

    def __init__(self, params: FaultSchedulerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._crash_id = poison_id(ctx, params.crash_word)

    def schedule(self) -> SchedulerOutput:
        if any(self._crashes(r.prompt) for r in list(self._waiting)):
            raise InjectedFault("injected crash in the scheduler")
        return super().schedule()

    def _crashes(self, prompt: Any) -> bool:
        if isinstance(prompt, TokensPrompt):  # tokenized by an API server (wde serve --api-servers N)
            return self._crash_id in prompt.token_ids
        return self.params.crash_word in getattr(prompt, "text", "")


FAULT_COMPONENTS = (FaultTokenizer, FaultBert, FaultPooler, FaultRunner, FaultScheduler, FaultInputBuilder,
                    FaultOutputProcessor, NaNPooler)


def register() -> None:
    registry = get_registry()
    for component in FAULT_COMPONENTS:
        if component.name not in registry.components.get(component.kind, {}):
            registry.add_component(component, plugin="tests.faults")
