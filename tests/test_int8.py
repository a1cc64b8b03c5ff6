"""quantization: int8 on CPU (wde/components/models/int8_linear.py, int8_gate.py): fidelity against float32 on
varied texts (MiniLM's real weights, tiny random XLM-R and ModernBERT, a cross-encoder), the fidelity gate's refusal
of a model with corrupted scales, its cache, the refusals (LoRA, non-float32, oneDNN capped below AVX2), the CLI flags,
CPU streams, and CPUs without VNNI (AVX2: weights bounded per adjacent pair). The tests marked `needs_int8` need a
CPU whose int8 kernels PyTorch/oneDNN report (VNNI or AVX2); the capped ones run in subprocesses on any."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.tiny_heads import build_minilm_classifier
from tests.tiny_models import build_xlmr, varied_texts
from wde import Engine
from wde.components.attention.base import AttentionMetadata
from wde.components.attention.cpu_flash import load_kernel
from wde.components.models import int8_linear
from wde.components.models.cpu_linear import padded_rows
from wde.components.models.int8_gate import choose_float_layers, named_layers
from wde.components.models.int8_linear import Int8Linear, int8_unsupported
from wde.errors import ModelLoadError

needs_int8 = pytest.mark.skipif(int8_unsupported() is not None, reason=f"no int8 kernels: {int8_unsupported()}")
TEXTS = varied_texts(200)
INIT_RANGE = 0.1
"""Random weights 5x the default scale, so the tiny models' blocks move the residual stream (at 0.02 they barely do,
and any int8 error hides)."""


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDE_CACHE_DIR", str(tmp_path / "cache"))


def int8_layers(engine: Engine) -> int:
    return sum(isinstance(m, Int8Linear) for m in engine.components["model"].modules())


def fidelity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    a, b = a / np.linalg.norm(a, axis=1, keepdims=True), b / np.linalg.norm(b, axis=1, keepdims=True)
    cos = (a * b).sum(1)
    return float(cos.min()), float(cos.mean())


def top10_overlap(a: np.ndarray, b: np.ndarray, queries: int = 40) -> float:
    """Mean overlap of the top-10 neighbours (cosine) of the first `queries` rows among the rest, a vs b."""
    def top(x: np.ndarray) -> np.ndarray:
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        return np.argsort(-(x[:queries] @ x[queries:].T), axis=1)[:, :10]
    ta, tb = top(a), top(b)
    return float(np.mean([len(set(ra) & set(rb)) / 10 for ra, rb in zip(ta, tb)]))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


@needs_int8
def test_minilm_int8_against_float32(minilm_path: Path) -> None:
    with Engine.from_workflow("bert", minilm_path) as e32:
        ref = np.asarray(e32.embed(TEXTS))
    with Engine.from_workflow("bert", minilm_path, quantization="int8") as e8:
        assert int8_layers(e8) >= 12  # qkv, attention out and MLP up of 6 layers at least
        # attention takes bf16 products where bf16 is native and the kernel has them (the gate measured them)
        kernel = load_kernel()
        native = int8_linear.bf16_pays() and kernel is not None and kernel.bf16_dot_products()
        assert e8.components["attention"].bf16_products == native
        got = np.asarray(e8.embed(TEXTS))
    low, mean = fidelity(ref, got)
    overlap = top10_overlap(ref, got)
    print(f"MiniLM int8 vs fp32 on {len(TEXTS)} texts: min cosine {low:.5f}, mean {mean:.5f}, top-10 overlap"
          f" {overlap:.3f}")
    assert low >= 0.99 and mean >= 0.998
    assert overlap >= 0.9


@needs_int8
@pytest.mark.parametrize("family", ["xlmr", "modernbert"])
def test_tiny_random_families(family: str, tmp_path: Path) -> None:
    if family == "xlmr":
        folder = build_xlmr(tmp_path / "xlmr", hidden_size=128, num_hidden_layers=3, intermediate_size=256,
                            initializer_range=INIT_RANGE)
    else:
        from tests.test_modernbert import build as build_modernbert

        folder = build_modernbert(tmp_path / "modernbert", initializer_range=INIT_RANGE)
    mean_pool = ["pooler.params.pooling=mean"]
    with Engine.from_workflow(model=folder, overrides=mean_pool) as e32:
        ref = np.asarray(e32.embed(TEXTS, truncate=True))
    with Engine.from_workflow(model=folder, quantization="int8", overrides=mean_pool) as e8:
        assert int8_layers(e8) > 0
        got = np.asarray(e8.embed(TEXTS, truncate=True))
    low, mean = fidelity(ref, got)
    print(f"{family} (tiny random) int8 vs fp32: min cosine {low:.5f}, mean {mean:.5f}, top-10 overlap"
          f" {top10_overlap(ref, got):.3f}")
    assert low >= 0.99 and mean >= 0.998


@needs_int8
def test_decoder_embedder(tmp_path: Path) -> None:
    """A tiny random Qwen2 embedder (gte_qwen2: causal, last-token pooling) at 5x the default init scale."""
    from tests.tiny_decoders import build_qwen2, qwen2_tokenizer

    folder = build_qwen2(tmp_path / "qwen2", qwen2_tokenizer(real=False), initializer_range=INIT_RANGE)
    with Engine.from_workflow("gte_qwen2", folder) as e32:
        ref = np.asarray(e32.embed(TEXTS, truncate=True))
    with Engine.from_workflow("gte_qwen2", folder, quantization="int8") as e8:
        assert int8_layers(e8) > 0
        got = np.asarray(e8.embed(TEXTS, truncate=True))
    low, mean = fidelity(ref, got)
    print(f"qwen2 (tiny random) int8 vs fp32: min cosine {low:.5f}, mean {mean:.5f}, top-10 overlap"
          f" {top10_overlap(ref, got):.3f}")
    assert low >= 0.99 and mean >= 0.998


@needs_int8
def test_cross_encoder_ranking(minilm_path: Path, tmp_path: Path) -> None:
    """MiniLM's real encoder under a random single-logit head: the head is not trained, so this shows that int8
    keeps the order of what the encoder feeds a head, not that a trained reranker keeps its quality."""
    folder = build_minilm_classifier(minilm_path, tmp_path / "ce", num_labels=1)
    queries = varied_texts(8, seed=7)
    pairs = [(q, d) for q in queries for d in TEXTS[:25]]
    with Engine.from_workflow(model=folder) as e32:
        ref = np.asarray(e32.score(pairs, activation=False))
    with Engine.from_workflow(model=folder, quantization="int8") as e8:
        assert int8_layers(e8) > 0
        got = np.asarray(e8.score(pairs, activation=False))
    rho = spearman(ref, got)
    print(f"cross-encoder (MiniLM, random head) int8 vs fp32 Spearman over {len(pairs)} pairs: {rho:.5f}")
    assert rho >= 0.99


@needs_int8
def test_gate_refuses_corrupted_scales(minilm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_linear, "SCALE_CORRUPTION", 1.5)
    with pytest.raises(ModelLoadError, match=r"fall short of float32.s: min cosine 0\.\d+ < min_cosine 0.99"):
        Engine.from_workflow("bert", minilm_path, quantization="int8")


@needs_int8
def test_gate_keeps_the_layer_kind_that_lifts_fidelity_most_in_float(minilm_path: Path,
                                                                       caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Above what all-int8 reaches (MiniLM on the probes with VNNI: min 0.997, mean 0.9993), the gate keeps the MLP's
    down projection (GELU's outputs quantize worst) in float and passes (min 0.9989, mean 0.99965); over its trials
    each layer is quantized once. Without VNNI (weights bounded per adjacent pair) the same kind, at the mean it
    reaches there (0.99950 on an AVX2 Zen 3)."""
    caplog.set_level("INFO", logger="wde.models")
    made: list[int] = []
    init = Int8Linear.__init__
    monkeypatch.setattr(Int8Linear, "__init__", lambda self, *a, **k: (made.append(1), init(self, *a, **k))[1])
    mean = "0.9996" if int8_linear.int8_dot_products() == "vnni" else "0.9994"
    with Engine.from_workflow("bert", minilm_path, quantization="int8", overrides=[
            "model.params.min_cosine=0.998", f"model.params.min_mean_cosine={mean}"]) as engine:
        assert len(made) == 6 * 4  # qkv, attention out, MLP up and down of six blocks, once each
        assert int8_layers(engine) == 6 * 3  # six blocks, their down projections float
        model = engine.components["model"]
        assert not any(isinstance(m, Int8Linear) for n, m in model.named_modules()
                       if n.endswith(".output.dense") and ".attention." not in n)
    assert "kept in" in caplog.text and "encoder.layer.*.output.dense" in caplog.text


