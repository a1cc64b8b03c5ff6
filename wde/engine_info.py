"""What the API needs to know about a built engine, as plain data: in one process it is read off the `Engine`;
with an engine core in its own process (`wde serve --api-servers N`) the core sends it to each API server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wde.components.scorer import Scorer
    from wde.engine import Engine


@dataclass(frozen=True)
class EngineInfo:
    workflow: str
    """The workflow's name."""
    outputs: tuple[str, ...]
    """What the workflow produces (e.g. ("dense",), ("score",)); the server routes on it."""
    max_length: int
    """Longest input in tokens."""
    token_budget: int | None
    """Tokens in one batch at most (the scheduler's budget), but for a batch of one longer input."""
    longest_input: int
    """The longest input the scheduler admits, in tokens (`Engine.longest_input`)."""
    max_num_requests: int | None
    """Requests in one batch at most."""
    dense_size: int | None
    """Width of the 'dense' output (None when the workflow has none)."""
    labels: tuple[str, ...]
    """Class names in class-id order (classifiers, rerankers); empty when the model declares none."""
    pooling: str
    """The pooling mode (or the pooler's name) of an embedding workflow."""
    dtype: str
    """The model's dtype, e.g. "float32" (with mixed precision, its linear layers' dtype)."""
    device: str
    """Where the model runs, e.g. "cpu", "cuda:0"."""
    scorer: "Scorer"
    """The workflow's scorer (wde/components/scorer.py): its name (`scoring`), the output it reads, whether it
    scores pairs, what each side runs with (`side_params`) and `score`. Its state is plain settings (it keeps no
    component), so it travels with this info to a split engine's API servers, which score with it."""
    chunkable: bool = False
    """Whether long inputs may be embedded in chunks (`PoolingParams.chunk`: the pooler is a `ChunkedPooling`)."""
    span_pooling: bool = False
    """Whether token spans of an input may be pooled (`PoolingParams.spans`, late chunking: a `SpanPooling`)."""
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The per-request options the workflow takes (`PoolingParams.options`), each with its values, default first."""

    @classmethod
    def of(cls, engine: "Engine") -> "EngineInfo":
        pooler = engine.components["pooler"]
        labels = pooler.labels
        if labels is None:
            labels = getattr(engine.source.hf_config, "id2label", None) or {}
        if isinstance(labels, dict):
            labels = [labels[k] for k in sorted(labels, key=int)]
        model = engine.components["model"]
        param = next(iter(model.parameters()), None)
        return cls(
            workflow=engine.workflow.name,
            outputs=tuple(engine.supported_outputs),
            max_length=engine.max_length,
            token_budget=engine.scheduler.token_budget,
            longest_input=engine.longest_input,
            max_num_requests=engine.scheduler.max_num_requests,
            dense_size=engine.dense_size,
            labels=tuple(str(x) for x in labels),
            pooling=str(pooler.mode or engine.workflow.components["pooler"].name),
            dtype=str(model.dtype or param.dtype).removeprefix("torch.") if param is not None else
            "unknown",
            device=str(param.device) if param is not None else "cpu",
            chunkable=engine.chunkable,
            span_pooling=engine.span_pooling,
            options=dict(engine.request_options),
            scorer=engine.scorer,
        )
