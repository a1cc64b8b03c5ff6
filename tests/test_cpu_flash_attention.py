"""`cpu_flash_varlen` (the packed C++ flash kernel) equals a float64 reference and `torch_sdpa` on random packed
batches (lengths 1..600, causal or not, windows, key masks with rows left without a key, GQA, float32 and bfloat16),
falls back to `cpu_varlen` where its kernel is switched off or cannot be built, stays correct when built for AVX2
under torch's AVX2 cap and on any thread count (a long sequence split across threads), takes the bf16 dot-product
path where the CPU has AVX512-BF16 (float32 inputs too when asked: an int8 model's), with AMX tile products where
the CPU has AMX (each test of that path runs both ways there), is what `auto` picks on CPU, and MiniLM served with it
matches sentence-transformers."""

from __future__ import annotations

import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.batches import bare_backend, packed_batch
from tests.tiny_models import varied_texts
from wde import Engine
from wde.components.attention import cpu_flash
from wde.components.attention.auto import AutoBackend
from wde.components.attention.cpu_flash import CpuFlashVarlenBackend, load_kernel
from wde.components.attention.cpu_varlen import CpuVarlenBackend
from wde.components.attention.torch_sdpa import TorchSDPABackend
from wde.components.model_input_builder import ModelInput

REPO = Path(__file__).resolve().parents[1]