LAYERS = [f"blocks.{i}.{k}" for i in range(4) for k in ("qkv", "up", "down")]
"""Twelve linear layers of four blocks, three kinds, in block order, for the search rule's tests."""


def synthetic_measure(lifts: dict[str, float], base: float = 0.9990
                      ) -> tuple[list[frozenset[str]], Callable[[frozenset[str]], tuple[float, float]]]:
    """A measure that lifts min and mean cosine by each kept layer's `lifts` entry (0 when absent), and records
    what it was asked."""
    asked: list[frozenset[str]] = []

    def measure(keep: frozenset[str]) -> tuple[float, float]:
        asked.append(keep)
        gain = sum(lifts.get(n, 0.0) for n in keep)
        return base - 0.005 + gain, base + gain
    return asked, measure


def test_float_layers_all_int8_when_it_passes() -> None:
    asked, measure = synthetic_measure({})
    assert choose_float_layers(LAYERS, measure, 0.99, 0.999) == (frozenset(), 0.9940, 0.9990)
    assert asked == [frozenset()]  # measured once


def test_float_layers_one_block_layer_when_it_is_enough() -> None:
    """A single layer that brings both figures up is kept alone, the best measuring of those that do, although
    keeping its whole kind would measure higher; candidates are a kind's first and last block's layer."""
    lifts = {"blocks.0.down": 0.0004, "blocks.3.qkv": 0.0003, "blocks.1.down": 0.0009, "blocks.2.down": 0.0002}
    asked, measure = synthetic_measure(lifts)
    keep, low, mean = choose_float_layers(LAYERS, measure, 0.99, 0.9993)
    assert keep == {"blocks.0.down"} and mean == pytest.approx(0.9994)
    assert frozenset({"blocks.1.down"}) not in asked  # a middle block's layer alone is not a candidate
    assert frozenset(f"blocks.{i}.down" for i in range(4)) in asked  # its kind was tried, measured higher, not kept
    assert named_layers(LAYERS, keep) == ["blocks.0.down"]


