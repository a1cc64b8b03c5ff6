"""bfloat16 on CPU: the detection of native bf16, the one-line hint, and MiniLM's bf16 vectors against fp32.

The precision test runs on every CPU: where it lacks native bf16 (avx512_bf16 / amx_bf16) torch emulates the bf16
matmuls, slowly but with the same numbers. The detection runs everywhere on fake cpuinfo.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_parity_minilm import parity_texts
from wde import Engine, device
from wde.components.models.cpu_linear import PackedLinear, cpu_capabilities, onednn_available, onednn_bf16_supported
from wde.engine_info import EngineInfo

ZEN2_AVX2 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext fxsr_opt lm pni ssse3"
             " fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 smep bmi2 sha_ni")
ZEN4 = ZEN2_AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 avx512_bitalg"
SAPPHIRE_RAPIDS = ZEN2_AVX2 + " avx512f avx512bw avx512vl avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
AMX_ONLY = ZEN2_AVX2 + " amx_bf16 amx_tile"
SKYLAKE_X = ZEN2_AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl"  # AVX-512 but no bf16 instructions
ARM = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"

# Measured on MiniLM and the parity texts: pure bf16 weights and activations give a min cosine of 0.99984 to fp32
# (sentence-transformers cast to bf16 gives the same 0.99984), a mean of 0.99994; short texts are the worst.
# Mixed precision (the CPU default: bf16 linear layers, float32 embeddings, norms and residuals) gives 0.999923 /
# 0.999975, which meets the bound.
MIN_COSINE, MEAN_COSINE = 0.9995, 0.9999
MIN_COSINE_MIXED, MEAN_COSINE_MIXED = 0.9999, 0.99995
MEAN = ["pooler.params.pooling=mean"]  # the tiny BERT has no sentence-transformers Pooling config


def fake_cpuinfo(tmp_path: Path, flags: str, cpus: int = 2) -> str:
    line = flags if flags.startswith("Features") else f"flags\t\t: {flags}"
    block = f"processor\t: {{i}}\nvendor_id\t: AuthenticAMD\nmodel name\t: Fake CPU\n{line}\nbogomips\t: 5000\n\n"
    path = tmp_path / "cpuinfo"
    path.write_text("".join(block.format(i=i) for i in range(cpus)))
    return str(path)


@pytest.mark.parametrize(("flags", "fast"), [
    (ZEN2_AVX2, False), (SKYLAKE_X, False), (ARM, False),
    (ZEN4, True), (SAPPHIRE_RAPIDS, True), (AMX_ONLY, True),
])
def test_cpu_has_fast_bf16_reads_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, fast: bool) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, flags))
    assert device.cpu_has_fast_bf16() is fast
    assert ("avx2" in device.cpu_flags()) is (not flags.startswith("Features"))


def test_no_cpuinfo_means_no_fast_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", str(tmp_path / "missing"))
    assert device.cpu_flags() == frozenset()
    assert device.cpu_has_fast_bf16() is False


def test_bf16_avx512_is_not_avx512_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag must match whole: `avx512bw`/`avx512_vnni` are not bf16, and a substring test would be wrong."""
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, ZEN2_AVX2 + " avx512_bf16x avx512bf16"))
    assert device.cpu_has_fast_bf16() is False


def test_the_hint_is_one_line_logged_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, ZEN4))
    monkeypatch.setattr(device, "_bf16_hint_logged", False)
    caplog.set_level(logging.INFO, logger="wde.device")
    cpu = torch.device("cpu")
    assert not device.suggest_cpu_bf16(cpu, torch.bfloat16)  # already bf16
    assert not device.suggest_cpu_bf16(torch.device("meta"), torch.float32)  # not a CPU
    assert device.suggest_cpu_bf16(cpu, torch.float32)
    assert not device.suggest_cpu_bf16(cpu, torch.float32)  # once per process
    hints = [r for r in caplog.records if r.name == "wde.device"]
    assert len(hints) == 1 and hints[0].levelno == logging.INFO
    message = hints[0].getMessage()
    assert "\n" not in message and "--set model.params.dtype=bfloat16" in message and "avx512_bf16" in message


def test_no_hint_without_native_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, SKYLAKE_X))
    monkeypatch.setattr(device, "_bf16_hint_logged", False)
    assert not device.suggest_cpu_bf16(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("flags", "dtype", "warned"), [
    (ZEN2_AVX2, torch.bfloat16, True), (SKYLAKE_X, torch.bfloat16, True),
    (ZEN4, torch.bfloat16, False), (SAPPHIRE_RAPIDS, torch.bfloat16, False), (ARM, torch.bfloat16, False),
    (ZEN2_AVX2, torch.float32, False), (ZEN2_AVX2, torch.float16, False),
])
def test_emulated_bf16_is_warned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture, flags: str, dtype: torch.dtype,
                                      warned: bool) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, flags))
    monkeypatch.setattr(device, "_emulated_bf16_warned", False)
    caplog.set_level(logging.WARNING, logger="wde.device")
    assert device.warn_emulated_cpu_bf16(torch.device("cpu"), dtype) is warned
    assert not device.warn_emulated_cpu_bf16(torch.device("cpu"), dtype)  # once per process
    assert not device.warn_emulated_cpu_bf16(torch.device("meta"), torch.bfloat16)
    messages = [r.getMessage() for r in caplog.records if r.name == "wde.device"]
    assert len(messages) == warned
    if warned:
        assert "no native bfloat16" in messages[0] and "drop model.params.dtype=bfloat16" in messages[0]


