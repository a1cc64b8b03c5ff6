"""Local (windowed) attention: every backend equals per-sequence attention with an explicit window mask, with
sequences longer than the window, mixed lengths, GQA and the causal mask on top; the Triton kernel in the
interpreter on small shapes. A model with local layers gets one metadata per window, built once per batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.batches import bare_backend, packed_batch
from wde.components.attention import cpu_varlen
from wde.components.attention.base import check_window, window_keys
from wde.components.attention.cpu_varlen import CpuVarlenBackend
from wde.components.attention.torch_sdpa import TorchSDPABackend


def reference(q, k, v, lens, window, causal, scale):
    """Per-sequence attention with the full [n, n] window mask: what every backend must give."""
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start:start + n].transpose(0, 1)
        ks = k[start:start + n].transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[start:start + n].transpose(0, 1).repeat_interleave(rep, 0)
        mask = window_keys(n, window, causal)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


CASES = [
    ([300], (8, 8)), ([300, 300], (64, 64)), ([5, 290, 40, 133, 1, 260], (16, 16)), ([200, 7, 200], (0, 3)),
    ([150, 150, 60], (32, 0)), ([20, 20], (100, 100)), ([129, 128, 257], (63, 64)),
]


@pytest.mark.parametrize("backend_cls", [TorchSDPABackend, CpuVarlenBackend])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("lens", "window"), CASES)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_window_matches_per_sequence_mask(backend_cls: type, causal: bool, lens: list[int], window: tuple[int, int],
                                          kv_heads: int) -> None:
    torch.manual_seed(len(lens) + window[0])
    t = sum(lens)
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, kv_heads, 16), torch.randn(t, kv_heads, 16)
    backend = bare_backend(backend_cls)
    meta = backend.build_metadata(packed_batch(lens), causal, window=window)
    assert meta.window == window
    out = backend.forward(q, k, v, meta, 0.25)
    torch.testing.assert_close(out, reference(q, k, v, lens, window, causal, 0.25), atol=1e-5, rtol=1e-5)


def test_cpu_varlen_computes_only_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """No [L, L] score matrix: every SDPA call sees at most WINDOW_BLOCK + left + right keys."""
    seen: list[tuple[int, int]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(cpu_varlen.F, "scaled_dot_product_attention", spy)
    lens, window = [2000, 700], (32, 32)
    backend = bare_backend(CpuVarlenBackend)
    t = sum(lens)
    q = k = v = torch.randn(t, 2, 8)
    backend.forward(q, k, v, backend.build_metadata(packed_batch(lens), False, window=window), 0.3)
    assert seen and max(keys for _, keys in seen) <= cpu_varlen.WINDOW_BLOCK + sum(window)
    assert sum(queries for queries, _ in seen) == t


def test_a_window_covering_every_sequence_is_plain_attention() -> None:
    lens = [30, 12]
    torch.manual_seed(0)
    q = k = v = torch.randn(sum(lens), 2, 8)
    for cls in (TorchSDPABackend, CpuVarlenBackend):
        backend = bare_backend(cls)
        windowed = backend.forward(q, k, v, backend.build_metadata(packed_batch(lens), False, window=(29, 29)), 0.3)
        plain = backend.forward(q, k, v, backend.build_metadata(packed_batch(lens), False), 0.3)
        torch.testing.assert_close(windowed, plain)


@pytest.mark.parametrize("window", [(-1, 3), (2,), (1.5, 2), [3, 3], (True, 1)])
def test_bad_windows_are_refused(window: object) -> None:
    with pytest.raises(ValueError, match=r"attention window must be \(left, right\)"):
        check_window(window)  # type: ignore[arg-type]


def test_a_backend_without_windows_refuses_one() -> None:
    from wde.components.attention.base import AttentionBackend

    class NoWindow(AttentionBackend):
        name = "no_window"

    backend = bare_backend(NoWindow)
    with pytest.raises(ValueError, match="does not support local"):
        backend.build_metadata(packed_batch([5]), False, window=(1, 1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("lens", "window"), [([70, 5, 33], (8, 8)), ([100], (0, 20)), ([40, 41], (16, 0))])
def test_triton_kernel_window_in_the_interpreter(causal: bool, lens: list[int], window: tuple[int, int]) -> None:
    from wde.kernels import varlen_attention

    if not varlen_attention.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    dev = "cpu" if varlen_attention.INTERPRETED else "cuda"  # compiled kernels (a GPU host) take CUDA tensors
    torch.manual_seed(1)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 16).to(dev) for h in (2, 1, 1))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    out = varlen_attention.varlen_attention(q, k, v, cu, max(lens), causal, 0.25, window=window)
    tol = 1e-4 if dev == "cpu" else 5e-3  # compiled float32 dots may run in TF32 on the GPU
    expected = reference(q.cpu(), k.cpu(), v.cpu(), lens, window, causal, 0.25)
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)