def with_mask(lens: list[int], mask: torch.Tensor | None) -> ModelInput:
    batch = packed_batch(lens)
    batch.key_mask = mask
    return batch


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], causal: bool,
              window: tuple[int, int] | None, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Dense float64 attention per sequence; a query with no key to attend outputs zeros."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
        rep = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = torch.ones(n, n, dtype=torch.bool)
        if window is not None:
            keep = (j >= i - window[0]) & (j <= i + window[1])
        if causal:
            keep = keep & (j <= i)
        if mask is not None:
            keep = keep & mask[start:start + n][None, :]
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~keep, -math.inf)
        out.append((scores.softmax(-1).nan_to_num(0.0) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def case(seed: int, dtype: torch.dtype, head_dim: int, kv_heads: int, masked: bool):
    rng = random.Random(seed)
    lens = [rng.randint(1, 600) for _ in range(3)] + [rng.randint(1, 40) for _ in range(6)] + [1, 600]
    rng.shuffle(lens)
    t = sum(lens)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, 4 + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([4, kv_heads, kv_heads], dim=1)  # strided views of one projection, as the models make them
    mask = None
    if masked:
        mask = torch.rand(t, generator=gen) > 0.3
        mask[:lens[0]] = False  # a sequence with no key at all: every row outputs zeros
    return lens, q, k, v, mask


def tolerance(dtype: torch.dtype, expected: torch.Tensor) -> float:
    """float32: 1e-5; bfloat16: two units in the last place of the largest output (the output is rounded to bf16)."""
    return 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -7 * max(1.0, float(expected.abs().max()))


needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="cpu_flash_varlen's kernel cannot be built here")


@pytest.fixture(params=["amx", "vdpbf16ps"])
def products(request: pytest.FixtureRequest):
    """The bf16 path's products both ways on an AMX host: AMX tiles (the default there) and vdpbf16ps; elsewhere
    the amx case is skipped and the other is what runs."""
    kernel = load_kernel()
    if request.param == "amx" and (kernel is None or not kernel.amx_tiles()):
        pytest.skip("no AMX tile products in this build or process")
    if kernel is not None:
        kernel.set_amx(request.param == "amx")
    yield request.param
    if kernel is not None:
        kernel.set_amx(True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", [None, (7, 3), (100, 0)], ids=["global", "window", "left-window"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "key-mask"])
@pytest.mark.parametrize(("head_dim", "kv_heads"), [(32, 4), (64, 2), (48, 1), (256, 1)],
                         ids=["d32", "d64-gqa", "d48-mqa", "d256-mqa"])  # 256: Gemma 3
def test_matches_a_float64_reference(dtype: torch.dtype, causal: bool, window: tuple | None, masked: bool,
                                     head_dim: int, kv_heads: int, products: str) -> None:
    lens, q, k, v, mask = case(head_dim + kv_heads + causal, dtype, head_dim, kv_heads, masked)
    backend = bare_backend(CpuFlashVarlenBackend)
    meta = backend.build_metadata(with_mask(lens, mask), causal, window=window)
    assert meta.extra[0] == "flash"
    out = backend.forward(q, k, v, meta, head_dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference(q, k, v, lens, causal, window, mask, head_dim ** -0.5)
    err = float((out.double() - expected).abs().max())
    assert err <= tolerance(dtype, expected), f"max abs diff {err:.2e}"
    if mask is not None:
        assert bool((out[:lens[0]] == 0).all())  # no key to attend: zeros, never NaN
    sdpa = bare_backend(TorchSDPABackend)
    theirs = sdpa.forward(q, k, v, sdpa.build_metadata(with_mask(lens, mask), causal, window=window), head_dim ** -0.5)
    assert float((out.double() - theirs.double()).abs().max()) <= 2 * tolerance(dtype, expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("head_dim", "padded"), [(8, 32), (26, 32), (72, 96), (80, 96), (104, 128)],
                         ids=["d8", "d26-tinybert", "d72-siglip-so400m", "d80-clip-vit-h", "d104-vit-bigg"])
def test_other_head_sizes_run_zero_padded_to_a_vector_path(dtype: torch.dtype, head_dim: int, padded: int,
                                                          products: str) -> None:
    """A head size the vector paths are not built for runs at the next one (32, 64, 96, 128, 256), its rows read
    zero-padded by the kernel's loads (q/k/v are strided views whose neighbouring heads are not zeros): exactly the
    call on q/k/v padded by hand, its extra output columns dropped; within the float64 reference's bound (a window
    and a key mask too), its output holding the output projection's padded rows."""
    from wde.components.models.cpu_linear import padded_rows

    lens, q, k, v, mask = case(head_dim, dtype, head_dim, 2, True)
    kernel = load_kernel()
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int64)
    tokens, scale = sum(lens), head_dim ** -0.5
    out = kernel.varlen_attention(q, k, v, cu, mask, False, 5, 9, scale, False, padded_rows(tokens))
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert out.untyped_storage().nbytes() == padded_rows(tokens) * q.shape[1] * head_dim * out.element_size()
    pad = [torch.nn.functional.pad(x, (0, padded - head_dim)) for x in (q, k, v)]
    by_hand = kernel.varlen_attention(*pad, cu, mask, False, 5, 9, scale)
    assert torch.equal(out, by_hand[..., :head_dim]) and not by_hand[..., head_dim:].any()
    expected = reference(q, k, v, lens, False, (5, 9), mask, scale)
    assert float((out.double() - expected).abs().max()) <= tolerance(dtype, expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_output_holds_the_output_projections_padded_rows_in_place(dtype: torch.dtype) -> None:
    """The backend's output is the first rows of a tensor with `padded_rows` of them: the same values as an output
    of its own size, and the output projection (`onednn_linear`) pads it without a copy. `out_rows` below the
    tokens is refused."""
    from wde.components.models.cpu_linear import _padded_in_place, padded_rows

    lens, q, k, v, _ = case(5, dtype, 32, 2, False)
    tokens = sum(lens)
    assert padded_rows(tokens) > tokens
    backend = bare_backend(CpuFlashVarlenBackend)
    out = backend.forward(q, k, v, backend.build_metadata(with_mask(lens, None), False), 32 ** -0.5)
    assert out.shape == q.shape and out.is_contiguous()
    assert out.untyped_storage().nbytes() == padded_rows(tokens) * 4 * 32 * out.element_size()
    flat = out.reshape(tokens, -1)
    assert _padded_in_place(flat, padded_rows(tokens), dtype).data_ptr() == out.data_ptr()
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int64)
    own = load_kernel().varlen_attention(q, k, v, cu, None, False, -1, -1, 32 ** -0.5)
    assert own.untyped_storage().nbytes() == tokens * 4 * 32 * own.element_size() and torch.equal(out, own)
    with pytest.raises(RuntimeError, match="out_rows"):
        load_kernel().varlen_attention(q, k, v, cu, None, False, -1, -1, 32 ** -0.5, False, tokens - 1)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_a_long_sequence_is_split_across_threads_and_every_thread_count_is_exact(threads: int, products: str) -> None:
    """Tasks are runs of query blocks of one (sequence, key/value head), sharing its converted keys and values; one long
    sequence is cut into several runs per key/value head only where the threads would otherwise lack work."""
    kernel = load_kernel()
    cu = torch.tensor([0, 1500])
    tasks = kernel.plan_tasks(cu, 4, False, -1, -1, threads)
    blocks = math.ceil(1500 / 32)
    for head in range(4):  # each head's blocks covered once, in consecutive runs
        runs = sorted((b0, b1) for s, h, b0, b1 in tasks if h == head)
        assert [b for run in runs for b in range(*run)] == list(range(blocks)) and all(s == 0 for s, *_ in tasks)
    assert len(tasks) == 4 if threads == 1 else len(tasks) >= 4 * threads
    many = kernel.plan_tasks(torch.tensor([0] + [300] * 40).cumsum(0), 4, False, -1, -1, threads)
    assert len(many) == 160  # enough (sequence, head) pairs: no sequence is cut
    # GQA: a task runs every query head of its key/value head's group against one conversion of its keys and values
    grouped = kernel.plan_tasks(torch.tensor([0] + [300] * 40).cumsum(0), 4, False, -1, -1, threads, kv_heads=2)
    assert sorted((s, h) for s, h, *_ in grouped) == [(s, h) for s in range(40) for h in range(2)]
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        kernel.plan_tasks(cu, 4, False, -1, -1, threads, kv_heads=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernel.parallel_workers() == threads  # built with OpenMP: the tasks run on torch's threads
        for dtype, head_dim, causal, window in ((torch.float32, 64, False, None), (torch.bfloat16, 32, True, None),
                                                (torch.bfloat16, 128, False, (200, 50)), (torch.float32, 48, True,
                                                                                          (300, 0))):
            gen = torch.Generator().manual_seed(head_dim)
            q, k, v = torch.randn(3, 1500, 4, head_dim, generator=gen).to(dtype).unbind(0)
            out = kernel.varlen_attention(q, k, v, cu, None, causal, *(window or (-1, -1)), head_dim ** -0.5)
            expected = reference(q, k, v, [1500], causal, window, None, head_dim ** -0.5)
            err = float((out.double() - expected).abs().max())
            assert err <= tolerance(dtype, expected), (dtype, head_dim, causal, window, err)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_nan_in_one_sequence_stays_in_it(dtype: torch.dtype, products: str) -> None:
    """On one thread, the short sequence reuses the buffer that held the long one's NaN keys and values: the keys
    past its end that the kernel reads must be zeros, not what the buffer held before."""
    lens = [200, 5]
    q, k, v = torch.randn(3, sum(lens), 2, 32, generator=torch.Generator().manual_seed(3)).to(dtype).unbind(0)
    k[:200, :, 7] = float("nan")
    v[:200, :, 9] = float("nan")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = load_kernel().varlen_attention(q, k, v, torch.tensor([0, 200, 205]), None, False, -1, -1, 0.2)
    finally:
        torch.set_num_threads(previous)
    expected = reference(q[200:], k[200:], v[200:], [5], False, None, None, 0.2)
    assert float((out[200:].double() - expected).abs().max()) <= tolerance(dtype, expected)


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_bf16_takes_the_dot_product_path_where_the_cpu_has_avx512_bf16(head_dim: int, products: str) -> None:
    """Under -march=native on a CPU with avx512_bf16, bf16 Q.K^T and P.V run as vdpbf16ps (P rounded to bf16); the
    result stays within two bf16 units of the float64 reference and close to the float32 path on the same inputs."""
    kernel = load_kernel()
    flags = cpu_flash.cpu_flags(cpu_flash.HOST_CPUINFO)
    assert kernel.bf16_dot_products() == ("avx512_bf16" in flags and cpu_flash.isa_flags() == ["-march=native"])
    lens, q, k, v, mask = case(head_dim, torch.bfloat16, head_dim, 2, True)
    cu = torch.tensor([0] + lens).cumsum(0)
    out = kernel.varlen_attention(q, k, v, cu, mask, False, -1, -1, head_dim ** -0.5)
    expected = reference(q, k, v, lens, False, None, mask, head_dim ** -0.5)
    assert float((out.double() - expected).abs().max()) <= tolerance(torch.bfloat16, expected)
    wide = kernel.varlen_attention(q.float(), k.float(), v.float(), cu, mask, False, -1, -1, head_dim ** -0.5)
    live = wide.flatten(1).norm(dim=-1) > 0  # tokens with a key to attend (none in the first sequence)
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(1)[live], wide.flatten(1)[live], dim=-1)
    assert int(live.sum()) > 100 and float(cos.min()) >= 0.999


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_amx_tiles_where_the_cpu_has_amx_and_the_same_attention_as_vdpbf16ps(head_dim: int) -> None:
    """On a CPU with AMX (Sapphire Rapids and later) the bf16 path's Q.K^T and P.V run as tile products; they give
    the vdpbf16ps path's result within bf16 rounding (the same bf16 inputs and weights, another summation order)."""
    kernel = load_kernel()
    flags = cpu_flash.cpu_flags(cpu_flash.HOST_CPUINFO)
    native_amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags and cpu_flash.isa_flags() == ["-march=native"]
    if not native_amx:
        assert not kernel.amx_tiles()
    if not kernel.amx_tiles():
        pytest.skip("no AMX tile products here")
    lens, q, k, v, mask = case(head_dim + 7, torch.bfloat16, head_dim, 2, True)
    cu = torch.tensor([0] + lens).cumsum(0)
    try:
        kernel.set_amx(False)
        assert not kernel.amx_tiles()
        dp = kernel.varlen_attention(q, k, v, cu, mask, True, 40, -1, head_dim ** -0.5)
    finally:
        kernel.set_amx(True)
    tiles = kernel.varlen_attention(q, k, v, cu, mask, True, 40, -1, head_dim ** -0.5)
    expected = reference(q, k, v, lens, True, (40, 0), mask, head_dim ** -0.5)
    assert float((tiles.double() - expected).abs().max()) <= tolerance(torch.bfloat16, expected)
    assert float((tiles.double() - dp.double()).abs().max()) <= tolerance(torch.bfloat16, expected)


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 64, 48])
def test_float32_inputs_take_bf16_products_when_asked(head_dim: int, products: str) -> None:
    """`bf16_products` (an int8 model's attention): float32 q/k/v are rounded to bf16 as they are read and take the
    dot-product path, float32 out, within the bf16 path's bound (head_dim 48 too, zero-padded to 64); where the build
    has no such path (no AVX512-BF16), the call is the float32 one, bit for bit. Through the backend: off until
    `use_bf16_products`, which says whether it took."""
    kernel = load_kernel()
    lens, q, k, v, mask = case(head_dim + 1, torch.float32, head_dim, 2, True)
    cu = torch.tensor([0] + lens).cumsum(0)
    exact = kernel.varlen_attention(q, k, v, cu, mask, False, -1, -1, head_dim ** -0.5)
    out = kernel.varlen_attention(q, k, v, cu, mask, False, -1, -1, head_dim ** -0.5, True)
    assert out.dtype == torch.float32
    if kernel.bf16_dot_products():
        rounded = [x.bfloat16() for x in (q, k, v)]
        expected = reference(*rounded, lens, False, None, mask, head_dim ** -0.5)
        assert float((out.double() - expected).abs().max()) <= tolerance(torch.bfloat16, expected)
        assert not torch.equal(out, exact)
    else:
        assert torch.equal(out, exact)
    backend = bare_backend(CpuFlashVarlenBackend)
    meta = backend.build_metadata(with_mask(lens, mask), False)
    assert torch.equal(backend.forward(q, k, v, meta, head_dim ** -0.5), exact)
    assert backend.use_bf16_products() == kernel.bf16_dot_products()
    assert torch.equal(backend.forward(q, k, v, meta, head_dim ** -0.5), out)