def test_float_layers_a_whole_kind_when_no_layer_is_enough() -> None:
    """No single layer passes: the step that lifts most (here all the down projections) is kept, then, still
    short, the next step; at most half of the layers; short of the thresholds when nothing lifts further."""
    lifts = {f"blocks.{i}.down": 0.0002 for i in range(4)} | {f"blocks.{i}.up": 0.0001 for i in range(4)}
    _, measure = synthetic_measure(lifts)
    keep, _, mean = choose_float_layers(LAYERS, measure, 0.99, 0.99985)
    assert keep == {f"blocks.{i}.down" for i in range(4)} | {"blocks.0.up"} and mean == pytest.approx(0.9999)
    assert named_layers(LAYERS, keep) == ["blocks.*.down", "blocks.0.up"]
    _, measure = synthetic_measure({n: v / 2 for n, v in lifts.items()})
    keep, _, mean = choose_float_layers(LAYERS, measure, 0.99, 0.9999)  # out of reach: half the layers at most
    assert len(keep) == len(LAYERS) // 2 and mean == pytest.approx(0.9995)
    _, measure = synthetic_measure({})
    assert choose_float_layers(LAYERS, measure, 0.99, 0.9999)[0] == frozenset()  # nothing lifts: nothing kept


@needs_int8
def test_gate_keeps_one_block_layer_when_that_is_enough(minilm_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Just above what all-int8 MiniLM measures on this host, one block's layer kept float is enough: the gate
    keeps that one (on an AMX Xeon the first block's down projection: mean 0.99927 -> 0.99933) and no more."""
    caplog.set_level("INFO", logger="wde.models")
    with Engine.from_workflow("bert", minilm_path, quantization="int8", overrides=["model.params.min_mean_cosine=0.99"]):
        pass
    all_int8 = float(re.search(r"gate passed: min cosine [\d.]+, mean ([\d.]+)", caplog.text).group(1))
    caplog.clear()
    threshold = round(all_int8 + 0.00002, 6)
    with Engine.from_workflow("bert", minilm_path, quantization="int8",
                              overrides=[f"model.params.min_mean_cosine={threshold}"]) as engine:
        assert int8_layers(engine) == 6 * 4 - 1
    kept = re.search(r"gate passed: min cosine [\d.]+, mean ([\d.]+) .*kept in \w+: ([^)]*)\)", caplog.text)
    assert kept and float(kept.group(1)) >= threshold and re.fullmatch(r"encoder\.layer\.\d\.[\w.]+", kept.group(2))


@needs_int8
def test_gate_result_is_cached(minilm_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="wde.models")
    texts = varied_texts(30, seed=3)
    with Engine.from_workflow("bert", minilm_path, quantization="int8") as first:
        a = np.asarray(first.embed(texts))
    assert "measured on 34 texts" in caplog.text
    cache = json.loads((tmp_path / "cache" / "cpu_kernels.json").read_text())
    (entry,) = [v for k, v in cache.items() if "int8-gate" in k]
    assert entry["min_cosine"] >= 0.99 and entry["mean_cosine"] >= 0.9993  # the default thresholds
    # one block's layer at most with VNNI (MiniLM on the hosts measured); without, the six down projections
    assert len(entry["float_layers"]) <= (1 if int8_linear.int8_dot_products() == "vnni" else 6)
    caplog.clear()
    with Engine.from_workflow("bert", minilm_path, quantization="int8") as second:
        b = np.asarray(second.embed(texts))
    assert "(cached," in caplog.text and "measured" not in caplog.text
    np.testing.assert_array_equal(a, b)  # the same layers in int8 from the same scales


@needs_int8
def test_gate_names_the_threshold_missed(minilm_path: Path) -> None:
    """A mean below min_mean_cosine with the minimum above min_cosine names the mean alone."""
    with pytest.raises(ModelLoadError) as err:
        Engine.from_workflow("bert", minilm_path, quantization="int8",
                             overrides=["model.params.min_cosine=0.5", "model.params.min_mean_cosine=1.0"])
    assert re.search(r"short of float32's: mean cosine 0\.\d+ < min_mean_cosine 1.0 \(min 0\.\d+", str(err.value))
    assert "< min_cosine" not in str(err.value)


@needs_int8
def test_calibration_file_and_min_cosine(minilm_path: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(varied_texts(20, seed=9)) + "\n\n")
    with pytest.raises(ModelLoadError, match=r"min cosine 0\.\d+ < min_cosine 1.0.*measured on 20 texts"):
        Engine.from_workflow("bert", minilm_path, quantization="int8",
                             overrides=[f"model.params.calibration={calib}", "model.params.min_cosine=1.0"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ModelLoadError, match="holds no text"):
        Engine.from_workflow("bert", minilm_path, quantization="int8",
                             overrides=[f"model.params.calibration={empty}"])


@pytest.mark.parametrize("override, message", [
    ("model.params.dtype=bfloat16", "runs on CPU from a float32 model"),
    ("model.params.lora.enable=true", "does not combine with LoRA"),
])
@needs_int8
def test_refusals(minilm_path: Path, override: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Engine.from_workflow("bert", minilm_path, quantization="int8", overrides=[override])


def test_unknown_quantization_is_refused(minilm_path: Path) -> None:
    with pytest.raises(Exception, match="quantization"):
        Engine.from_workflow("bert", minilm_path, quantization="int4")


def test_below_avx2_refuses_in_one_line(minilm_path: Path, tmp_path: Path) -> None:
    """With oneDNN capped below AVX2 there is neither VNNI nor AVX2's pair sums: `wde embed --quantization int8`
    exits 1 with one line saying so, and the float32 path still runs."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX", "WDE_CACHE_DIR": str(tmp_path)}
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\n")
    cmd = [sys.executable, "-c", "from wde.cli import main; main()", "embed", "--input", str(src),
           "--output", str(tmp_path / "out.npy"), "-m", str(minilm_path)]
    run = subprocess.run(cmd + ["--quantization", "int8"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1 and "neither int8 dot-product instructions" in lines[0], run.stderr
    assert "ONEDNN_MAX_CPU_ISA=AVX" in lines[0], run.stderr
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr


def test_avx2_cap_runs_int8_on_pair_bounded_weights(minilm_path: Path, tmp_path: Path) -> None:
    """Under the AVX2 cap (as on an AVX2-only CPU) int8 runs on oneDNN's AVX2 kernel, weights bounded per adjacent
    pair: `wde embed --quantization int8` says so in one line, the fidelity gate passes, and the vectors are within
    the gate's thresholds of float32's."""
    if int8_linear.int8_dot_products() == "pairs" and not os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("this host's own int8 path is the pair-bounded one: test_cli_embed_flags runs it, note included")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "WDE_CACHE_DIR": str(tmp_path)}
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS[:60]) + "\n")
    cmd = [sys.executable, "-c", "from wde.cli import main; main()", "embed", "--input", str(src), "-m",
           str(minilm_path)]
    run = subprocess.run(cmd + ["--output", str(tmp_path / "q.npy"), "--quantization", "int8"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    notes = [ln for ln in run.stderr.splitlines() if "without int8 dot-product instructions" in ln]
    assert len(notes) == 1 and "AVX2" in notes[0] and f"{int8_linear.PAIR_LEVELS} levels" in notes[0], run.stderr
    ok = subprocess.run(cmd + ["--output", str(tmp_path / "f.npy")], env=env, capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    low, mean = fidelity(np.load(tmp_path / "f.npy"), np.load(tmp_path / "q.npy"))
    assert low >= 0.99 and mean >= 0.998
    assert low < 1.0  # int8 did run


def test_pair_bounded_weights() -> None:
    """`quantize_weight(pairs=True)`: every adjacent pair of a row holds at most PAIR_LEVELS levels (odd widths
    too, outliers included), the largest pair of each row 127-128, and each weight within half a level of its
    value; without `pairs` a row's largest weight takes 127 levels."""
    g = torch.Generator().manual_seed(0)
    for k in (64, 385):
        w = torch.randn(96, k, generator=g)
        w[::7, 3] *= 20  # an outlier channel
        w[1::5, 10:12] *= 8  # a pair of large neighbours
        q, scale = int8_linear.quantize_weight(w, pairs=True)
        a = torch.nn.functional.pad(q.int().abs(), (0, k % 2))
        pairs = a[:, 0::2] + a[:, 1::2]
        assert int(pairs.max()) <= int8_linear.PAIR_LEVELS
        assert int(pairs.amax(1).min()) >= 127
        assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all())
        q8, _ = int8_linear.quantize_weight(w)
        assert bool((q8.int().abs().amax(1) == 127).all())


ONEDNN_AVX2_PROBE = """
import json, torch
from wde.components.models import int8_linear as il
k, n = 64, 8
x = torch.full((4, k), 255, dtype=torch.uint8)
w = torch.full((n, k), 127, dtype=torch.int8)  # full-range pairs: 255 x 254 overflows 16 bits
print(json.dumps({"dots": il.int8_dot_products(), "bounded": il.pair_saturation(), "unsupported": il.int8_unsupported(),
                  "unbounded": il.gemm_error(x, w)}))
"""


def test_onednn_avx2_kernel_saturates_full_range_pairs_but_not_bounded_ones(tmp_path: Path) -> None:
    """oneDNN capped to AVX2 (what an AVX2-only CPU runs): u8 x s8 products summed in adjacent pairs saturate at
    16 bits with full-range weights, which is why the bound exists, and never within it (`pair_saturation`, the
    probe `int8_unsupported` runs)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "WDE_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", ONEDNN_AVX2_PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["dots"] == "pairs" and got["unsupported"] is None, got
    assert got["bounded"] == 0.0, got
    assert got["unbounded"] > 1000, got


@pytest.mark.parametrize("cap, want", [("AVX", None), ("SSE41", None), ("AVX2", "pairs"), ("AVX512_CORE", "pairs")])
def test_int8_dot_products_follow_onednn_cap(cap: str, want: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cpu.get_capabilities().get("avx2"):
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    int8_linear.int8_dot_products.cache_clear()
    try:
        assert int8_linear.int8_dot_products() == want
    finally:
        monkeypatch.undo()
        int8_linear.int8_dot_products.cache_clear()


@needs_int8
def test_cli_embed_flags(minilm_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`wde embed --quantization int8` within the gate's thresholds of float32 (where int8 runs on pair-bounded
    weights, saying so in one line), and `--min-cosine` / `--calibration` refusing in one line."""
    from click.testing import CliRunner

    from wde.cli import main

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS[:40]) + "\n")
    runner = CliRunner()
    base = ["embed", "--input", str(src), "-m", str(minilm_path)]
    res = runner.invoke(main, base + ["--output", str(tmp_path / "f.npy")])
    assert res.exit_code == 0, res.output
    caplog.clear()
    res = runner.invoke(main, base + ["--output", str(tmp_path / "q.npy"), "--quantization", "int8"])
    assert res.exit_code == 0, res.output
    low, mean = fidelity(np.load(tmp_path / "f.npy"), np.load(tmp_path / "q.npy"))
    assert low >= 0.99 and mean >= 0.998
    assert low < 1.0  # int8 did run
    notes = [r.getMessage() for r in caplog.records if "without int8 dot-product instructions" in r.getMessage()]
    if int8_linear.int8_dot_products() == "pairs":  # an AVX2-only CPU, or the AVX2 cap
        assert len(notes) == 1 and f"{int8_linear.PAIR_LEVELS} levels" in notes[0], notes
        assert notes[0] == int8_linear.fallback_note()
    else:
        assert notes == []
    res = runner.invoke(main, base + ["--output", str(tmp_path / "r.npy"), "--quantization", "int8",
                                      "--min-cosine", "1",
                                      "--calibration", str(src)])
    assert res.exit_code == 1
    assert "< min_cosine 1.0" in res.output and "measured on 40 texts" in res.output


@needs_int8
def test_cpu_streams_and_packed_batches(minilm_path: Path) -> None:
    """The same int8 vectors whether a batch runs whole or split into CPU streams."""
    with Engine.from_workflow("bert", minilm_path, quantization="int8",
                              overrides=["runner.params.cpu_streams=1"]) as one:
        a = np.asarray(one.embed(TEXTS))
    with Engine.from_workflow("bert", minilm_path, quantization="int8",
                              overrides=["runner.params.cpu_streams=2",
                                         "runner.params.cpu_stream_min_tokens=16",
                                         "runner.params.cpu_stream_max_mean_tokens=100000"]) as two:
        b = np.asarray(two.embed(TEXTS))
    np.testing.assert_allclose(a, b, atol=1e-5)


@needs_int8
def test_split_server_serves_int8(minilm_path: Path, tmp_path: Path) -> None:
    """`wde serve --api-servers 1 --quantization int8`: the engine core quantizes behind its gate, and the vectors it
    serves are the in-process int8 engine's."""
    import httpx

    from tests.test_server import serve_split

    texts = TEXTS[:16]
    log = tmp_path / "serve.log"
    with serve_split(minilm_path, 1, "--quantization", "int8", "--log-level", "info", log=log) as (url, _):
        answer = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=120)
        assert answer.status_code == 200, answer.text
        served = np.asarray([d["embedding"] for d in answer.json()["data"]])
    assert "int8 fidelity gate passed" in log.read_text()
    with Engine.from_workflow("bert", minilm_path, quantization="int8") as e8:
        np.testing.assert_allclose(served, np.asarray(e8.embed(texts)), atol=1e-5)


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_linear, "int8_kernel", lambda: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [384, 100])  # a multiple of the kernel's 16 lanes, and one with a tail
def test_quantize_rows_kernel_equals_the_torch_path(dtype: torch.dtype, width: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if int8_linear.int8_kernel() is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(257, width, generator=g) * torch.linspace(0.1, 8, width)).to(dtype)
    x[3] = 0  # a row of zeros: scale 1, zero point 0
    x[4] = x[4].abs()  # one-sided rows use every level
    x[5] = -x[5].abs()
    factor = torch.rand(width, generator=g) + 0.5
    q, scale, zero = int8_linear.quantize_rows(x, factor)
    _torch_path(monkeypatch)
    q2, scale2, zero2 = int8_linear.quantize_rows(x, factor)
    assert torch.equal(zero, zero2) and torch.allclose(scale, scale2, rtol=1e-6, atol=0)
    assert (q.int() - q2.int()).abs().max() <= 1  # a value exactly between two levels may round either way
    want = x.float() * factor
    got = scale[:, None] * (q.float() - zero[:, None])
    assert ((got - want).abs() <= scale[:, None] * 0.5 + 1e-6).all()  # within half a level
    assert scale[3] == 1 and zero[3] == 0 and (q[3] == 0).all()
    assert zero[4] == 0 and q[4].max() == 255 and zero[5] == 255 and q[5].min() == 0


