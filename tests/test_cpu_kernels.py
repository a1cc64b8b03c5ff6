"""Mixed precision's per-host kernel dtype (wde/components/models/cpu_kernels.py): float32 GEMMs or attention where
this CPU runs them clearly faster than the low dtype, decided from timings cached per host; every combination keeps
the fidelity bound on every CPU path (run again with ATEN_CPU_CAPABILITY=avx2 in .ci/run)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_parity_minilm import parity_texts
from wde import Engine
from wde.components.models import cpu_kernels
from wde.components.models.cpu_kernels import Float32Attention
from wde.components.models.cpu_linear import PackedLinear
from wde.components.models.mixed_precision import CastLinear

MIN_COSINE = 0.9999


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WDE_CACHE_DIR", str(tmp_path))
    return tmp_path / "cpu_kernels.json"


def CANDIDATES() -> dict:
    return {"low": lambda: None, "float32": lambda: None}


def fixed(times: dict[str, float]):
    calls = []

    def timer(fns):
        assert set(fns) == {"low", "float32"}
        calls.append(1)
        return dict(times)
    timer.calls = calls  # type: ignore[attr-defined]
    return timer


@pytest.mark.parametrize(("low", "fp32", "expected"), [
    (2.0, 1.0, torch.float32),  # float32 clearly faster
    (1.1, 1.0, torch.bfloat16),  # within the margin: the dtype asked for
    (0.5, 1.0, torch.bfloat16),  # bf16 faster (AMX, Zen 5)
])
def test_decide_takes_float32_only_when_clearly_faster(cache: Path, low: float, fp32: float,
                                                       expected: torch.dtype) -> None:
    timer = fixed({"low": low, "float32": fp32})
    assert cpu_kernels.decide("linear layers", [(8, 8)], torch.bfloat16, CANDIDATES, timer) == expected
    assert len(timer.calls) == 1


def test_verdict_is_cached_per_host_and_shapes(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    first = fixed({"low": 3.0, "float32": 1.0})
    with caplog.at_level(logging.INFO, "wde.models"):
        assert cpu_kernels.decide("attention", [(1, 2, 3, 4)], torch.bfloat16, CANDIDATES, first) == torch.float32
    assert "took 3.00x the time of float32" in caplog.text and "running them in float32" in caplog.text
    saved = json.loads(cache.read_text())
    assert len(saved) == 1 and cpu_kernels.host_key() in next(iter(saved))

    def must_not_time(fns):
        raise AssertionError("a cached verdict must not be measured again")
    assert cpu_kernels.decide("attention", [(1, 2, 3, 4)], torch.bfloat16, CANDIDATES, must_not_time) == torch.float32
    other_shape = fixed({"low": 1.0, "float32": 1.0})
    assert cpu_kernels.decide("attention", [(9, 2, 3, 4)], torch.bfloat16, CANDIDATES, other_shape) == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "host_key", lambda: "another CPU")
    other_host = fixed({"low": 1.0, "float32": 1.0})
    assert cpu_kernels.decide("attention", [(1, 2, 3, 4)], torch.bfloat16, CANDIDATES, other_host) == torch.bfloat16
    assert len(other_host.calls) == 1


def test_unreadable_or_unwritable_cache_only_means_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("WDE_CACHE_DIR", str(blocker / "sub"))
    timer = fixed({"low": 2.0, "float32": 1.0})
    assert cpu_kernels.decide("linear layers", [(8, 8)], torch.bfloat16, CANDIDATES, timer) == torch.float32
    assert cpu_kernels.decide("linear layers", [(8, 8)], torch.bfloat16, CANDIDATES, timer) == torch.float32
    assert len(timer.calls) == 2


def test_large_models_keep_the_low_dtype_without_timing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 16))

    def must_not_time(fns):
        raise AssertionError("not measured")
    monkeypatch.setattr(cpu_kernels, "MAX_FLOAT32_BYTES", 64 * 64 * 4)
    assert cpu_kernels.linear_dtype("auto", model, torch.bfloat16, must_not_time) == torch.bfloat16
    assert cpu_kernels.linear_dtype("float32", model, torch.bfloat16, must_not_time) == torch.float32
    assert cpu_kernels.linear_dtype("low", model, torch.bfloat16, must_not_time) == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "MAX_FLOAT32_BYTES", 2 << 30)
    timer = fixed({"low": 2.0, "float32": 1.0})
    assert cpu_kernels.linear_dtype("auto", model, torch.bfloat16, timer) == torch.float32


def test_real_timings_run_and_decide(cache: Path) -> None:
    """The measurement itself (small shapes): both paths run, and a verdict is cached."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Linear(96, 32))
    assert cpu_kernels.linear_dtype("auto", model, torch.bfloat16) in (torch.bfloat16, torch.float32)
    assert cpu_kernels.attention_dtype("auto", 2, 16, torch.bfloat16) in (torch.bfloat16, torch.float32)
    assert len(json.loads(cache.read_text())) == 2


