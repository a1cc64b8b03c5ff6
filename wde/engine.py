"""The engine: builds a workflow's components and runs the one-way step loop.

    request → input processor → scheduler (→ request processor) → input builder → executor/runner
            → pooler → output processor → RequestOutput

`step()` is synchronous and is all offline use needs; the executor decides whether device work overlaps
with preparing the next batch.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from wde import collector
from wde.components.base import COMPONENT_KINDS, BuildContext
from wde.chunking import ChunkMerger
from wde.components.pooler import ChunkedPooling, Pooled, SpanPooling
from wde.components.scheduler import SchedulerOutput
from wde.components.scorer import Scorer, scoring_plan
from wde.device import default_device
from wde.engine_info import EngineInfo
from wde.errors import ModelLoadError, RequestError, internal_error, one_line
from wde.kernels.cpp_build import start_builds
from wde.late_chunking import Document, LateChunk, check_spans, join, prepare, refuse_spans
from wde.model_source import ModelSource
from wde.registry import Registry, get_registry
from wde.request import PoolingParams, Request, RequestOutput, SchedulableRequest
from wde.token_pool import TokenPool
from wde.workflow import ResolvedWorkflow, load_workflow, overrides_to_paths


log = logging.getLogger("wde.engine")

Done = tuple[SchedulableRequest, RequestOutput]
"""A scheduled sequence and its output (a chunk's goes to `ChunkMerger` before its request's is finished)."""

SOLO_ATTEMPTS = 2
"""Runs a request gets in a batch of its own before its failure is final (the first failure may be transient)."""


PROBE_TEXT = "hello world, the load probe checks that this model gives finite outputs"
PROBE_PAIR = ("hello", "world, the load probe checks that this model gives finite outputs")
"""The input `Engine` runs once when it is built (a pair for workflows that score pairs), see `Engine._probe`;
truncated to the workflow's max length (a pair's first text is kept whole: it is one word)."""


class NonFiniteOutput(RuntimeError):
    """A model or pooler produced NaN or infinity for a request; that request fails, its numbers are never sent."""


def _all_finite(t: torch.Tensor) -> bool:
    """Cheap test: one sum, which is NaN or infinite whenever any element is (a finite sum that overflows is a
    false alarm the exact per-row test below clears)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    return bool(torch.isfinite((t.float() if t.element_size() < 4 else t).sum()))


def nonfinite_rows(pooled: Pooled) -> dict[int, str]:
    """Index of each request (row) of a batch's pooled outputs holding a NaN or infinity → the name of the first
    such output. Empty, at the cost of one sum per output tensor, when all is finite (the usual case)."""
    bad: dict[int, str] = {}
    for name, t in pooled.rows.items():
        if not _all_finite(t):
            rows = ~torch.isfinite(t).reshape(t.shape[0], -1).all(dim=1)
            for i in rows.nonzero().flatten().tolist():
                bad.setdefault(i, name)
    for name, (flat, bounds) in pooled.ragged.items():
        if not _all_finite(flat):
            tokens = (~torch.isfinite(flat).reshape(flat.shape[0], -1).all(dim=1)).long()
            seen = torch.cat([tokens.new_zeros(1), tokens.cumsum(0)])
            b = torch.tensor(bounds, device=seen.device)
            for i in ((seen[b[1:]] - seen[b[:-1]]) > 0).nonzero().flatten().tolist():
                bad.setdefault(i, name)
    return bad


def select_rows(pooled: Pooled, keep: Sequence[int]) -> Pooled:
    """The pooled outputs of requests `keep` (indices into the batch, in order) as those of a smaller batch."""
    index = torch.tensor(list(keep), dtype=torch.long)
    rows = {k: v[index.to(v.device)] for k, v in pooled.rows.items()}
    ragged = {}
    for k, (flat, b) in pooled.ragged.items():
        parts = [flat[b[i]:b[i + 1]] for i in keep]
        ragged[k] = (torch.cat(parts) if parts else flat[:0],
                     list(itertools.accumulate((b[i + 1] - b[i] for i in keep), initial=0)))
    return Pooled(rows, ragged)


