"""`cpu_flash_varlen`: the whole packed CPU batch in one call of a C++ flash-attention kernel.

The kernel (`kernels/cpu_flash_attention.cpp`, installed as `wde/kernels/`) reads q/k/v straight from the packed
[tokens, heads, head_dim] tensors (any token / head strides), splits the work into (sequence, head, run of 32-query
blocks) tasks over torch's intra-op threads (a sequence is cut into several runs only when the threads would lack
work), converts each task's reachable keys and values once, and walks each block's keys in tiles of 64 with the
online softmax: no padding, no gather, no per-sequence call, no [len, len] score matrix. float32 and bfloat16 (bf16
products as vdpbf16ps where the CPU has AVX512-BF16, else widened to float; the softmax in float); causal or
bidirectional, local windows (only the keys in reach are read) and key masks; a query row left with no key outputs
zeros, as on every backend. float32 inputs take the bf16 products too once `use_bf16_products` is called (an int8
model's attention: its q/k/v are rounded to bf16 as the kernel reads them).

The kernel is compiled once per host and Python environment by `wde.kernels.cpp_build` (the host's C++ compiler, no
download) into a cache folder (`WDE_KERNEL_CACHE`, default `~/.cache/wde/kernels`), keyed by the source, torch's
version and place, the instruction set it targets and the CPU's flags: `-O3 -fopenmp` (OpenMP, so that torch's
threads run its tasks) and `-march=native`, or AVX2 when `ATEN_CPU_CAPABILITY` caps torch at avx2 (plain x86-64 for
`default`). Where it cannot be built (no compiler) or is switched off (`WDE_CPU_FLASH=0`), one warning line says so
and the backend computes the same attention with `cpu_varlen`'s per-run SDPA calls; so does a float16 batch (or a
head_dim above 256, or q/k/v whose head_dim is strided).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from wde.components.attention.base import AttentionMetadata, AttentionParams, Window
from wde.components.attention.cpu_varlen import CpuVarlenBackend
from wde.components.attention.torch_sdpa import covering
from wde.components.base import BuildContext, Params
from wde.components.model_input_builder import ModelInput
from wde.components.models.cpu_linear import padded_rows
from wde.device import HOST_CPUINFO, cpu_flags, default_device
from wde.kernels.cpp_build import AVX2_FLAGS, KERNELS, isa_flags, load


DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256  # the kernel's MAX_D

@functools.cache
def load_kernel() -> ModuleType | None:
    """The compiled kernel module, built on first use and cached on disk (`wde.kernels.cpp_build`); None (said
    once) where it cannot be built or `WDE_CPU_FLASH=0` switches it off."""
    source, prefix, switch = KERNELS["cpu_flash"]
    return load(source, prefix, switch, "cpu_flash_varlen: kernel", "attention runs as cpu_varlen")


def vector_build() -> bool:
    """Whether the kernel is built for AVX-512 or AVX2 vectors: `-march=native` on a CPU with avx2, or torch capped at
    avx2 (not the plain x86-64 build of `ATEN_CPU_CAPABILITY=default`)."""
    flags = isa_flags()
    return flags == AVX2_FLAGS or (flags == ["-march=native"] and "avx2" in cpu_flags(HOST_CPUINFO))


def prefer_cpu_flash(seq_lens: list[int]) -> bool:
    """Whether `auto` sends a CPU batch (without a bias) with these lengths here: wherever the kernel is built for
    AVX-512 or AVX2, at any length. Sweeps of mean lengths 16-512 tokens (MiniLM 12 x 32 and BERT-base 12 x 64) found
    it faster than `cpu_varlen` at every one: 2-4x on AVX-512 (float32 and bfloat16), 1.04-1.7x on an AVX2-only Zen 3
    (float32, one thread; most at short texts), so the lengths, which `auto` passes for the rule to use, decide
    nothing today (docs/benchmarks.md)."""
    return len(seq_lens) > 0 and vector_build() and load_kernel() is not None


class CpuFlashVarlenBackend(CpuVarlenBackend):
    name = "cpu_flash_varlen"
    supports_window = True
    supports_key_mask = True

    @classmethod
    def cpu_kernels(cls, params: Params) -> tuple[str, ...]:
        return ("cpu_flash",)

    def __init__(self, params: AttentionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        # Build (or load) the kernel at start-up (the engine started its build first thing): a first build takes
        # ~30 s, which inside the first batch would hold its requests and trip --stall-timeout. (A model placed on
        # CPU on a GPU machine builds it at its first batch.)
        if default_device().type == "cpu":
            load_kernel()

    def use_bf16_products(self) -> bool:
        kernel = load_kernel() if default_device().type == "cpu" else None
        self.bf16_products = kernel is not None and kernel.bf16_dot_products()
        return self.bf16_products

    def build_metadata(self, batch: ModelInput, causal: bool, bias: torch.Tensor | None = None,
                       window: Window | None = None) -> AttentionMetadata:
        if bias is not None:  # supports_bias is False: models that need one refuse this backend at build time
            raise ValueError("attention 'cpu_flash_varlen' does not support an additive attention bias; use"
                             " attention: {name: torch_sdpa} (or auto) for this model")
        if batch.input_ids.device.type != "cpu":
            raise ValueError(f"attention 'cpu_flash_varlen' runs on CPU tensors, the batch is on"
                             f" {batch.input_ids.device}; use attention: {{name: auto}}")
        if load_kernel() is None:
            return super().build_metadata(batch, causal, window=window)
        meta = super(CpuVarlenBackend, self).build_metadata(batch, causal, window=window)
        window = covering(window, batch.max_seqlen)
        key_mask = None if batch.key_mask is None else batch.key_mask.contiguous()
        meta.extra = ("flash", batch.cu_seqlens.to(torch.int64).contiguous(), key_mask, window or (-1, -1), batch)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta.bias is not None:
            raise ValueError("attention 'cpu_flash_varlen' does not support an additive attention bias")
        if not (isinstance(meta.extra, tuple) and meta.extra[0] == "flash"):
            return super().forward(q, k, v, meta, scale)
        _, cu, key_mask, (left, right), batch = meta.extra
        if q.dtype not in DTYPES or q.shape[-1] > MAX_HEAD_DIM or not all(x.stride(-1) == 1 for x in (q, k, v)):
            inner = meta.cached("cpu_varlen", lambda: CpuVarlenBackend.build_metadata(self, batch, meta.causal,
                                                                                    window=meta.window))
            return super().forward(q, k, v, inner, scale)
        kernel = load_kernel()
        assert kernel is not None  # metadata of this shape is only built with the kernel loaded
        # the output's storage holds the rows the output projection pads to, so it pads without a copy
        return kernel.varlen_attention(q, k, v, cu, key_mask, meta.causal, left, right, float(scale),
                                       self.bf16_products, padded_rows(q.shape[0]))
