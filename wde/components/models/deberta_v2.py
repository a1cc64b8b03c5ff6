"""DeBERTa-v2 / v3 encoders (`DebertaV2Model`, and the encoder of `DebertaV2ForSequenceClassification`:
microsoft/deberta-v3-base/large cross-encoders and NLI / zero-shot classifiers, mxbai-rerank-*-v1 rerankers).

DeBERTa is BERT's post-norm layer with **disentangled attention**: besides content-to-content `q_i · k_j`, the
score of query i and key j adds content-to-position `q_i · Kr[δ(i, j)]` ("c2p") and position-to-content
`k_j · Qr[δ(j, i)]` ("p2c"), where `Kr` / `Qr` are the key / query projections of one table of relative position
embeddings shared by every layer (`encoder.rel_embeddings`, optionally LayerNorm'ed: `norm_rel_ebd`), projected by
the layer's own `key_proj` / `query_proj` (`share_att_key`) or by `pos_key_proj` / `pos_query_proj`, and `δ` is
the query-minus-key distance, log-bucketed beyond `position_buckets / 2` (`make_log_bucket_position`) and clamped
to the table. All three terms are divided by `sqrt(head_dim * (1 + len(pos_att_type)))`.

The c2p / p2c terms depend on each layer's q and k, so they are no static bias: every layer computes them from
its packed q / k and hands them to the attention backend as a per-sequence additive bias `[num_seqs, heads, L, L]`
(see `check_bias`), with one attention metadata per layer. To keep that bias about as large as the sequences need,
the sequences are attended in groups of about one length (`plan_groups`: padding within 1.25x), each group with its
own bias and metadata (the packed states are sorted by group once per forward and put back at the end). Within a
group, c2p is one matmul of the padded queries against the position rows of every distance `[L, 2L - 1]`, read
along the diagonals (`_skew`, a strided view: no gather over the `[L, L]` blocks); p2c likewise from the keys.
Backends that take a bias serve it (`auto`: torch_sdpa on CPU, triton_varlen on CUDA; not cpu_varlen). The position
rows' projections depend only on the weights, so they are computed once, at the first forward. A batch's key mask
(`ModelInput.key_mask`) travels into each group's batch, so the backend honours it with the bias; the convolution
reads a masked token as the padding it reads at the ends of a sequence (zero), so no token reads it there either.

Also honoured: `position_biased_input` (absolute positions added to the input, deberta-v2 style), token types
(`type_vocab_size > 0`), `embedding_size != hidden_size` (`embed_proj`), `attention_head_size`, and the
convolution after the first layer (`conv_kernel_size`, `conv_groups`, `conv_act`; deberta-v2-xlarge/xxlarge), run
per sequence with zero padding as transformers does. Refused by name: `pos_att_type` values other than c2p / p2c,
`norm_rel_ebd` values other than layer_norm / none, an even `conv_kernel_size`, and bucket sizes transformers'
arithmetic cannot bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata
from wde.components.model_input_builder import ModelInput
from wde.components.models.activations import activation
from wde.components.models.bert import BertIntermediate, BertModel, BertSelfOutput
from wde.components.models.loader import fused_linear
from wde.errors import ModelLoadError
from wde.components.attention.torch_sdpa import plan_groups

POS_ATT_TYPES = ("c2p", "p2c")


def _pos_att_types(cfg: object) -> list[str]:
    """`pos_att_type` as a list (older configs write "p2c|c2p")."""
    types = getattr(cfg, "pos_att_type", None) or []
    if isinstance(types, str):
        types = [t.strip() for t in types.lower().split("|")]
    return [t for t in types if t]


def make_log_bucket_position(relative_pos: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """transformers' `make_log_bucket_position`, op for op (so every bucket boundary is the same): distances up to
    `bucket_size // 2` stay exact, longer ones are log-bucketed so that `max_position` maps to about
    `bucket_size`."""
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where((relative_pos < mid) & (relative_pos > -mid), torch.tensor(mid - 1).type_as(relative_pos),
                          torch.abs(relative_pos))
    log_pos = (torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1))
               + mid)
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign)


def _bucket(relative_pos: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """Long bucket of each relative position (unchanged when `bucket_size <= 0`), as `build_relative_position`."""
    if bucket_size > 0 and max_position > 0:
        relative_pos = make_log_bucket_position(relative_pos, bucket_size, max_position)
    return relative_pos.to(torch.long)


def relative_positions(length: int, bucket_size: int, max_position: int) -> torch.Tensor:
    """`[length, length]` long: query position minus key position, log-bucketed when `bucket_size > 0`
    (transformers' `build_relative_position`)."""
    ids = torch.arange(length, dtype=torch.long)
    return _bucket(ids[:, None] - ids[None, :], bucket_size, max_position)


@dataclass(frozen=True)
class RelativeSpec:
    """What a config says about relative positions (read once, checked when the model is built)."""

    pos_att_type: tuple[str, ...]
    buckets: int
    """`position_buckets` (<= 0: distances are not bucketed)."""
    max_relative_positions: int
    span: int
    """Relative positions each side of 0 the table holds: the table has `2 * span` rows."""
    share_att_key: bool
    norm_rel_ebd: tuple[str, ...]

    @classmethod
    def from_config(cls, cfg: object) -> "RelativeSpec | None":
        """None when the config has no disentangled attention terms (`relative_attention` false or no
        `pos_att_type`)."""
        types = _pos_att_types(cfg)
        unknown = [t for t in types if t not in POS_ATT_TYPES]
        if unknown:
            raise ModelLoadError(f"DeBERTa-v2 config pos_att_type {unknown!r} is not implemented (supported: c2p, p2c)")
        if not getattr(cfg, "relative_attention", False) or not types:
            return None
        norm = tuple(x.strip() for x in str(getattr(cfg, "norm_rel_ebd", "none") or "none").lower().split("|"))
        unknown = [x for x in norm if x not in ("none", "layer_norm")]
        if unknown:
            raise ModelLoadError(f"DeBERTa-v2 config norm_rel_ebd {unknown!r} is not implemented"
                                 " (supported: layer_norm, none)")
        buckets = int(getattr(cfg, "position_buckets", -1))
        max_rel = int(getattr(cfg, "max_relative_positions", -1))
        if max_rel < 1:
            max_rel = int(cfg.max_position_embeddings)
        if buckets > 0 and (buckets < 2 or max_rel - 1 <= buckets // 2):
            raise ModelLoadError(
                f"DeBERTa-v2 config position_buckets {buckets} with max_relative_positions {max_rel}: the log buckets"
                " need position_buckets >= 2 and max_relative_positions > position_buckets / 2 + 1")
        return cls(tuple(dict.fromkeys(types)), buckets, max_rel, buckets if buckets > 0 else max_rel,
                   bool(getattr(cfg, "share_att_key", False)), norm)


@dataclass(frozen=True)
class _RelIndex:
    """For sequences of up to L tokens, the position row each relative distance reads, in the order the skewed
    score blocks need (see `_skew`): entry m is the row of the distance `(L - 1) - m`, m = 0 .. 2L - 2.

    `c2p[m]`: the row of query-minus-key distance d = i - j; `p2c[m]`: the row of key-minus-query distance
    d = j - i (transformers' `c2p_pos` / `p2c_pos`, which are functions of the distance alone)."""

    c2p: torch.Tensor
    p2c: torch.Tensor


@dataclass
class SequenceGroup:
    """Sequences of about one length, attended together: tokens `start:end` of the (length-sorted) packed
    states, padded to their longest (`L`) for the relative-position scores."""

    start: int
    end: int
    batch: ModelInput
    """The group as a batch of its own (positions counted within it), for the attention metadata."""
    token_index: torch.Tensor
    """`[num_seqs, L]`: index (within the group's tokens) of each sequence's positions; padding slots repeat the
    sequence's first token."""
    valid: torch.Tensor
    """`[num_seqs, L]` bool: which slots are real tokens."""
    rel: _RelIndex | None


@dataclass
class DebertaBatch:
    """What every layer of one forward shares: the length groups, the per-layer position projections, and how to
    build attention metadata (per group and layer with its bias; once without)."""

    groups: list[SequenceGroup]
    metadata: Callable[[ModelInput, torch.Tensor | None], AttentionMetadata]
    positions: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None
    """Per layer, the (key, query) projections of the relative position rows, each `[2 * span, heads, head_dim]`."""
    _plain: AttentionMetadata | None = field(default=None, repr=False)

    def plain_metadata(self) -> AttentionMetadata:
        """Metadata without a bias (one group: the whole batch), built once."""
        if self._plain is None:
            self._plain = self.metadata(self.groups[0].batch, None)
        return self._plain


MAX_PADDING = 1.25
"""A length group's padded size ([sequences x longest]) stays within this factor of its real tokens, so the
`[n, heads, L, L]` relative-position scores of a batch with mixed lengths cost about what its sequences need."""


def _skew(scores: torch.Tensor) -> torch.Tensor:
    """`[n, heads, L, L]` view of `[n, heads, L, 2L - 1]` scores: `out[..., a, b] = scores[..., a, (L - 1) + b - a]`
    (the relative shift: each row's distances laid along the diagonal), no copy."""
    n, heads, length, _ = scores.shape
    s_n, s_h, s_a, s_m = scores.stride()
    return scores.as_strided((n, heads, length, length), (s_n, s_h, s_a - s_m, s_m),
                             scores.storage_offset() + (length - 1) * s_m)


class DisentangledSelfAttention(nn.Module):
    """DeBERTa-v2 attention over packed tokens: fused `qkv` (query_proj | key_proj | value_proj), the c2p / p2c
    terms as a per-sequence bias, the output projection with BERT's residual + LayerNorm."""

    def __init__(self, cfg: object, backend: AttentionBackend, spec: RelativeSpec | None) -> None:
        super().__init__()
        self.num_heads = int(cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "attention_head_size", None) or cfg.hidden_size // self.num_heads)
        inner = self.num_heads * self.head_dim
        self.qkv = fused_linear(cfg.hidden_size, [inner] * 3, bias=True)
        self.output = BertSelfOutput(cfg, inner)
        self.spec = spec
        types = spec.pos_att_type if spec is not None else _pos_att_types(cfg)
        self.scale_factor = 1 + sum(t in types for t in POS_ATT_TYPES)
        self.scale = 1.0 / math.sqrt(self.head_dim * self.scale_factor)
        """Of every term: transformers divides q·k, c2p and p2c by sqrt(head_dim * scale_factor)."""
        if spec is not None and not spec.share_att_key:
            if "c2p" in spec.pos_att_type:
                self.pos_key_proj = nn.Linear(cfg.hidden_size, inner)
            if "p2c" in spec.pos_att_type:
                self.pos_query_proj = nn.Linear(cfg.hidden_size, inner)
        self.backend = backend

    def position_projections(self, rel_embeddings: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key, query) projections of the relative position rows, each `[rows, heads, head_dim]` (None when the
        term is not used)."""
        spec = self.spec
        assert spec is not None
        shape = (rel_embeddings.shape[0], self.num_heads, self.head_dim)
        pos_k = pos_q = None
        if spec.share_att_key:
            pq, pk, _ = self.qkv(rel_embeddings).view(shape[0], 3, *shape[1:]).unbind(1)
            pos_k = pk if "c2p" in spec.pos_att_type else None
            pos_q = pq if "p2c" in spec.pos_att_type else None
        else:
            if "c2p" in spec.pos_att_type:
                pos_k = self.pos_key_proj(rel_embeddings).view(shape)
            if "p2c" in spec.pos_att_type:
                pos_q = self.pos_query_proj(rel_embeddings).view(shape)
        return pos_k, pos_q

    def relative_bias(self, q: torch.Tensor, k: torch.Tensor, pos_k: torch.Tensor | None, pos_q: torch.Tensor | None,
                      group: SequenceGroup) -> torch.Tensor:
        """`[num_seqs, heads, L, L]` for one group (q, k: its packed tokens): (c2p + p2c) / sqrt(head_dim *
        scale_factor), as transformers' `disentangled_attention_bias` for each sequence alone.

        c2p of query i and key j is `q_i · Kr[c2p_pos(i - j)]`: the padded queries against the position rows of
        every distance (`[heads, n, L, 2L - 1]`, one matmul) read along the diagonals (`_skew`); p2c likewise from
        the keys, transposed. No gather over the `[L, L]` blocks."""
        rel = group.rel
        assert rel is not None
        n, length = group.token_index.shape
        bias = torch.empty(n, self.num_heads, length, length, dtype=q.dtype, device=q.device)
        first = True
        for states, rows, index, transpose in ((q, pos_k, rel.c2p, False), (k, pos_q, rel.p2c, True)):
            if rows is None:
                continue
            padded = states[group.token_index.reshape(-1)].transpose(0, 1)  # [heads, n * L, head_dim]
            scores = torch.matmul(padded, rows.to(states.dtype)[index].permute(1, 2, 0))  # [heads, n * L, 2L - 1]
            scores = _skew(scores.view(self.num_heads, n, length, -1).transpose(0, 1))  # [n, heads, L, L]
            if transpose:  # p2c was laid out by key: [.., j, i]
                scores = scores.transpose(-1, -2)
            if first:
                torch.mul(scores, self.scale, out=bias)
                first = False
            else:
                bias.add_(scores, alpha=self.scale)
        return bias

    def forward(self, x: torch.Tensor, ctx: DebertaBatch, layer_index: int) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        if self.spec is None:
            attn = self.backend.forward(q, k, v, ctx.plain_metadata(), self.scale)
        else:
            assert ctx.positions is not None
            pos_k, pos_q = ctx.positions[layer_index]
            outs = []
            for g in ctx.groups:
                qg, kg, vg = q[g.start:g.end], k[g.start:g.end], v[g.start:g.end]
                meta = ctx.metadata(g.batch, self.relative_bias(qg, kg, pos_k, pos_q, g))
                outs.append(self.backend.forward(qg, kg, vg, meta, self.scale))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.output(attn.reshape(x.shape[0], -1), x)


class DebertaV2Layer(nn.Module):
    """Disentangled attention, then BERT's intermediate and output blocks (post-norm)."""

    def __init__(self, cfg: object, backend: AttentionBackend, spec: RelativeSpec | None, index: int) -> None:
        super().__init__()
        self.attention = DisentangledSelfAttention(cfg, backend, spec)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, self.intermediate.size)
        self.index = index

    def forward(self, x: torch.Tensor, ctx: DebertaBatch) -> torch.Tensor:
        x = self.attention(x, ctx, self.index)
        return self.output(self.intermediate(x), x)


class DebertaV2Embeddings(nn.Module):
    """Word (+ absolute position, `position_biased_input`) (+ token type) embeddings of `embedding_size`,
    projected to the hidden size when it differs (`embed_proj`, no bias), then LayerNorm."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        size = int(getattr(cfg, "embedding_size", None) or cfg.hidden_size)
        self.word_embeddings = nn.Embedding(cfg.vocab_size, size)
        if getattr(cfg, "position_biased_input", True):
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, size)
        if int(getattr(cfg, "type_vocab_size", 0) or 0) > 0:
            self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, size)
        if size != cfg.hidden_size:
            self.embed_proj = nn.Linear(size, cfg.hidden_size, bias=False)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(batch.positions)
        if hasattr(self, "token_type_embeddings"):
            if batch.token_type_ids is not None:
                x = x + self.token_type_embeddings(batch.token_type_ids)
            else:
                x = x + self.token_type_embeddings.weight[0]
        if hasattr(self, "embed_proj"):
            x = self.embed_proj(x)
        return self.LayerNorm(x)


class DebertaV2Conv(nn.Module):
    """transformers' `ConvLayer`: after the first layer, `LayerNorm(layer_out + act(conv1d(embeddings)))`, the
    convolution over each sequence alone (zero padding at its ends, as transformers' masked embeddings give)."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        size = int(cfg.conv_kernel_size)
        if size % 2 == 0:
            raise ModelLoadError(f"DeBERTa-v2 config conv_kernel_size {size} is even; transformers' ConvLayer keeps the"
                                 " sequence length only for odd kernels")
        groups = int(getattr(cfg, "conv_groups", 1) or 1)
        if cfg.hidden_size % groups:
            raise ModelLoadError(f"DeBERTa-v2 config conv_groups {groups} does not divide hidden_size"
                                 f" {cfg.hidden_size}")
        self.conv = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, size, padding=(size - 1) // 2, groups=groups)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = activation(getattr(cfg, "conv_act", "tanh") or "tanh")

    def forward(self, embeddings: torch.Tensor, residual: torch.Tensor, ctx: DebertaBatch) -> torch.Tensor:
        outs = []
        for g in ctx.groups:
            read = g.valid if g.batch.key_mask is None else g.valid & g.batch.key_mask[g.token_index]
            x = embeddings[g.start:g.end][g.token_index] * read[..., None].to(embeddings.dtype)  # [n, L, hidden]
            outs.append(self.conv(x.to(self.conv.weight.dtype).transpose(1, 2)).transpose(1, 2)[g.valid])
        out = self.act(outs[0] if len(outs) == 1 else torch.cat(outs))
        return self.LayerNorm((residual + out.to(residual.dtype)).to(self.LayerNorm.weight.dtype)).to(residual.dtype)


class DebertaV2Model(BertModel):
    """DeBERTa-v2 / v3: disentangled attention with a per-layer, per-sequence bias; post-norm BERT blocks."""

    name = "deberta_v2"
    model_types = ("deberta-v2",)
    uses_attention_bias = True
    checkpoint_prefixes = ("deberta.",)  # DebertaV2For* checkpoints; a bare DebertaV2Model has none
    checkpoint_name_mapping = {
        "attention.self.pos_key_proj": "attention.pos_key_proj",
        "attention.self.pos_query_proj": "attention.pos_query_proj",
    }
    packed_modules_mapping = {
        "attention.self.query_proj": ("attention.qkv", 0),
        "attention.self.key_proj": ("attention.qkv", 1),
        "attention.self.value_proj": ("attention.qkv", 2),
    }

    def build(self, cfg: object) -> None:
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "attention_head_size", None) or cfg.hidden_size // heads)
        if cfg.hidden_size % heads or heads * head_dim != cfg.hidden_size:
            raise ModelLoadError(f"DeBERTa-v2 config: {heads} heads of {head_dim} do not make hidden_size"
                                 f" {cfg.hidden_size}")
        self.spec = RelativeSpec.from_config(cfg)
        super().build(cfg)
        if self.spec is not None:
            self.encoder.rel_embeddings = nn.Embedding(2 * self.spec.span, cfg.hidden_size)
            if "layer_norm" in self.spec.norm_rel_ebd:
                self.encoder.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        if int(getattr(cfg, "conv_kernel_size", 0) or 0) > 0:
            self.encoder.conv = DebertaV2Conv(cfg)
        self._rel_index: dict[tuple[int, str], _RelIndex] = {}
        self._positions: dict[tuple[str, torch.dtype], list] = {}

    def build_embeddings(self, cfg: object) -> nn.Module:
        return DebertaV2Embeddings(cfg)

    def build_layer(self, cfg: object, index: int = 0) -> nn.Module:
        return DebertaV2Layer(cfg, self.attn_backend, self.spec, index)

    def position_table_size(self, cfg: object) -> int | None:
        return int(cfg.max_position_embeddings) if getattr(cfg, "position_biased_input", True) else None

    def _relative_index(self, length: int, device: torch.device) -> _RelIndex:
        key = (length, str(device))
        found = self._rel_index.get(key)
        if found is not None:
            return found
        spec = self.spec
        assert spec is not None
        # entry m stands for the distance (L - 1) - m: i - j for c2p (rows by query), j - i for p2c (rows by key)
        distance = length - 1 - torch.arange(2 * length - 1, dtype=torch.long)
        rel = _bucket(distance, spec.buckets, spec.max_relative_positions)
        top = 2 * spec.span - 1
        found = _RelIndex(torch.clamp(rel + spec.span, 0, top).to(device),  # c2p_pos = clamp(r(i - j) + span)
                          torch.clamp(-rel + spec.span, 0, top).to(device))  # p2c_pos = clamp(-r(j - i) + span)
        cache = dict(self._rel_index) if len(self._rel_index) < 16 else {}  # lengths vary: keep a few
        cache[key] = found
        self._rel_index = cache  # one assignment: threads running split batches (cpu_streams) may share it
        return found

    def rel_embeddings(self) -> torch.Tensor:
        """The relative position rows every layer projects (LayerNorm'ed with `norm_rel_ebd: layer_norm`)."""
        rows = self.encoder.rel_embeddings.weight
        if hasattr(self.encoder, "LayerNorm"):
            rows = self.encoder.LayerNorm(rows)
        return rows

    def _position_projections(self, dtype: torch.dtype) -> list:
        """Per layer, the (key, query) projections of the relative position rows: they depend on the weights only,
        so they are computed at the first forward and kept."""
        key = (str(self.encoder.rel_embeddings.weight.device), dtype)
        found = self._positions.get(key)
        if found is None:
            with torch.no_grad():
                rows = self.rel_embeddings()
                found = [layer.attention.position_projections(rows) for layer in self.encoder.layer]
            self._positions[key] = found
        return found

    def _group(self, batch: ModelInput, start: int, lens: list[int], device: torch.device,
               key_mask: torch.Tensor | None) -> SequenceGroup:
        """Sequences of `lens` whose tokens are `start:` of the (length-sorted) states and of `key_mask`."""
        length, count = max(lens), sum(lens)
        lens_t = torch.tensor(lens, device=device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
        torch.cumsum(lens_t, 0, out=cu[1:])
        slots = torch.arange(length, device=device)
        valid = slots[None, :] < lens_t[:, None]
        starts = cu[:-1].long()[:, None]
        token_index = torch.where(valid, starts + slots[None, :], starts)
        positions = torch.arange(count, device=device) - torch.repeat_interleave(starts[:, 0], lens_t)
        sub = ModelInput(batch.input_ids.new_zeros(count), positions, cu, lens, length,  # metadata reads no ids
                         key_mask=None if key_mask is None else key_mask[start:start + count])
        return SequenceGroup(start, start + count, sub, token_index, valid,
                             self._relative_index(length, device) if self.spec is not None else None)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        x = self.embeddings(batch)
        device = x.device
        lens = batch.seq_lens
        order = None
        if self.spec is None:  # no bias: the backend attends the whole batch as it is
            groups = [SequenceGroup(0, batch.num_tokens, batch, *self._padding(batch, device), None)]
        else:
            plan = plan_groups(lens, MAX_PADDING)
            sequences = [i for members in plan for i in members]
            if sequences != list(range(len(lens))):  # sort the tokens by group, put them back at the end
                cu = batch.cu_seqlens.to(device=device, dtype=torch.long)
                seq = torch.tensor(sequences, device=device)
                seq_lens = torch.tensor(lens, device=device)[seq]
                first = torch.repeat_interleave(cu[:-1][seq], seq_lens)
                new_first = torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)
                order = first + torch.arange(batch.num_tokens, device=device) - new_first
                x = x[order]
            key_mask = batch.key_mask if batch.key_mask is None or order is None else batch.key_mask[order]
            groups, start = [], 0
            for members in plan:
                group_lens = [lens[i] for i in members]
                groups.append(self._group(batch, start, group_lens, device, key_mask))
                start += sum(group_lens)
        ctx = DebertaBatch(groups, lambda b, bias: self.attention_metadata(b, bias),
                           self._position_projections(x.dtype) if self.spec is not None else None)
        embeddings = x
        for i, layer in enumerate(self.encoder.layer):
            x = layer(x, ctx)
            if i == 0 and hasattr(self.encoder, "conv"):
                x = self.encoder.conv(embeddings, x, ctx)
        if order is not None:
            x = torch.empty_like(x).index_copy_(0, order, x)
        return x

    @staticmethod
    def _padding(batch: ModelInput, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_index, valid) of the whole batch padded to its longest sequence (for the convolution)."""
        length = batch.max_seqlen
        lens = torch.tensor(batch.seq_lens, device=device)
        slots = torch.arange(length, device=device)
        valid = slots[None, :] < lens[:, None]
        starts = batch.cu_seqlens[:-1].to(device=device, dtype=torch.long)[:, None]
        return torch.where(valid, starts + slots[None, :], starts), valid