@dataclass(frozen=True)
class BatchStats:
    """One finished batch: how many requests and tokens, and the device seconds it took."""

    num_requests: int
    num_tokens: int
    seconds: float


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds at one moment, as an autoscaler reads it (/metrics: `wde_queue_depth`,
    `wde_queued_tokens`, `wde_running_inputs`, `wde_running_tokens`)."""

    queued_inputs: int
    """Inputs (chunks of a chunked one) waiting to be scheduled."""
    queued_tokens: int
    """Tokens of the queued inputs tokenized so far: the scheduler tokenizes about one batch ahead, so a deep queue
    shows in `queued_inputs` first."""
    running_inputs: int
    """Inputs in batches handed to the device and not finished."""
    running_tokens: int


def resolve(workflow: str | Path | None = None, model: str | Path | None = None, *,
            overrides: Iterable[str] | None = None, trust_remote_code: bool = False, dtype: str | None = None,
            device: str | None = None, registry: Registry | None = None, lora_modules: Mapping[str, str] | None = None,
            quantization: str | None = None,
            **component_overrides: Mapping[str, Any]) -> tuple[ResolvedWorkflow, ModelSource]:
    """The workflow and model source `Engine.from_workflow` builds from (same arguments); an API server of a
    split engine resolves them too, to build the components it runs itself (tokenizer, input processor)."""
    source = ModelSource.from_model(model, trust_remote_code=trust_remote_code)
    registry = registry or get_registry()
    if workflow is None:
        workflow = registry.workflow_for(source.architectures, source)
    shortcuts = [(("model", "params", k), v) for k, v in (("dtype", dtype), ("device", device),
                                                         ("quantization", quantization)) if v is not None]
    if lora_modules:
        shortcuts.append((("model", "params", "lora", "modules"), {k: str(v) for k, v in lora_modules.items()}))
    resolved = load_workflow(workflow, overrides_to_paths(overrides) + overrides_to_paths(component_overrides) + shortcuts,
                             registry=registry)
    served = set(resolved.architectures)
    if served and source.architectures and not served & set(source.architectures):
        raise ModelLoadError(
            f"workflow {resolved.name!r} serves {sorted(served)} but {source.path} is {source.architectures};"
            " pick a matching workflow (wde inspect / docs/workflows.md)")
    return resolved, source


def check_params(params: PoolingParams | None, info: EngineInfo) -> None:
    """Refuse request params the workflow (`info`) cannot honour: an output it does not produce, too many
    dimensions, chunked processing where the pooler has no `ChunkedPooling` or for an output other than 'dense',
    spans where it is no `SpanPooling` or with truncation or chunking (`refuse_spans`), an option no component
    declares (`check_options`)."""
    if params is None:
        return
    workflow, outputs, dense_size, chunkable = info.workflow, info.outputs, info.dense_size, info.chunkable
    if params.options:
        check_options(params.options, info.options, workflow)
    if params.spans is not None:
        refuse_spans(params, info.span_pooling and "dense" in outputs, workflow)
    if params.chunk and not params.truncate and params.max_tokens is None:
        others = [o for o in (params.outputs or ("dense",)) if o != "dense"]
        if not chunkable or "dense" not in outputs or others:
            what = f"outputs {others}" if others and chunkable else f"workflow {workflow!r}"
            raise RequestError(f"chunked processing of long inputs (chunk) gives dense embeddings only, and {what}"
                               " cannot be chunked; send truncate=true or shorter inputs", "chunk")
    if params.outputs is not None:
        unknown = [o for o in params.outputs if o not in outputs]
        if unknown:
            raise RequestError(f"outputs {unknown} are not produced by workflow {workflow!r};"
                               f" it produces {list(outputs)}", "outputs")
    if params.dimensions is not None and dense_size is not None and params.dimensions > dense_size:
        raise RequestError(f"dimensions={params.dimensions} is larger than the model's embedding size"
                           f" {dense_size}", "dimensions")


def check_options(options: Mapping[str, str], declared: Mapping[str, tuple[str, ...]], workflow: str) -> None:
    """Refuse a per-request option (`PoolingParams.options`) that no component declares, or a value it does not
    take, naming `options.NAME` and what the workflow takes."""
    for name, value in options.items():
        if name not in declared:
            takes = f"it takes {', '.join(sorted(declared))}" if declared else "it takes none"
            raise RequestError(f"option {name!r} is not an option of workflow {workflow!r}; {takes}",
                               f"options.{name}")
        if value not in declared[name]:
            raise RequestError(f"option {name}={value!r} is not one workflow {workflow!r} takes; give one of"
                               f" {', '.join(declared[name])}", f"options.{name}")


def declared_options(components: Mapping[str, Any], workflow: str) -> dict[str, tuple[str, ...]]:
    """Every per-request option the components declare (`Component.request_options`), with its values; two
    components reading one option must agree on its values (else the workflow cannot be built)."""
    declared: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for kind, component in components.items():
        for name, values in component.request_options().items():
            if name in declared and declared[name] != tuple(values):
                raise ModelLoadError(f"workflow {workflow!r}: {owner[name]} and {kind} declare option {name!r} with"
                                     f" different values ({list(declared[name])} and {list(values)})")
            declared[name], owner[name] = tuple(values), kind
    return declared


def cpu_kernels(workflow: ResolvedWorkflow) -> list[str]:
    """The host-compiled C++ kernels the workflow's components call on CPU (`Component.cpu_kernels`), once each."""
    return list(dict.fromkeys(k for rc in workflow.components.values() for k in rc.cls.cpu_kernels(rc.params)))