def test_attention_is_timed_through_the_models_own_backend(cache: Path) -> None:
    """`auto` times the backend the model will run (not PyTorch's SDPA): packed groups in the low dtype, as is and
    cast up to float32, and caches the verdict under the backend's name."""
    seen: list[tuple[str, torch.dtype, tuple[int, ...], list[int], bool]] = []

    class Spy:
        name = "spy"

        def build_metadata(self, batch, causal):
            return (batch.seq_lens, batch.cu_seqlens.tolist(), causal)

        def forward(self, q, k, v, meta, scale):
            seen.append(("call", q.dtype, tuple(q.shape), meta[0], meta[2]))
            assert meta[1][-1] == q.shape[0] and scale == q.shape[-1] ** -0.5
            return q

    got = cpu_kernels.attention_dtype("auto", 3, 8, torch.bfloat16, backend=Spy(), causal=True)
    assert got in (torch.bfloat16, torch.float32)
    groups = {(shape, tuple(lens)) for _, _, shape, lens, _ in seen}
    assert groups == {((n * length, 3, 8), (length,) * n) for n, length in cpu_kernels.ATTENTION_LENGTHS}
    assert {dtype for _, dtype, *_ in seen} == {torch.bfloat16, torch.float32} and all(c for *_, c in seen)
    key, = json.loads(cache.read_text())
    assert "|attention (spy, causal)|bfloat16|" in key
    seen.clear()  # cached: the next start does not time again
    assert cpu_kernels.attention_dtype("auto", 3, 8, torch.bfloat16, backend=Spy(), causal=True) == got
    assert not seen


def test_a_bf16_model_times_its_own_attention_backend(cache: Path, tiny_bert: Path) -> None:
    """End to end on a fresh host: a bf16 model's start times its linear layers and its own attention backend
    (`auto`, whose packed CPU kernel runs these groups), both verdicts cached."""
    with Engine.from_workflow("bert", tiny_bert, dtype="bfloat16", device="cpu",
                              overrides=["pooler.params.pooling=mean"]) as engine:
        model = engine.components["model"]
        assert model.attention_dtype in (torch.bfloat16, torch.float32)
        assert np.isfinite(engine.embed(["a text"])).all()
    kinds = {key.split("|")[3] for key in json.loads(cache.read_text())}
    assert kinds == {"linear layers", "attention (auto)"}