@needs_kernel
def test_a_query_whose_only_causal_key_is_masked_outputs_zeros(products: str) -> None:
    lens = [5, 1, 3]
    mask = torch.tensor([False, True, True, True, True, False, False, True, True])
    q, k, v = torch.randn(3, 9, 2, 16).unbind(0)
    backend = bare_backend(CpuFlashVarlenBackend)
    out = backend.forward(q, k, v, backend.build_metadata(with_mask(lens, mask), True), 0.25)
    assert bool((out[[0, 5, 6]] == 0).all()) and bool((out[[1, 2, 3, 4, 7, 8]] != 0).any(-1).all())
    torch.testing.assert_close(out, reference(q, k, v, lens, True, None, mask, 0.25).float(), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_float16_a_wide_or_strided_head_dim_fall_back_to_cpu_varlen() -> None:
    lens = [3, 17, 40]
    backend = bare_backend(CpuFlashVarlenBackend)
    meta = backend.build_metadata(packed_batch(lens), False, window=(4, 4))
    q, k, v = torch.randn(3, 60, 4, 16).unbind(0)
    expected = reference(q, k, v, lens, False, (4, 4), None, 0.25)
    half = backend.forward(q.half(), k.half(), v.half(), meta, 0.25)
    assert half.dtype == torch.float16 and float((half.double() - expected).abs().max()) <= 5e-3
    strided = backend.forward(*(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)), meta, 0.25)
    torch.testing.assert_close(strided, expected.float(), atol=1e-5, rtol=1e-5)
    wide = torch.randn(3, 60, 2, 272).unbind(0)  # head_dim above the kernel's 256
    torch.testing.assert_close(backend.forward(*wide, meta, 0.05), reference(*wide, lens, False, (4, 4), None,
                                                                             0.05).float(), atol=1e-5, rtol=1e-5)