class Engine:
    """A built workflow, ready to take requests. Create one with `Engine.from_workflow`."""

    def __init__(self, workflow: ResolvedWorkflow, source: ModelSource) -> None:
        self.workflow = workflow
        self.source = source
        if default_device().type == "cpu":  # a first start's kernel compiles, beside each other and the model's load
            start_builds(cpu_kernels(workflow))
        ctx = BuildContext.of(source, workflow)
        # built where the executor runs its batches (`Executor.place`): a `thread` executor's device thread, so that
        # the model loads and first runs on the thread that computes with it (on CPU, one OpenMP pool)
        place = workflow.components["executor"].cls.place

        def build() -> None:
            for kind in COMPONENT_KINDS:
                rc = workflow.components[kind]
                try:
                    ctx.components[kind] = rc.cls(rc.params, ctx)
                except (ModelLoadError, ValueError) as e:
                    raise ModelLoadError(f"workflow {workflow.name!r}: building {kind} {rc.name!r} failed:"
                                         f" {e}") from None

        place(build)
        self.components = dict(ctx.components)
        self.tokenizer = ctx.tokenizer
        self.input_processor = ctx.input_processor
        self.scheduler = ctx.scheduler
        self.input_builder = ctx.model_input_builder
        self.executor = ctx.executor
        self.output_processor = ctx.output_processor
        self.max_length: int = ctx.request_processor.max_length
        self.supported_outputs: tuple[str, ...] = tuple(ctx.pooler.outputs)
        """What this workflow produces (e.g. ("dense",), ("score",)); the server routes on it."""
        self.dense_size: int | None = None
        """Width of the 'dense' output, so a too-large `dimensions` is refused before any work is done."""
        if "dense" in self.supported_outputs:
            self.dense_size = ctx.pooler.dense_size
            if not isinstance(self.dense_size, int):
                raise ModelLoadError(f"workflow {workflow.name!r}: pooler {workflow.components['pooler'].name!r}"
                                     " produces 'dense' but does not declare its width as `dense_size`")
        self.chunkable: bool = isinstance(ctx.pooler, ChunkedPooling)
        """Whether long inputs may be embedded in chunks (`PoolingParams.chunk`, wde/chunking.py)."""
        self._chunks = ChunkMerger(ctx.pooler.finish_chunks if self.chunkable else None)
        self.span_pooling: bool = isinstance(ctx.pooler, SpanPooling) and ctx.pooler.pools_spans()
        """Whether token spans of an input may be pooled (`PoolingParams.spans`, late chunking: `late_chunk`)."""
        self.scorer: Scorer = ctx.scorer
        """How this workflow scores a query against documents (`score`, `rerank`, the server's scoring routes)."""
        self.request_options: dict[str, tuple[str, ...]] = declared_options(self.components, workflow.name)
        """The per-request options this workflow takes (`PoolingParams.options`), each with its values."""
        self.info: EngineInfo = EngineInfo.of(self)
        """What the API needs to know about this engine, as plain data (also what requests are checked against)."""
        self.on_batch: Callable[[BatchStats], None] | None = None
        """Called (on the thread running `step`) after each finished batch; the server's metrics use it."""
        self._ids = itertools.count()
        self._inflight: deque[tuple[SchedulerOutput, Future[tuple[Pooled, float]]]] = deque()
        self._retry: deque[SchedulerOutput] = deque()
        """Halves of failed batches, run before anything new until the culprit is alone (see `_failed`)."""
        self._failed_alone: dict[str, int] = {}
        """Request id → times it failed in a batch of its own (a request gets `SOLO_ATTEMPTS` tries)."""
        self.token_pool: TokenPool | None = None
        """Tokens shared with the other engines of this process (`wde/token_pool.py`): each batch takes its tokens
        before its forward and gives them back after; None: only this engine's own budget bounds its batches."""
        self.pool_owner = ""
        """The name this engine holds pool tokens under (its served model's)."""
        try:
            place(self._probe)
        except BaseException:
            self.close()
            raise

    def _probe(self) -> None:
        """Run one short input (`PROBE_TEXT`, or `PROBE_PAIR` where the workflow scores pairs) through the
        tokenizer, model and pooler, asking for every output, and refuse a model whose output is not finite:
        weights whose header is intact but whose data is garbage, or a dtype the model overflows in."""
        where = f"model folder {self.source.path}"
        pairs = self.input_processor.pairs
        try:
            request = self.make_request(PROBE_PAIR if pairs == "require" else PROBE_TEXT,
                                        PoolingParams(truncate=True, outputs=self.supported_outputs), "wde-load-probe")
            (ready,) = self.components["request_processor"].process([request], self.max_length)
            if isinstance(ready, RequestError):
                raise ready
            pooled, _ = self.components["runner"].run(self.input_builder.build(SchedulerOutput([ready])))
            bad = nonfinite_rows(pooled)
        except Exception as e:  # noqa: BLE001 - a model that cannot run a short input is refused at start-up
            log.debug("the load probe failed", exc_info=e)
            raise ModelLoadError(f"{where}: the probe input run at load failed: {type(e).__name__}:"
                                 f" {one_line(e)}") from None
        if bad:
            dtype = self.components["model"].dtype
            overflow = (f", or the model overflows in {str(dtype).removeprefix('torch.')} (try --set"
                        " model.params.dtype=float32)") if dtype in (torch.float16, torch.bfloat16) else ""
            name = next(iter(bad.values()))
            raise ModelLoadError(f"{where} gives NaN or infinite values (output {name!r}) for a short probe input run"
                                 f" at load: its weights are corrupt{overflow}")

    @classmethod
    def from_workflow(
        cls,
        workflow: str | Path | None = None,
        model: str | Path | None = None,
        *,
        overrides: Iterable[str] | None = None,
        trust_remote_code: bool = False,
        dtype: str | None = None,
        device: str | None = None,
        registry: Registry | None = None,
        lora_modules: Mapping[str, str | Path] | None = None,
        quantization: str | None = None,
        **component_overrides: Mapping[str, Any],
    ) -> "Engine":
        """Build an engine from a workflow file or registered name.

        :param workflow: path or registered name; None picks the workflow registered for the model's
            `architectures`.
        :param model: a local model folder or a hub id in the local cache; None serves the bundled default.
        :param overrides: CLI-style strings, e.g. ``["scheduler.params.max_num_batched_tokens=8192"]``.
        :param dtype, device: shortcuts for ``model.params.dtype`` / ``model.params.device``.
        :param registry: resolve names in this registry instead of the installed one (test a plugin without
            installing it: ``Registry.from_plugin_manager(pm)``); the architecture check applies as usual.
        :param lora_modules: LoRA adapters by name → PEFT folder, a shortcut for ``model.params.lora.modules``;
            a request picks one with ``PoolingParams(options={"adapter": NAME})`` (docs/adapters.md).
        :param quantization: a shortcut for ``model.params.quantization`` ("int8": docs/int8.md).
        :param component_overrides: per-kind dicts merged into the workflow, e.g.
            ``scheduler={"params": {"max_num_requests": 8}}`` (the model kind: use `overrides`).
        """
        return cls(*resolve(workflow, model, overrides=overrides, trust_remote_code=trust_remote_code, dtype=dtype,
                            device=device, registry=registry, lora_modules=lora_modules, quantization=quantization,
                            **component_overrides))

    def make_request(self, inputs: Any, params: PoolingParams | None = None, request_id: str | None = None,
                     field: str | tuple[str, str] = "input") -> Request:
        """Validate one input and its params at the engine's edge (cheap: no tokenization).

        Raises `RequestError` naming the field, e.g. for an output this workflow does not produce. `field` is
        how errors name the input (a pair may name each side: ``("query", "documents[3]")``).
        """
        check_params(params, self.info)
        request = self.input_processor.process(request_id or f"req-{next(self._ids)}", inputs, params, field=field)
        check_spans(request)
        return request

    def add_request(self, inputs: Any, params: PoolingParams | None = None, request_id: str | None = None) -> str:
        """Validate one input (no tokenization) and queue it; raise `RequestError` on bad input."""
        request = self.make_request(inputs, params, request_id)
        self.scheduler.add(request)
        return request.request_id

    def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Load the PEFT LoRA folder `path` as adapter `name` while the engine serves: requests may name it (option
        `adapter`) once this returns. Needs a model built with adapters enabled (`model.params.lora`: `modules` or
        `enable: true`); the bound is `lora.max_adapters`. Raises `ModelLoadError` naming what is wrong."""
        self._adapters().load_peft(name, path)
        self._options_changed()

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter `name`: requests naming it are refused from now on, and queued ones fail naming it."""
        self._adapters().remove(name)
        self._options_changed()

    def _adapters(self) -> Any:
        lora = self.components["model"].lora
        if lora is None or lora.table.option != "adapter":
            raise ModelLoadError(f"workflow {self.workflow.name!r} was not started with LoRA adapters enabled; set"
                                 " model.params.lora.enable=true (or name adapters in model.params.lora.modules)")
        return lora

    def _options_changed(self) -> None:
        self.request_options = declared_options(self.components, self.workflow.name)
        self.info = replace(self.info, options=dict(self.request_options))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def load(self) -> EngineLoad:
        """Queued and running inputs and tokens (safe to read from another thread while the engine steps)."""
        batches = [batch for batch, _ in list(self._inflight)] + list(self._retry)
        return EngineLoad(int(self.scheduler.num_waiting), int(self.scheduler.queued_tokens),
                          sum(len(b.scheduled) for b in batches), sum(b.num_tokens for b in batches))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._inflight) or bool(self._retry)

    def step(self) -> list[RequestOutput]:
        """Schedule and submit batches up to the executor's in-flight limit; finish the oldest one.

        A request's failure costs only that request: the scheduler rejects bad inputs one by one, and a batch
        that fails anywhere from packing to output conversion is split and retried until the culprit runs alone.
        """
        with self.executor.host_work():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        done: list[tuple[SchedulableRequest, RequestOutput]] = []
        while len(self._inflight) < self.executor.max_inflight:
            if self._retry:
                batch = self._retry.popleft()
            else:
                batch = self.scheduler.schedule()
                finished.extend(batch.rejected)
            if not batch.scheduled:
                break
            taken = self._take_tokens(batch)
            if taken == 0:  # the shared pool is short and a batch of ours is in flight: finish that one first
                self._retry.appendleft(batch)
                break
            try:
                future = self.executor.submit(self.input_builder.build(batch))
            except Exception as e:  # noqa: BLE001 - isolated by `_failed`
                self._give_tokens(taken)
                done.extend(self._failed(batch, e, "model input builder"))
            else:
                future.add_done_callback(lambda _, pool=self.token_pool, taken=taken: self._give_tokens(taken, pool))
                self._inflight.append((batch, future))
        if self._inflight:
            batch, future = self._inflight.popleft()
            try:
                pooled, seconds = future.result()
                served, pooled, failed = self._drop_nonfinite(batch, pooled)
                if served.scheduled:
                    failed += zip(served.scheduled, self.output_processor.process(served, pooled, seconds))
            except Exception as e:  # noqa: BLE001 - isolated by `_failed`
                done.extend(self._failed(batch, e, "model or output processor"))
            else:
                done.extend(failed)
                if self._failed_alone:
                    for _, o in failed:
                        self._failed_alone.pop(o.request_id, None)
                self._report(BatchStats(len(batch.scheduled), batch.num_tokens, seconds))
        for scheduled, out in done:
            merged = self._chunks.add(scheduled, out)
            if merged is not None:
                finished.append(merged)
        return finished

    def _take_tokens(self, batch: SchedulerOutput) -> int | None:
        """Take `batch`'s tokens from the shared pool: None without a pool, 0 where the pool is short and a batch
        of this engine is in flight (never wait then: collect and deliver that batch first), else the tokens taken,
        waiting for the other engines' forwards where nothing of ours is in flight."""
        if self.token_pool is None:
            return None
        taken = self.token_pool.take(self.pool_owner, batch.num_tokens, wait=not self._inflight)
        return 0 if taken is None else taken

    def _give_tokens(self, taken: int | None, pool: TokenPool | None = None) -> None:
        """Give back what `_take_tokens` took, to `pool` (the one it was taken from; default: this engine's)."""
        pool = pool or self.token_pool
        if taken is not None and pool is not None:
            pool.give(self.pool_owner, taken)

    @staticmethod
    def _drop_nonfinite(batch: SchedulerOutput, pooled: Pooled) -> tuple[SchedulerOutput, Pooled, list[Done]]:
        """Fail each request whose pooled output holds a NaN or infinity (a 500 naming it, logged); the batch
        and outputs of the others, unchanged in the usual case where every value is finite."""
        bad = nonfinite_rows(pooled)
        if not bad:
            return batch, pooled, []
        failed = []
        for i, name in sorted(bad.items()):
            rid = batch.scheduled[i].request.request_id
            error = NonFiniteOutput(f"output {name!r} of the model holds NaN or infinite values")
            failed.append((batch.scheduled[i], RequestOutput(rid, error=internal_error(rid, error, "model output"))))
        keep = [i for i in range(len(batch.scheduled)) if i not in bad]
        return SchedulerOutput([batch.scheduled[i] for i in keep]), select_rows(pooled, keep), failed

    def _report(self, stats: BatchStats) -> None:
        if self.on_batch is None:
            return
        try:
            self.on_batch(stats)
        except Exception:  # noqa: BLE001 - a metrics callback must never cost a request or the loop
            log.exception("the on_batch callback failed; the batch's results are delivered anyway")

    def _failed(self, batch: SchedulerOutput, error: Exception, where: str) -> list[Done]:
        """Split a failed batch in two and queue both halves for retry. A request failing alone is retried once
        more (the fault may have been transient); failing alone twice, it has failed."""
        if len(batch.scheduled) > 1:
            half = len(batch.scheduled) // 2
            log.warning("a batch of %d requests failed in %s (%s: %s); retrying it in halves to isolate the cause",
                        len(batch.scheduled), where, type(error).__name__, error)
            self._retry.extendleft([SchedulerOutput(batch.scheduled[half:]), SchedulerOutput(batch.scheduled[:half])])
            return []
        rid = batch.scheduled[0].request.request_id
        if isinstance(error, RequestError) and error.kind != "internal":  # the request's own fault, named (an
            self._failed_alone.pop(rid, None)  # adapter unloaded after it was accepted): no retry, no 500
            return [(batch.scheduled[0], RequestOutput(rid, error=error))]
        attempts = self._failed_alone.get(rid, 0) + 1
        if attempts < SOLO_ATTEMPTS:
            log.warning("request %s failed alone in %s (%s: %s); retrying it once", rid, where, type(error).__name__,
                        error)
            self._failed_alone[rid] = attempts
            self._retry.appendleft(batch)
            return []
        self._failed_alone.pop(rid, None)
        return [(batch.scheduled[0], RequestOutput(rid, error=internal_error(rid, error, where)))]

    def reset(self) -> list[str]:
        """Forget every queued, retried and in-flight request (after the step loop itself failed); their ids."""
        ids = self.scheduler.clear()
        for batch in self._retry:
            ids.extend(s.request.request_id for s in batch.scheduled)
        for batch, _ in self._inflight:
            ids.extend(s.request.request_id for s in batch.scheduled)
        self._retry.clear()
        self._inflight.clear()
        self._failed_alone.clear()
        return list(dict.fromkeys(ids + self._chunks.clear()))

    def encode(self, inputs: Sequence[Any], params: PoolingParams | None = None, *, progress: bool = False,
               raise_on_error: bool = True) -> list[RequestOutput]:
        """Run a list of inputs to completion; outputs come back in input order.

        All inputs are validated before any work starts; with `raise_on_error` a request rejected later
        (e.g. too long without truncation) raises `RequestError` naming its index. The cyclic garbage collector
        is held off for the call (`wde.collector`).
        """
        ids = []
        requests = []
        with collector.paused():  # and run's own pause: every input's objects live until the call returns
            for i, x in enumerate(inputs):
                try:
                    requests.append(self.make_request(x, params))
                except RequestError as e:
                    raise RequestError(f"input[{i}]: {e}", e.field, e.kind) from None
                ids.append(requests[-1].request_id)
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(ids), unit="input", desc="wde")
            try:
                done = self.run(requests, bar.update if bar is not None else None)
            finally:
                if bar is not None:
                    bar.close()
        results = [done[i] for i in ids]
        if raise_on_error:
            for i, out in enumerate(results):
                if out.error is not None:
                    raise RequestError(f"input[{i}]: {out.error}", out.error.field, out.error.kind)
        return results

    def run(self, requests: Sequence[Request],
            on_outputs: Callable[[int], object] | None = None) -> dict[str, RequestOutput]:
        """Queue validated requests (`make_request`) and step until each has its output; outputs by request id.
        `on_outputs(n)` is called after each step that finished n of them (a progress bar's `update`). The
        cyclic garbage collector is held off meanwhile (`wde.collector`)."""
        for r in requests:
            self.scheduler.add(r)
        done: dict[str, RequestOutput] = {}
        with collector.paused():
            while len(done) < len(requests):
                outs = self.step()
                for o in outs:
                    done[o.request_id] = o
                if on_outputs is not None:
                    on_outputs(len(outs))
                if not outs and not self.has_unfinished():
                    break  # pragma: no cover - every request yields an output; guards against a plugin losing one
        return done

    def embed(self, texts: str | Sequence[Any], *, normalize: bool | None = None, truncate: bool = False,
              truncation_direction: str = "right", prompt_name: str | None = None,
              dimensions: int | None = None, chunk: bool = False, max_embed_len: int | None = None,
              progress: bool = False) -> np.ndarray:
        """Dense embeddings, one row per input (a 1-D array for a single string, or a single image where the
        workflow takes images: bytes, a PIL image, a path or an `{"image": ...}` mapping; docs/images.md).

        An input longer than the model is refused, or truncated with `truncate`, or with `chunk` embedded in
        chunks averaged by their token counts (up to `max_embed_len` tokens in all: wde/chunking.py)."""
        single = isinstance(texts, (str, bytes, bytearray, memoryview, os.PathLike, Mapping)) \
            or hasattr(texts, "getbands")  # a PIL image
        items = [texts] if single else list(texts)
        params = PoolingParams(truncate=truncate, truncation_direction=truncation_direction,  # type: ignore[arg-type]
                               normalize=normalize, prompt_name=prompt_name, dimensions=dimensions, chunk=chunk,
                               max_embed_len=max_embed_len)
        outs = self.encode(items, params, progress=progress)
        if not outs:
            return np.zeros((0, 0), dtype=np.float32)
        if "dense" not in outs[0].outputs:
            raise RequestError(f"workflow {self.workflow.name!r} does not produce dense embeddings"
                               f" (it produces {sorted(outs[0].outputs)}); use Engine.encode")
        arr = np.stack([o.outputs["dense"] for o in outs])
        return arr[0] if single else arr

    def late_chunk(self, text: str | Sequence[str], spans: Sequence[tuple[int, int]] | None = None, *,
                   chunker: str | None = None, chunk_tokens: int | None = None, normalize: bool | None = None,
                   dimensions: int | None = None, truncate: bool = False, truncation_direction: str = "right",
                   prompt_name: str | None = None) -> list[LateChunk]:
        """Late chunking (Jina's, wde/late_chunking.py): one `LateChunk` per chunk of `text`, its vector the mean
        of its tokens' states from the WHOLE text, then the model's modules after pooling, `dimensions` and
        normalization, as `embed` finishes a text's vector.

        The chunks are the character `spans` ([start, end) of `text`), else those of the `chunker`: "sentences"
        (the default) or "tokens" (windows of `chunk_tokens` tokens). A list of texts is Jina's shape: a
        document's consecutive chunks, joined by single spaces and encoded together, one vector each. The whole
        text must fit the model, unless `truncate`: then only the part kept is chunked."""
        if not self.span_pooling:
            raise RequestError(f"late chunking needs a pooler that pools token spans, as 'sentence' does for a"
                               f" model pooled with one mode; workflow {self.workflow.name!r} cannot", "workflow")
        names = None
        if not isinstance(text, str):
            if spans is not None or chunker is not None:
                raise RequestError("a list of texts is a document's chunks already; give spans or a chunker with"
                                   " one text", "spans" if spans is not None else "chunker")
            text, spans = join(list(text), "text")
            names = [f"text[{i}]" for i in range(len(spans))]
        params = PoolingParams(truncate=truncate, truncation_direction=truncation_direction,  # type: ignore[arg-type]
                               normalize=normalize, prompt_name=prompt_name, dimensions=dimensions)
        doc: Document = prepare(self.tokenizer, self.input_processor, text, params, self._token_limit(),
                                spans=spans, chunker=chunker, chunk_tokens=chunk_tokens, span_names=names,
                                field="text")
        out, = self.encode([doc.token_ids], doc.params)
        return doc.chunks(out)

    @property
    def longest_input(self) -> int:
        """The longest input the scheduler admits (`Scheduler.longest_input`, else its token budget)."""
        return self.scheduler.longest_input or self.scheduler.token_budget

    def _token_limit(self) -> int:
        """The most tokens one input may have: the model's, or the scheduler's limit where it is smaller."""
        return min(self.max_length, self.longest_input)

    def close(self) -> None:
        self.executor.shutdown()
        self.components["runner"].shutdown()  # e.g. the CPU streams' threads

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_output(self, name: str, method: str) -> None:
        if name not in self.supported_outputs:
            raise RequestError(f"Engine.{method} needs a workflow that produces {name!r}; workflow"
                               f" {self.workflow.name!r} produces {list(self.supported_outputs)}", "workflow")

    @staticmethod
    def _check_top(value: int | None, field: str) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(f"{field} must be a positive integer, got {value!r}", field)

    def score(self, pairs: Sequence[tuple[str, str]], *, activation: bool | None = None,
              truncate: bool = False) -> np.ndarray:
        """One float32 score per (query, document) pair, as the workflow's scorer scores (`self.scorer`,
        wde/components/scorer.py): a cross-encoder's score of the pair, the cosine similarity of an embedder's
        vectors, the MaxSim of a multi-vector model's (query as task=query, document as task=document).

        `activation=None` uses the workflow default (a cross-encoder's sigmoid, like sentence-transformers'
        CrossEncoder); False returns raw logits (an embedder's scores have no activation: True is refused). With
        `truncate`, a cross-encoder's long pairs lose tokens from the second text only, an embedder's long texts
        their end.
        """
        if self.scorer.output is None:
            raise RequestError(f"Engine.score needs a workflow that scores; workflow {self.workflow.name!r} produces"
                               f" {list(self.supported_outputs)} and its scorer is {self.scorer.scoring!r}",
                               "workflow")
        plan = scoring_plan(self.scorer, list(pairs), PoolingParams(truncate=truncate, activation=activation))
        where = [f"pairs[{i}]" if self.scorer.pairs else f"pairs[{i}][{side}]" for i, side in plan.origins]
        requests = []
        for name, item, params in zip(where, plan.inputs, plan.params):
            try:
                requests.append(self.make_request(item, params))
            except RequestError as e:
                raise RequestError(f"{name}: {e}", e.field, e.kind) from None
        done = self.run(requests)
        outs = [done[r.request_id] for r in requests]
        for name, out in zip(where, outs):
            if out.error is not None:
                raise RequestError(f"{name}: {out.error}", out.error.field, out.error.kind)
        return plan.scores([o.outputs for o in outs])

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
               truncate: bool = False) -> list[tuple[int, float]]:
        """(document index, score) pairs, best first, as `score` scores them; ties keep the input order."""
        self._check_top(top_n, "top_n")
        docs = list(documents)
        scores = self.score([(query, d) for d in docs], truncate=truncate)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        return [(i, float(scores[i])) for i in order[:top_n]]

    def classify(self, texts: str | Sequence[Any], *, top_k: int | None = None, activation: bool | None = None,
                 truncate: bool = False) -> list[list[tuple[str, float]]]:
        """For each input, (label, probability) pairs, most likely first (`top_k` of them, default all).

        `activation=False` gives raw logits instead of probabilities.
        """
        self._require_output("probs", "classify")
        self._check_top(top_k, "top_k")
        items = [texts] if isinstance(texts, str) else list(texts)
        labels: list[str] = self.components["pooler"].labels
        outs = self.encode(items, PoolingParams(truncate=truncate, activation=activation))
        ranked = []
        for out in outs:
            probs = out.outputs["probs"]
            order = np.argsort(-probs, kind="stable")[:top_k]
            ranked.append([(labels[j], float(probs[j])) for j in order])
        return ranked