def test_building_a_bf16_engine_on_an_avx2_cpu_warns(tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, ZEN2_AVX2))
    monkeypatch.setattr(device, "_emulated_bf16_warned", False)
    caplog.set_level(logging.WARNING, logger="wde.device")
    with Engine.from_workflow("bert", tiny_bert, dtype="bfloat16", device="cpu", overrides=MEAN):
        pass
    assert any("emulates" in r.getMessage() for r in caplog.records if r.name == "wde.device")


def test_building_an_fp32_engine_logs_the_hint(tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, SAPPHIRE_RAPIDS))
    caplog.set_level(logging.INFO, logger="wde.device")
    for dtype, hinted in ((None, True), ("float32", False), ("bfloat16", False)):  # auto (fp32 on CPU) only
        monkeypatch.setattr(device, "_bf16_hint_logged", False)
        caplog.clear()
        with Engine.from_workflow("bert", tiny_bert, dtype=dtype, device="cpu", overrides=MEAN):
            pass
        assert any("model.params.dtype=bfloat16" in r.getMessage() for r in caplog.records) is hinted, dtype


def _weight_dtypes(model: torch.nn.Module) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """(dtypes of the linear layers' weights, dtypes of every other parameter), whichever path the linear layers
    took: `nn.Linear` (PyTorch) or `PackedLinear` (oneDNN, on hosts with native bf16), whose weight is no parameter."""
    linears, linear_params = set(), set()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            linears.add(module.dtype)
        elif isinstance(module, torch.nn.Linear):
            linears.add(module.weight.dtype)
            linear_params.update(id(p) for p in module.parameters())
    others = {p.dtype for p in model.parameters() if id(p) not in linear_params}
    return linears, others


def test_bf16_engine_holds_bf16_linear_weights_on_cpu(tiny_bert: Path) -> None:
    """Mixed precision by default on CPU: bf16 linear layers, float32 embeddings and norms; pure on request. The
    linear layers are prepacked for oneDNN exactly where PyTorch reports native bf16 for its kernels."""
    native = onednn_available() and onednn_bf16_supported() and bool(
        cpu_capabilities().get("avx512_bf16") or cpu_capabilities().get("amx_bf16"))
    for mixed, others in (("auto", {torch.float32}), ("false", {torch.bfloat16})):
        with Engine.from_workflow("bert", tiny_bert, dtype="bfloat16", device="cpu",
                                  overrides=[*MEAN, f"model.params.mixed_precision={mixed}",
                                                 "model.params.mixed_precision_kernels=low"]) as engine:
            model = engine.components["model"]
            assert model.params.dtype == "bfloat16" and model.dtype == torch.bfloat16
            assert model.linear_backend == ("onednn" if native else "torch")
            assert _weight_dtypes(model) == ({torch.bfloat16}, others)
            assert model.embeddings.word_embeddings.weight.dtype == (torch.float32 if mixed == "auto" else torch.bfloat16)
            assert isinstance(model.encoder.layer[0].attention.qkv, PackedLinear if native else torch.nn.Linear)
            assert EngineInfo.of(engine).dtype == "bfloat16"
            out = engine.embed(["bf16 on the CPU"])
        assert out.dtype == np.float32 and np.isfinite(out).all()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize(("mixed", "min_cosine", "mean_cosine"), [
    ("auto", MIN_COSINE_MIXED, MEAN_COSINE_MIXED), ("false", MIN_COSINE, MEAN_COSINE)])
def test_minilm_bf16_matches_fp32(minilm_path: Path, minilm_engine: Engine, mixed: str, min_cosine: float,
                                  mean_cosine: float) -> None:
    """Runs on every CPU: without native bf16 torch emulates the bf16 matmuls (slower, the same numbers: pure bf16
    gave 0.99984 here and on a Zen 5 with avx512_bf16)."""
    texts = parity_texts()
    fp32 = minilm_engine.embed(texts, truncate=True)
    with Engine.from_workflow("bert", minilm_path, dtype="bfloat16", device="cpu",
                              overrides=[f"model.params.mixed_precision={mixed}"]) as engine:
        assert engine.components["model"].dtype == torch.bfloat16
        bf16 = engine.embed(texts, truncate=True)
    cos = cosines(fp32, bf16)
    worst = int(cos.argmin())
    assert cos.min() >= min_cosine, f"min cosine {cos.min():.6f} on {texts[worst][:60]!r}"
    assert cos.mean() >= mean_cosine, f"mean cosine {cos.mean():.6f}"