def test_a_bias_and_a_cuda_batch_are_refused_by_name() -> None:
    backend = bare_backend(CpuFlashVarlenBackend)
    with pytest.raises(ValueError, match="cpu_flash_varlen.*bias.*torch_sdpa"):
        backend.build_metadata(packed_batch([3, 2]), False, torch.zeros(4, 3, 3))
    batch = packed_batch([3, 2])
    batch.input_ids = torch.empty(5, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="cpu_flash_varlen.*CPU tensors.*meta"):
        backend.build_metadata(batch, False)


@pytest.fixture
def fresh_kernel_state(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """`load_kernel` re-decides under the test's environment, and decides again (from the real one) after it."""
    load_kernel.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    load_kernel.cache_clear()


@pytest.mark.parametrize("why", ["switched off", "no compiler"])
def test_without_the_kernel_it_computes_the_same_as_cpu_varlen(fresh_kernel_state: pytest.MonkeyPatch, why: str,
                                                                tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    if why == "switched off":
        fresh_kernel_state.setenv("WDE_CPU_FLASH", "0")
    else:  # a real build attempt in an empty cache, with a compiler that does not exist
        fresh_kernel_state.setenv("WDE_KERNEL_CACHE", str(tmp_path))
        fresh_kernel_state.setenv("CXX", str(tmp_path / "no-such-g++"))
    with caplog.at_level(logging.WARNING, logger="wde"):
        assert load_kernel() is None
    assert any("cpu_flash_varlen" in r.getMessage() and "cpu_varlen" in r.getMessage() for r in caplog.records)
    lens = [1, 30, 200, 30, 30]
    mask = torch.rand(sum(lens)) > 0.2
    q, k, v = torch.randn(3, sum(lens), 4, 16).unbind(0)
    flash, varlen = bare_backend(CpuFlashVarlenBackend), bare_backend(CpuVarlenBackend)
    for causal, window in ((False, None), (True, (8, 0))):
        out = flash.forward(q, k, v, flash.build_metadata(with_mask(lens, mask), causal, window=window), 0.25)
        same = varlen.forward(q, k, v, varlen.build_metadata(with_mask(lens, mask), causal, window=window), 0.25)
        assert torch.equal(out, same)
        torch.testing.assert_close(out, reference(q, k, v, lens, causal, window, mask, 0.25).float(), atol=1e-5,
                                   rtol=1e-5)
    assert not cpu_flash.prefer_cpu_flash([3, 4])


def test_auto_picks_cpu_flash_varlen_for_unbiased_cpu_batches_of_any_length_where_it_is_built(
        fresh_kernel_state: pytest.MonkeyPatch) -> None:
    auto = bare_backend(AutoBackend)
    auto._cpu = auto._cuda = bare_backend(TorchSDPABackend)  # type: ignore[attr-defined]
    auto._cpu_varlen = bare_backend(CpuVarlenBackend)  # type: ignore[attr-defined]
    auto._cpu_flash = bare_backend(CpuFlashVarlenBackend)  # type: ignore[attr-defined]
    short, long = packed_batch([5, 9, 3]), packed_batch([100, 300])
    built = load_kernel() is not None and cpu_flash.vector_build()  # AVX-512 or AVX2 vectors
    assert built == (load_kernel() is not None and "avx2" in cpu_flash.cpu_flags(cpu_flash.HOST_CPUINFO))
    assert cpu_flash.prefer_cpu_flash([5, 9, 3]) == built and cpu_flash.prefer_cpu_flash([100, 300]) == built
    assert type(auto.build_metadata(short, False).extra[0]) is (CpuFlashVarlenBackend if built else TorchSDPABackend)
    assert type(auto.build_metadata(long, False).extra[0]) is (CpuFlashVarlenBackend if built else CpuVarlenBackend)
    assert type(auto.build_metadata(long, False, torch.zeros(4, 300, 300)).extra[0]) is TorchSDPABackend
    fresh_kernel_state.setenv("ATEN_CPU_CAPABILITY", "default")  # plain x86-64: no vectors to speak of
    assert not cpu_flash.vector_build() and not cpu_flash.prefer_cpu_flash([100, 300])
    fresh_kernel_state.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_flash.vector_build()
    fresh_kernel_state.delenv("ATEN_CPU_CAPABILITY")
    fresh_kernel_state.setenv("WDE_CPU_FLASH", "0")
    load_kernel.cache_clear()
    assert type(auto.build_metadata(short, False).extra[0]) is TorchSDPABackend
    assert type(auto.build_metadata(long, False).extra[0]) is CpuVarlenBackend


@needs_kernel
def test_the_avx2_build_is_correct_under_torchs_avx2_cap() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    script = """
import torch
from wde.components.attention.cpu_flash import isa_flags, load_kernel, prefer_cpu_flash
from tests.test_cpu_flash_attention import case, reference, tolerance
assert isa_flags() == ["-mavx2", "-mfma", "-mf16c"], isa_flags()
assert prefer_cpu_flash([30, 300])  # auto runs the AVX2 build (faster than cpu_varlen at 16-512 tokens)
kernel = load_kernel()
assert kernel is not None and not kernel.bf16_dot_products()
for dtype in (torch.float32, torch.bfloat16):
    for causal, window in ((False, None), (True, (9, 0)), (False, (5, 20))):
        lens, q, k, v, mask = case(7, dtype, 64, 2, True)
        cu = torch.tensor([0] + lens).cumsum(0)
        out = kernel.varlen_attention(q, k, v, cu, mask, causal, *(window or (-1, -1)), 0.125)
        expected = reference(q, k, v, lens, causal, window, mask, 0.125)
        assert float((out.double() - expected).abs().max()) <= tolerance(dtype, expected), (dtype, causal, window)
        asked = kernel.varlen_attention(q, k, v, cu, mask, causal, *(window or (-1, -1)), 0.125, True)
        assert torch.equal(asked, out)  # no bf16 dot products in this build: bf16_products changes nothing
print("ok", torch.backends.cpu.get_cpu_capability())
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok", "AVX2"]


@needs_kernel
def test_minilm_with_cpu_flash_varlen_matches_sentence_transformers(minilm_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    texts = varied_texts(40, seed=5) + ["x", " ".join(["word"] * 240)]
    ref = SentenceTransformer(str(minilm_path), device="cpu").encode(texts, batch_size=16, convert_to_numpy=True)
    with Engine.from_workflow(None, minilm_path, dtype="float32", device="cpu",
                              attention={"name": "cpu_flash_varlen"}) as engine:
        assert isinstance(engine.components["attention"], CpuFlashVarlenBackend)
        got = engine.embed(texts)
    diff = float(np.abs(got - ref).max())
    assert diff <= 1e-4, f"max abs diff {diff:.2e}"


def test_an_engine_on_cpu_has_the_kernel_before_its_first_batch(fresh_kernel_state: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """The kernel is built (or loaded from the cache) while the engine is built, not inside the first batch, where a
    first build's ~35 s would hold that batch's requests and trip the stall timeout."""
    from tests.tiny_models import build_bert

    fresh_kernel_state.setenv("WDE_DEVICE", "cpu")
    path = build_bert(tmp_path / "bert")
    with Engine.from_workflow("bert", str(path), device="cpu",
                              overrides=["attention.name=auto", "pooler.params.pooling=mean"]):
        assert load_kernel.cache_info().currsize == 1  # decided at build; no batch has run
