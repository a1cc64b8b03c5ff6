"""Model input builders: pack a scheduled batch into flat tensors, without padding.

Everything is built on CPU and moved to the device with one `.to()` (seed 001): the tensors are small, and
building on CPU lets the next batch be prepared while the device runs the current one.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace

import torch

from wde.components.base import BuildContext, Component, Params
from wde.components.scheduler import SchedulerOutput
from wde.request import PoolingParams


@dataclass
class ModelInput:
    """A packed batch: sequence i owns tokens `cu_seqlens[i]:cu_seqlens[i+1]` of the flat tensors."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    max_seqlen: int
    token_type_ids: torch.Tensor | None = None
    pooling_params: list[PoolingParams] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> "ModelInput":
        nb = torch.device(device).type == "cuda"
        move = lambda t: None if t is None else t.to(device, non_blocking=nb)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), positions=move(self.positions),
                       cu_seqlens=move(self.cu_seqlens), token_type_ids=move(self.token_type_ids))

    def split(self, parts: int) -> list["ModelInput"]:
        """At most `parts` batches of whole, adjacent sequences with about equal token counts, in order.

        The pieces are views of this batch's tensors (no copy); pooling their outputs in order and joining them
        with `Pooled.cat` gives this batch's outputs.
        """
        parts = max(1, min(parts, self.num_seqs))
        cu = list(itertools.accumulate(self.seq_lens, initial=0))
        bounds = [0]
        for p in range(1, parts):  # cut at the sequence boundary nearest p/parts of the tokens, one sequence at least
            target = cu[-1] * p / parts
            i = bisect.bisect_left(cu, target)
            if i > 0 and target - cu[i - 1] <= cu[i] - target:
                i -= 1
            bounds.append(min(max(i, bounds[-1] + 1), self.num_seqs - (parts - p)))
        bounds.append(self.num_seqs)
        pieces = []
        for s0, s1 in zip(bounds, bounds[1:]):
            t0, t1, lens = cu[s0], cu[s1], self.seq_lens[s0:s1]
            pieces.append(ModelInput(
                self.input_ids[t0:t1], self.positions[t0:t1], self.cu_seqlens[s0:s1 + 1] - t0, lens, max(lens),
                None if self.token_type_ids is None else self.token_type_ids[t0:t1], self.pooling_params[s0:s1]))
        return pieces


class PackedInputBuilder(Component):
    """Concatenates token ids; positions restart at 0 for each sequence; `cu_seqlens` marks boundaries."""

    kind = "model_input_builder"
    name = "packed"
    Params = Params

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._pin = torch.cuda.is_available()

    def build(self, batch: SchedulerOutput) -> ModelInput:
        seqs = batch.scheduled
        lens = [s.num_tokens for s in seqs]
        flat = [t for s in seqs for t in s.token_ids]
        input_ids = torch.tensor(flat, dtype=torch.long)
        lens_t = torch.tensor(lens, dtype=torch.long)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(lens_t, 0, out=cu[1:])
        starts = torch.repeat_interleave(cu[:-1].long(), lens_t)
        positions = torch.arange(len(flat), dtype=torch.long) - starts
        types = None
        if any(s.token_type_ids is not None for s in seqs):
            types = torch.tensor([t for s in seqs for t in (s.token_type_ids or [0] * s.num_tokens)], dtype=torch.long)
        mi = ModelInput(input_ids, positions, cu, lens, max(lens), types, [s.request.params for s in seqs])
        if self._pin:
            mi = replace(mi, input_ids=mi.input_ids.pin_memory(), positions=mi.positions.pin_memory(),
                         cu_seqlens=mi.cu_seqlens.pin_memory(),
                         token_type_ids=None if types is None else mi.token_type_ids.pin_memory())
        return mi