def test_float32_attention_wraps_any_backend() -> None:
    class Inner:
        name, supports_bias = "inner", True

        def build_metadata(self, *a, **k):
            return "meta"

        def forward(self, q, k, v, meta, scale):
            assert q.dtype == k.dtype == v.dtype == torch.float32 and meta == "meta"
            return q * scale

    wrapped = Float32Attention(Inner())
    assert wrapped.name == "inner" and wrapped.supports_bias and wrapped.build_metadata() == "meta"
    q = torch.randn(5, 2, 4).to(torch.bfloat16)
    out = wrapped.forward(q, q, q, "meta", 0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, (q.float() * 0.5).to(torch.bfloat16))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def _seed(cache: Path, linear_float32: bool, attention_float32: bool) -> None:
    """Cached verdicts for MiniLM's shapes, as a host of each kind would have measured them."""
    low = torch.bfloat16
    shapes = {"linear layers": [(384, 384), (384, 1152), (384, 1536), (1536, 384)],
              "attention": [(n, 12, length, 32) for n, length in cpu_kernels.ATTENTION_LENGTHS]}
    shapes[cpu_kernels.attention_kind(_Named("auto"))] = shapes.pop("attention")  # MiniLM's backend: auto
    wins = {"linear layers": linear_float32, cpu_kernels.attention_kind(_Named("auto")): attention_float32}
    data = {f"{cpu_kernels.host_key()}|{kind}|bfloat16|{sorted(set(s))}": {"low": 2.0 if wins[kind] else 1.0,
                                                                          "float32": 1.0}
            for kind, s in shapes.items()}
    assert str(low) == "torch.bfloat16"
    cache.write_text(json.dumps(data))


@pytest.mark.parametrize(("linear_float32", "attention_float32"), [(False, False), (False, True), (True, True)])
def test_every_kernel_choice_keeps_minilm_fidelity(cache: Path, minilm_path: Path, minilm_engine: Engine,
                                                    linear_float32: bool, attention_float32: bool) -> None:
    """Whatever a host's timings pick, bf16 mixed precision stays within the bound of the float32 model; float32
    everywhere is the float32 model itself, its output rounded to bf16."""
    _seed(cache, linear_float32, attention_float32)
    texts = parity_texts()
    fp32 = minilm_engine.embed(texts, truncate=True)
    with Engine.from_workflow("bert", minilm_path, dtype="bfloat16", device="cpu") as engine:
        model = engine.components["model"]
        assert model.dtype == torch.bfloat16
        assert model.linear_dtype == (torch.float32 if linear_float32 else torch.bfloat16)
        assert model.attention_dtype == (torch.float32 if attention_float32 else torch.bfloat16)
        assert isinstance(model.attn_backend, Float32Attention) == attention_float32
        qkv = model.encoder.layer[0].attention.qkv
        assert isinstance(qkv, (PackedLinear, CastLinear))
        assert (qkv.dtype if isinstance(qkv, PackedLinear) else qkv.weight.dtype) == model.linear_dtype
        bf16 = engine.embed(texts, truncate=True)
    cos = _cosines(fp32, bf16)
    assert cos.min() >= MIN_COSINE, f"min cosine {cos.min():.6f} on {texts[int(cos.argmin())][:60]!r}"
    if linear_float32:
        assert cos.min() >= 0.99999 and np.abs(fp32 - bf16).max() <= 4e-3  # bf16 rounding of the output only


def test_explicit_choices_override_the_timings(cache: Path, tiny_bert: Path) -> None:
    _seed(cache, True, True)
    for choice, dtype in (("low", torch.bfloat16), ("float32", torch.float32)):
        with Engine.from_workflow("bert", tiny_bert, dtype="bfloat16", device="cpu",
                                  overrides=["pooler.params.pooling=mean",
                                             f"model.params.mixed_precision_kernels={choice}"]) as engine:
            model = engine.components["model"]
            assert model.linear_dtype == dtype and model.attention_dtype == dtype
            assert np.isfinite(engine.embed(["a text"])).all()


def test_engines_starting_together_measure_once_and_agree(tmp_path: Path) -> None:
    """wde embed --workers N starts N engines at once on a fresh host: one measures, the others read its verdict."""
    import subprocess
    import sys

    log = tmp_path / "measured"
    code = f"""
import time, torch
from wde.components.models import cpu_kernels
def timer(fns):
    with open({str(log)!r}, "a") as f:
        f.write("x\\n")
    time.sleep(1.0)
    return {{"low": 2.0, "float32": 1.0}}
cands = lambda: {{"low": lambda: None, "float32": lambda: None}}
print(cpu_kernels.decide("linear layers", [(8, 8)], torch.bfloat16, cands, timer))
"""
    env = {**__import__("os").environ, "WDE_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == ["torch.float32"] * 3
    assert log.read_text().count("x") == 1
