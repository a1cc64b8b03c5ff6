"""Model input builders: pack a scheduled batch into flat tensors, without padding.

Everything is built on CPU and moved to the device with one `.to()` (seed 001): the tensors are small, and
building on CPU lets the next batch be prepared while the device runs the current one.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from wde.components.base import BuildContext, Params
from wde.components.kinds import ModelInputBuilder
from wde.components.scheduler import SchedulerOutput
from wde.request import PoolingParams

if TYPE_CHECKING:
    from wde.components.lora import AdapterTable


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
    pixel_values: torch.Tensor | None = None
    """Multimodal batches only: the images' pixels [num_images, channels, height, width] in batch order (SigLIP 2
    NaFlex: [num_images, H, W, 3 x patch x patch], each image's grid at the top left, zero-padded, its row count
    carried in its placeholder ids)."""
    image_mask: list[bool] | None = None
    """Multimodal batches only: whether sequence i is an image (its `input_ids` are placeholders then, and its
    pixels are row `sum(image_mask[:i])` of `pixel_values`); None: every sequence is text."""
    key_mask: torch.Tensor | None = None
    """Boolean [tokens], packed like `input_ids`: True where a token may be attended to (a key every query of its
    sequence may read), False for a key no query reads (ColBERT's query-expansion [MASK] tokens with `attend:
    false`), which still gets an output of its own. None: every token may be attended. Set by an input builder
    from per-request information; attention backends with `supports_key_mask` honour it on their packed path (no
    dense [L, L] bias), the others refuse the batch. A query left with no key to attend outputs zeros from
    attention."""

    adapter_ids: torch.Tensor | None = None
    """Long [tokens], packed like `input_ids`: each token's LoRA adapter slot (0: none; wde/components/lora.py),
    from its sequence's request. None: no token has an adapter."""

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
                       cu_seqlens=move(self.cu_seqlens), token_type_ids=move(self.token_type_ids),
                       pixel_values=move(self.pixel_values), key_mask=move(self.key_mask),
                       adapter_ids=move(self.adapter_ids))

    @property
    def has_images(self) -> bool:
        return self.image_mask is not None and any(self.image_mask)

    def select(self, seqs: list[int]) -> "ModelInput":
        """The batch of sequences `seqs` (indices, in that order), packed anew (a copy; `split` makes views)."""
        lens = [self.seq_lens[i] for i in seqs]
        starts = self.cu_seqlens[:-1].tolist()
        dev = self.input_ids.device
        index = torch.cat([torch.arange(starts[i], starts[i] + self.seq_lens[i], device=dev) for i in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=self.cu_seqlens.dtype, device=self.cu_seqlens.device)
        torch.cumsum(torch.tensor(lens, device=cu.device), 0, out=cu[1:])
        pixels, mask = None, None
        if self.image_mask is not None:
            mask = [self.image_mask[i] for i in seqs]
            if self.pixel_values is not None and any(mask):
                rows = list(itertools.accumulate(self.image_mask, initial=0))
                pixels = self.pixel_values[torch.tensor([rows[i] for i in seqs if self.image_mask[i]],
                                                        device=self.pixel_values.device)]
        return ModelInput(self.input_ids[index], self.positions[index], cu, lens, max(lens),
                          None if self.token_type_ids is None else self.token_type_ids[index],
                          [self.pooling_params[i] for i in seqs] if self.pooling_params else [], pixels, mask,
                          None if self.key_mask is None else self.key_mask[index],
                          None if self.adapter_ids is None else self.adapter_ids[index])

    def by_modality(self) -> tuple[tuple[list[int], "ModelInput"] | None, tuple[list[int], "ModelInput"] | None]:
        """(text, images): each the indices of its sequences in this batch and the batch of just those (None when
        there are none), so a model with a tower per modality runs each on its own batch and puts its results back
        in batch order. A text-only batch is returned whole, without a copy."""
        if not self.has_images:
            return (list(range(self.num_seqs)), self), None
        assert self.image_mask is not None
        if all(self.image_mask):
            return None, (list(range(self.num_seqs)), self)
        text = [i for i, image in enumerate(self.image_mask) if not image]
        images = [i for i, image in enumerate(self.image_mask) if image]
        return (text, self.select(text)), (images, self.select(images))

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
        images = list(itertools.accumulate(self.image_mask, initial=0)) if self.image_mask is not None else None
        pieces = []
        for s0, s1 in zip(bounds, bounds[1:]):
            t0, t1, lens = cu[s0], cu[s1], self.seq_lens[s0:s1]
            pixels = mask = None
            if images is not None:
                mask = self.image_mask[s0:s1]  # type: ignore[index]
                if self.pixel_values is not None:
                    pixels = self.pixel_values[images[s0]:images[s1]]
            pieces.append(ModelInput(
                self.input_ids[t0:t1], self.positions[t0:t1], self.cu_seqlens[s0:s1 + 1] - t0, lens, max(lens),
                None if self.token_type_ids is None else self.token_type_ids[t0:t1], self.pooling_params[s0:s1],
                pixels, mask, None if self.key_mask is None else self.key_mask[t0:t1],
                None if self.adapter_ids is None else self.adapter_ids[t0:t1]))
        return pieces


class PackedInputBuilder(ModelInputBuilder):
    """Concatenates token ids; positions restart at 0 for each sequence; `cu_seqlens` marks boundaries."""

    kind = "model_input_builder"
    name = "packed"
    Params = Params

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._pin = torch.cuda.is_available()
        self._adapters: AdapterTable | None = None

    def use_adapters(self, table: "AdapterTable") -> None:
        """Pack each token's LoRA adapter slot (`ModelInput.adapter_ids`) as `table` maps its request's option;
        called by a model that takes adapters (`PrefillModel.use_lora`)."""
        self._adapters = table

    def build(self, batch: SchedulerOutput) -> ModelInput:
        seqs = batch.scheduled
        lens = [s.num_tokens for s in seqs]
        total = sum(lens)
        input_ids = _flat([s.token_ids for s in seqs], total)
        lens_t = torch.tensor(lens, dtype=torch.long)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(lens_t, 0, out=cu[1:])
        starts = torch.repeat_interleave(cu[:-1].long(), lens_t)
        positions = torch.arange(total, dtype=torch.long) - starts
        types = None
        if any(s.token_type_ids is not None for s in seqs):
            types = _flat([s.token_type_ids or [0] * s.num_tokens for s in seqs], total)
        adapters = None
        if self._adapters is not None:
            slots = [self._adapters.slot_of(s.params) for s in seqs]
            if any(slots):
                adapters = torch.repeat_interleave(torch.tensor(slots, dtype=torch.long), lens_t)
        mi = ModelInput(input_ids, positions, cu, lens, max(lens), types, [s.params for s in seqs],
                        adapter_ids=adapters)
        if self._pin:
            mi = replace(mi, input_ids=mi.input_ids.pin_memory(), positions=mi.positions.pin_memory(),
                         cu_seqlens=mi.cu_seqlens.pin_memory(),
                         token_type_ids=None if types is None else mi.token_type_ids.pin_memory(),
                         adapter_ids=None if adapters is None else adapters.pin_memory())
        return mi


def _flat(lists: list[list[int]], total: int) -> torch.Tensor:
    """The int64 tensor of `lists` one after another (`total` values in all): numpy reads the ints three times as
    fast as `torch.tensor` of a flat list, which checks each one (~2 microseconds per input of a GPU's batch)."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total))