@pytest.mark.parametrize("act", [0, 1, 2, 3])
def test_dequantize_rows_kernel_equals_the_torch_path(act: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if int8_linear.int8_kernel() is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(1)
    y, scale, zero = torch.randn(130, 200, generator=g) * 40, torch.rand(130, generator=g), torch.rand(130) * 255
    colsum, bias = torch.randn(200, generator=g), torch.randn(200, generator=g)
    got = int8_linear.dequantize_rows_(y.clone(), scale, zero, colsum, bias, act)
    _torch_path(monkeypatch)
    want = int8_linear.dequantize_rows_(y.clone(), scale, zero, colsum, bias, act)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_holding_a_nan_or_an_infinity_gets_a_nan_scale(kernel: bool, bad: float,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Min and max drop a NaN: without its own check a NaN in an int8 layer's input would come out as finite values
    that the engine's non-finite check cannot see. The row's scale is NaN instead, in the vectors and the tail."""
    if not kernel:
        _torch_path(monkeypatch)
    elif int8_linear.int8_kernel() is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(5))
    x[1, 3] = bad  # in the first vector
    x[2, 98] = bad  # in the scalar tail (100 = 6 x 16 + 4)
    x[3, 40] = bad  # the middle of a row
    q, scale, zero = int8_linear.quantize_rows(x, torch.rand(100) + 0.5)
    assert scale[1:4].isnan().all() and (zero[1:4] == 0).all() and (q[1:4] == 0).all()
    assert scale[[0, 4, 5]].isfinite().all()


@needs_int8
@pytest.mark.parametrize("kernel", [True, False])
def test_an_int8_layer_passes_a_nan_on(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel:
        _torch_path(monkeypatch)
    layer = Int8Linear(nn.Linear(96, 64), rows=8)
    layer.post_op = ("gelu", "none")
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(6))
    x[2, 50] = float("nan")
    out = layer(x)
    assert out[2].isnan().all() and out[[0, 1, 3]].isfinite().all()


@needs_int8
def test_int8_linear_without_the_kernel_gives_the_same_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C++ kernel cannot be built, `Int8Linear` computes the same in PyTorch ops (and GELU after it)."""
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(96, 64)
    layer = Int8Linear(linear, rows=32, smooth=torch.rand(96, generator=g) + 0.5)
    layer.post_op = ("gelu", "none")
    x = torch.randn(32, 96, generator=g)
    fast = layer(x)
    _torch_path(monkeypatch)
    slow = layer(x)
    want = torch.nn.functional.gelu(linear(x)).detach()
    assert (fast - slow).abs().max() <= 1e-4
    assert (slow - want).abs().max() <= 0.03 * float(want.abs().max())


@pytest.mark.parametrize("act", [0, 1, 3])
def test_dequantize_quantize_rows_is_the_two_passes_in_one(act: int) -> None:
    """The fused pass leaves y as `dequantize_rows_` does and quantizes it as `quantize_rows` would, bit for bit."""
    kernel = int8_linear.int8_kernel()
    if kernel is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(3)
    y, scale, zero = torch.randn(70, 200, generator=g) * 40, torch.rand(70, generator=g), torch.rand(70) * 255
    colsum, bias, factor = torch.randn(200, generator=g), torch.randn(200, generator=g), torch.rand(200) + 0.5
    for f, padded in ((factor, 70), (None, 70), (factor, 96)):
        fused = y.clone()
        q, s, z = kernel.dequantize_quantize_rows_(fused, scale, zero, colsum, bias, act, f, padded)
        apart = kernel.dequantize_rows_(y.clone(), scale, zero, colsum, bias, act)
        assert torch.equal(fused, apart)
        for got, want in zip((q, s, z), kernel.quantize_rows(apart, f, padded)):
            assert torch.equal(got, want)
        assert q.shape == (padded, 200) and (q[70:] == 0).all()


@pytest.mark.parametrize("width", [384, 100])
@pytest.mark.parametrize("affine", [True, False], ids=["bias-affine", "bare"])
def test_dequantize_add_layer_norm_is_the_two_passes_in_one(width: int, affine: bool) -> None:
    """The fused pass gives what `dequantize_rows_` then `add_layer_norm` give, to float32 rounding."""
    kernel = int8_linear.int8_kernel()
    if kernel is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(7)
    y, scale, zero = torch.randn(70, width, generator=g) * 40, torch.rand(70, generator=g), torch.rand(70) * 255
    colsum, residual = torch.randn(width, generator=g), torch.randn(70, width, generator=g)
    bias, w, b = (torch.randn(width, generator=g) if affine else None for _ in range(3))
    apart = kernel.add_layer_norm(kernel.dequantize_rows_(y.clone(), scale, zero, colsum, bias, 0), residual, w, b,
                                  1e-12)
    fused = y.clone()
    got = kernel.dequantize_add_layer_norm_(fused, scale, zero, colsum, bias, residual, w, b, 1e-12)
    assert got.data_ptr() == fused.data_ptr()  # in place
    assert (got - apart).abs().max() <= 1e-5 * max(1.0, float(apart.abs().max()))
    with pytest.raises(RuntimeError, match="residual"):
        kernel.dequantize_add_layer_norm_(y.clone(), scale, zero, colsum, bias, residual[:, :-1].contiguous(), w, b,
                                          1e-12)


@pytest.mark.parametrize("padded", [70, 96])
def test_dequantize_add_layer_norm_quantize_is_the_norm_then_quantize_rows(padded: int) -> None:
    """The norm's pass that also quantizes its rows for the next int8 layer leaves y as `dequantize_add_layer_norm_`
    does and gives what `quantize_rows` gives on it, bit for bit."""
    kernel = int8_linear.int8_kernel()
    if kernel is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(8)
    y, scale, zero = torch.randn(70, 100, generator=g) * 40, torch.rand(70, generator=g), torch.rand(70) * 255
    colsum, residual, bias = torch.randn(100, generator=g), torch.randn(70, 100, generator=g), torch.randn(100)
    w, b, factor = torch.randn(100, generator=g), torch.randn(100, generator=g), torch.rand(100, generator=g) + 0.5
    normed = kernel.dequantize_add_layer_norm_(y.clone(), scale, zero, colsum, bias, residual, w, b, 1e-12)
    for f in (factor, None):
        fused = y.clone()
        q, s, z = kernel.dequantize_add_layer_norm_quantize_(fused, scale, zero, colsum, bias, residual, w, b, 1e-12,
                                                             f, padded)
        assert torch.equal(fused, normed)
        for got, want in zip((q, s, z), kernel.quantize_rows(normed, f, padded)):
            assert torch.equal(got, want)
        assert q.shape == (padded, 100) and (q[70:] == 0).all()


@needs_int8
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_an_int8_layer_before_a_post_norm_gives_the_norm_of_its_output(kernel: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear_add_layer_norm` on an `Int8Linear` (BERT's attention output and MLP down projections): the same as
    the layer's output added to the residual and normed, with the kernel's one pass or without the kernel."""
    from wde.components.models.fused import add_layer_norm, linear_add_layer_norm

    if kernel and int8_linear.int8_kernel() is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    if not kernel:
        _torch_path(monkeypatch)
    g = torch.Generator().manual_seed(8)
    layer = Int8Linear(nn.Linear(96, 64), rows=40, smooth=torch.rand(96, generator=g) + 0.5)
    norm = nn.LayerNorm(64)
    nn.init.normal_(norm.weight, generator=g)
    nn.init.normal_(norm.bias, generator=g)
    x, residual = torch.randn(37, 96, generator=g), torch.randn(37, 64, generator=g)
    with torch.inference_mode():
        want = add_layer_norm(layer(x), residual, norm)
        got = linear_add_layer_norm(layer, x, residual, norm)
        assert got.shape == (37, 64)
        assert (got - want).abs().max() <= 1e-4
        plain = nn.Linear(96, 64)
        assert torch.equal(linear_add_layer_norm(plain, x, residual, norm), add_layer_norm(plain(x), residual, norm))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_quantized_rows_are_padded_to_the_multiple_with_zeros(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The u8 rows come rounded up to `multiple` (oneDNN then sees few distinct row counts), zero past the last;
    the scales and zero points stay one per real row."""
    if kernel and int8_linear.int8_kernel() is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    if not kernel:
        _torch_path(monkeypatch)
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(5))
    exact = int8_linear.quantize_rows(x, None)
    q, scale, zero = int8_linear.quantize_rows(x, None, 32)
    assert q.shape == (64, 64) and scale.shape == zero.shape == (45,)
    assert torch.equal(q[:45], exact[0]) and (q[45:] == 0).all()
    assert int8_linear.quantize_rows(x[:32], None, 32)[0].shape == (32, 64)  # a multiple already: no padding
    big = torch.randn(1900, 8, generator=torch.Generator().manual_seed(6))
    assert int8_linear.quantize_rows(big, None, 32)[0].shape == (1920, 8)  # 1/16-1/8 of the rows: 128 here
    assert [padded_rows(n) for n in (1, 8, 9, 16, 17, 32, 33, 511, 512, 513, 1900, 2048, 2049)] == [
        8, 8, 16, 16, 32, 32, 64, 512, 512, 576, 1920, 2048, 2304]  # under 32: 8, 16 or 32 (a short query's GEMMs)
    assert int8_linear.quantize_rows(x[:5], None, 32)[0].shape == (8, 64)
    if kernel:  # the kernel takes the count `padded_rows` gives (the rule's one home) and refuses one below the rows
        with pytest.raises(RuntimeError, match="padded"):
            int8_linear.int8_kernel().quantize_rows(x, None, 44)


@needs_int8
def test_an_int8_layer_gives_each_row_the_same_result_whatever_the_row_count() -> None:
    """Padding rows are computed and dropped: a row's output does not depend on how many rows came with it."""
    g = torch.Generator().manual_seed(6)
    layer = Int8Linear(nn.Linear(64, 48), rows=64, smooth=torch.rand(64, generator=g) + 0.5)
    x = torch.randn(70, 64, generator=g)
    with torch.inference_mode():
        full = layer(x)
        assert full.shape == (70, 48)
        for n in (1, 31, 32, 33, 64):
            part = layer(x[:n])
            assert part.shape == (n, 48) and torch.allclose(part, full[:n], atol=1e-5, rtol=0)


class _Mlp(nn.Module):
    def __init__(self, up: nn.Module, down: nn.Module, touch: bool) -> None:
        super().__init__()
        self.up, self.down, self.touch = up, down, touch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.touch:
            h.mul_(0.5)  # changed in place between the two layers: the handed rows no longer describe it
        return self.down(h)


@needs_int8
@pytest.mark.parametrize("touch", [False, True], ids=["unchanged", "changed-in-place"])
def test_a_layer_quantizes_its_output_for_the_layer_it_feeds(touch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`chain_layers` finds up -> down from one forward; then down takes up's rows without a quantizing pass of its
    own when handed its input unchanged, and quantizes it itself when the model changed it (same results as
    unchained either way)."""
    if int8_linear.int8_kernel() is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(4)
    up = Int8Linear(nn.Linear(48, 96), rows=16, smooth=torch.rand(48, generator=g) + 0.5)
    up.post_op = ("gelu", "none")
    down = Int8Linear(nn.Linear(96, 48), rows=16, smooth=torch.rand(96, generator=g) + 0.5)
    mlp, x = _Mlp(up, down, touch), torch.randn(16, 48, generator=g)
    with torch.inference_mode():
        unchained = mlp(x)
    found = int8_linear.chain_layers(mlp, lambda: mlp(x))
    assert (found, up.feeds, down.feeds) == ((0, None, None) if touch else (1, down, None))
    up.feed(down)  # as if the discovery had missed the change: the version check still refuses stale rows
    calls: list[int] = []
    quantize = int8_linear.quantize_rows
    monkeypatch.setattr(int8_linear, "quantize_rows", lambda *a: (calls.append(1), quantize(*a))[1])
    with torch.no_grad():
        chained = mlp(x)
    assert torch.equal(chained, unchained)
    assert len(calls) == (2 if touch else 1)  # up's own input; down's only where its input was changed
    if not touch:  # in inference mode (no version counters) the handoff rests on the discovery alone
        with torch.inference_mode():
            assert torch.equal(mlp(x), unchained)


@needs_int8
def test_minilm_int8_chains_its_mlps_and_norms(minilm_path: Path) -> None:
    all_int8 = ["model.params.min_cosine=0.9", "model.params.min_mean_cosine=0.99"]  # the gate keeps no layer float
    with Engine.from_workflow("bert", minilm_path, quantization="int8", overrides=all_int8) as engine:
        layers = {n: m for n, m in engine.components["model"].named_modules() if isinstance(m, Int8Linear)}
        assert all(not isinstance(m, Int8Linear) for layer in layers.values() for m in layer.children())
        assert all("int8 onednn" in repr(m) for m in layers.values())  # its extra_repr, in the model's repr
        assert all("fused gelu" in repr(layers[n]) for n in layers if n.endswith("intermediate.dense"))
        names = {id(m): n for n, m in layers.items()}
        chained = {n: names[id(m.feeds)] for n, m in layers.items() if m.feeds is not None}
        want = {}
        for i in range(6):  # the MLP's up projection feeds its down projection; each post-norm's output, the next
            block = f"encoder.layer.{i}."  # int8 layer: the attention's to the MLP, the MLP's to the next block's QKV
            want[block + "intermediate.dense"] = block + "output.dense"
            want[block + "attention.output.dense"] = block + "intermediate.dense"
            if i < 5:
                want[block + "output.dense"] = f"encoder.layer.{i + 1}.attention.qkv"
        assert chained == want
        bf16 = engine.components["model"].attn_backend.bf16_products  # AVX512-BF16 hosts
        qkv = {n for n in layers if n.endswith("attention.qkv")}
        assert {n for n, m in layers.items() if m.out_dtype == torch.bfloat16} == (qkv if bf16 else set())
        assert all(("bfloat16 out" in repr(layers[n])) == bf16 for n in qkv)
        got = engine.embed(TEXTS)
        for m in layers.values():
            m.feed(None)
        assert np.allclose(engine.embed(TEXTS), got, atol=1e-6)  # the handed rows are the rows it would make
        for m in layers.values():
            m.out_dtype = torch.float32
        floats = engine.embed(TEXTS)  # q/k/v rounded by the kernel instead: the same values; its output float32
    with Engine.from_workflow("bert", minilm_path, dtype="float32") as engine:
        ref = engine.embed(TEXTS)
    # the attention's output rounded to bf16 moves some u8 roundings downstream: another int8 result, as close to
    # float32's (all-MiniLM-L6-v2, 700 texts: min 0.99797 / mean 0.99903 with bf16 q/k/v, 0.99795 / 0.99904 without)
    assert all(abs(x - y) <= 2e-3 for x, y in zip(fidelity(got, ref), fidelity(floats, ref)))


class _Backend:
    """An attention backend as `chain_layers` watches one: bf16 products, `forward(q, k, v, *rest)`."""

    bf16_products = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        scores = q.float() @ k.float().T * scale + (0 if meta.bias is None else meta.bias)
        return (torch.softmax(scores, dim=-1) @ v.float()).to(v.dtype)


class _Attention(nn.Module):
    def __init__(self, qkv: Int8Linear, backend: _Backend, between: str) -> None:
        super().__init__()
        self.qkv, self.backend, self.between = qkv, backend, between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.qkv(x)
        if self.between == "in place":
            out.mul_(1.0)
        q, k, v = out.view(len(x), 3, -1).unbind(1)
        if self.between == "rotary":  # a new q, computed from the layer's output: it must see the float32 values
            q = q * 0.5
        bias = torch.zeros(len(x), len(x)) if self.between == "bias" else None  # DeBERTa's relative terms: from q, k
        meta = AttentionMetadata(cu_seqlens=torch.tensor([0, len(x)]), seq_lens=[len(x)], max_seqlen=len(x),
                                 causal=False, bias=bias)
        return self.backend.forward(q, k, v, meta, 1.0)


@pytest.mark.parametrize("between", ["views", "rotary", "in place", "bias"])
def test_a_layer_writes_bf16_only_what_goes_straight_to_an_attention_with_bf16_products(between: str) -> None:
    """`chain_layers` gives a layer bf16 output where the backend is handed views of that output, unchanged, as q,
    k and v; not where anything computed on it or changed it first, nor for a batch with an attention bias, nor where
    the backend takes float32 products."""
    if int8_linear.int8_kernel() is None or int8_unsupported() is not None:
        pytest.skip("no int8 kernels here")
    g = torch.Generator().manual_seed(5)
    backend = _Backend()
    model, x = _Attention(Int8Linear(nn.Linear(32, 96), rows=16), backend, between), torch.randn(16, 32, generator=g)
    with torch.inference_mode():
        floats = model(x)
    int8_linear.chain_layers(model, lambda: model(x), backend)
    assert model.qkv.out_dtype == (torch.bfloat16 if between == "views" else torch.float32)
    with torch.inference_mode():
        got = model(x)
    if between == "views":
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), floats, atol=0.02 * float(floats.abs().max()))
    else:
        assert torch.equal(got, floats)
    backend.bf16_products = False  # an instance attribute: this backend only
    int8_linear.chain_layers(model, lambda: model(x), backend)
    assert model.qkv.out_dtype == torch.float32


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("width", [96, 100])
def test_dequantize_rows_bf16_is_dequantize_rows_rounded_to_bf16_over_its_own_rows(act: int, width: int) -> None:
    """Each row rounded to bf16 (to nearest even, as torch rounds) over the first half of y's own float32 row: the
    result is a strided bf16 view of y's storage."""
    kernel = int8_linear.int8_kernel()
    if kernel is None:
        pytest.skip("the int8 elementwise kernel cannot be built here")
    g = torch.Generator().manual_seed(9)
    y, scale, zero = torch.randn(70, width, generator=g) * 40, torch.rand(70, generator=g), torch.rand(70) * 255
    colsum, bias = torch.randn(width, generator=g), torch.randn(width, generator=g)
    want = kernel.dequantize_rows_(y.clone(), scale, zero, colsum, bias, act).bfloat16()
    mine = y.clone()
    got = kernel.dequantize_rows_bf16_(mine, scale, zero, colsum, bias, act)
    assert got.dtype == torch.bfloat16 and got.shape == (70, width) and got.stride() == (2 * width, 1)
    assert got.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr()
    assert torch.equal(got, want)
    nans = torch.zeros(2, width)
    nans.view(torch.int32)[:, [3, width - 1]] = 0x7FFFFFFF  # a NaN whose rounding carry would leave no NaN
    ones = torch.ones(2)
    kept = kernel.dequantize_rows_bf16_(nans, ones, ones * 0, torch.ones(width), None, 0)
    assert kept[:, [3, width - 1]].isnan().all() and not kept[:, :3].isnan().any()  # in the vectors and the tail
