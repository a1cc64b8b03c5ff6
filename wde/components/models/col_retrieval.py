"""ColPali and ColQwen2 through transformers' own modules: `ColPaliForRetrieval` (SigLIP vision tower, PaliGemma's
projector, Gemma) and `ColQwen2ForRetrieval` (Qwen2-VL's vision tower and language model), loaded from the folder
(no remote code: both are in transformers) and run on WDE's scheduled batches.

A packed batch is padded on the right to its longest sequence with an attention mask (transformers' own batch
layout, and one under which every sequence gets what it gets alone: ColPali attends both ways with padded keys
masked and counts positions from the start; ColQwen2 is causal and so is its padding). The forward is the model
class's own, step for step, except that the projected vectors come back before the L2 normalization, which the
`col_retrieval` pooler applies (so a request may ask for `normalize=false`):

- ColPali: `vlm(input_ids, attention_mask, pixel_values, token_type_ids=0)` (the processor's token types: every
  token in PaliGemma's bidirectional prefix), then `embedding_proj_layer`;
- ColQwen2: the token embeddings with the vision tower's merged patch features scattered over the image tokens,
  then `vlm(inputs_embeds, attention_mask)` (positions counted from each sequence's start, as transformers'
  ColQwen2 computes them), then `embedding_proj_layer`.

This is not a packed re-implementation (WDE's attention backends, fused kernels and CPU linear paths are not used
here): the padding costs what it costs in transformers. `forward` returns [tokens, embedding_dim], packed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wde.components.base import BuildContext, Component
from wde.components.kinds import Model
from wde.components.col_retrieval import qwen2_vl_images
from wde.components.col_retrieval_input import FAMILIES
from wde.components.model_input_builder import ModelInput
from wde.components.models.base import resolve_device, resolve_dtype
from wde.components.params import ModelParams
from wde.components.pooler import segment_ids
from wde.errors import ModelLoadError, one_line


TAKEN = ("dtype", "device")
"""The model params this component reads; any other set away from its default is refused by name."""


class ColRetrievalModel(nn.Module, Model):
    """A ColPali / ColQwen2 folder's transformers model over WDE batches (see the module docstring)."""

    kind = "model"
    name = "col_retrieval"
    Params = ModelParams
    pools = False
    model_types = tuple(FAMILIES)

    def __init__(self, params: ModelParams, ctx: BuildContext) -> None:
        nn.Module.__init__(self)
        Component.__init__(self, params, ctx)
        cfg = ctx.source.hf_config
        self.family: str = getattr(cfg, "model_type", None)
        if self.family not in FAMILIES:
            raise ModelLoadError(f"model 'col_retrieval' serves config model_type colpali or colqwen2; {ctx.source.path}"
                                 f" is {self.family!r}")
        fields = type(params).model_fields
        changed = [n for n in fields if n not in TAKEN and getattr(params, n) != fields[n].default]
        if changed:
            raise ModelLoadError(f"model.params {', '.join(changed)}: not taken by model 'col_retrieval' (it runs"
                                 f" transformers' modules as they are: no WDE linear kernels, mixed precision or LoRA);"
                                 f" it takes {' and '.join(TAKEN)}")
        attention = ctx.attention
        if attention.name != "auto" or attention.params.causal is not None:
            raise ModelLoadError("attention: model 'col_retrieval' runs transformers' own attention (its masks as the"
                                 " model defines them); leave the workflow's attention at {name: auto} without params")
        self.config = cfg
        self.device = resolve_device(params.device)
        self.dtype = resolve_dtype(params.dtype, self.device)
        self.hf = self._load(ctx)
        text = cfg.vlm_config.get_text_config()
        self.pad_id = int(getattr(text, "pad_token_id", None) or 0)
        self.image_token_id = int(cfg.vlm_config.image_token_id if self.family == "colqwen2"
                                  else cfg.vlm_config.image_token_index)
        tokenizer_id = ctx.input_processor.image_token_id
        if tokenizer_id is not None and tokenizer_id != self.image_token_id:
            key = "image_token_id" if self.family == "colqwen2" else "image_token_index"
            raise ModelLoadError(f"{ctx.source.path}: the tokenizer's image token is id {tokenizer_id} but"
                                 f" vlm_config.{key} is {self.image_token_id}")

    def _load(self, ctx: BuildContext) -> nn.Module:
        import transformers

        cls = getattr(transformers, FAMILIES[self.family]["architecture"])
        try:
            model = cls.from_pretrained(ctx.source.path, dtype=self.dtype, attn_implementation="sdpa")
        except Exception as e:  # noqa: BLE001 - a folder transformers cannot load is the folder's fault
            raise ModelLoadError(f"{cls.__name__} cannot load {ctx.source.path}: {one_line(e)}") from None
        return model.to(self.device).eval()

    @property
    def hidden_size(self) -> int:
        """Width of the token vectors: the config's `embedding_dim`."""
        return int(self.config.embedding_dim)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        text, images = batch.by_modality()
        if text is None or images is None:
            return self._padded(batch)
        # queries and pages differ in length by a page's image tokens: each modality is padded on its own
        out = None
        for seqs, part in (text, images):
            vectors = self._padded(part)
            if out is None:
                out = vectors.new_empty(batch.num_tokens, vectors.shape[1])
            starts = batch.cu_seqlens[:-1].long()
            rows = torch.cat([torch.arange(starts[i], starts[i] + batch.seq_lens[i], device=out.device) for i in seqs])
            out[rows] = vectors
        return out

    def _padded(self, batch: ModelInput) -> torch.Tensor:
        """The batch's projected token vectors, packed: run right-padded with an attention mask."""
        seg = segment_ids(batch)
        pos = batch.positions
        shape = (batch.num_seqs, batch.max_seqlen)
        ids = batch.input_ids.new_full(shape, self.pad_id)
        ids[seg, pos] = batch.input_ids
        mask = torch.zeros(shape, dtype=torch.long, device=ids.device)
        mask[seg, pos] = 1
        pixels = batch.pixel_values if batch.has_images else None
        if self.family == "colpali":
            hidden = self._colpali(ids, mask, pixels)
        else:
            hidden = self._colqwen2(ids, mask, pixels)
        return self.hf.embedding_proj_layer(hidden.to(self.hf.embedding_proj_layer.weight.dtype))[seg, pos]

    def _colpali(self, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
        if pixels is not None:
            pixels = pixels.to(dtype=self.hf.dtype)
        out = self.hf.vlm(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=torch.zeros_like(ids))
        return out[0]

    def _colqwen2(self, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
        vlm: Any = self.hf.vlm
        embeds = vlm.get_input_embeddings()(ids)
        if pixels is not None:
            patches, grid = qwen2_vl_images(pixels)
            image = vlm.visual(patches.to(self.hf.dtype), grid_thw=grid, return_dict=True).pooler_output
            slots = (ids == self.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(slots, image.to(embeds.device, embeds.dtype))
        return vlm(input_ids=None, attention_mask=mask, inputs_embeds=embeds)[0]
