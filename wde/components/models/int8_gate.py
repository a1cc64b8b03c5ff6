"""The fidelity gate of `quantization: int8`: a model is served in int8 only when its int8 outputs stay close to
its float32 ones, measured at load.

A probe set (`PROBE_TEXTS`, varied lengths, languages, code, numbers; or the user's own texts, one a line, from
`model.params.calibration`) is run through the loaded float32 model, then through the same model with its block
linear layers quantized. Each text's vector is the mean of the model's output token states (the pooled vector for a
model that pools itself): what mean pooling gives, and for CLS-pooled models or heads a close proxy, since every
token's state feeds them. The engine refuses to start (`ModelLoadError`) when the minimum cosine over the texts is
below `model.params.min_cosine` (default 0.99), or the mean below `min_mean_cosine` (0.9993); the figures are logged
either way. The result is cached in
`$WDE_CACHE_DIR/cpu_kernels.json`, as the mixed-precision choice is (wde/components/models/cpu_kernels.py), keyed by
host, model folder, its files' sizes and times, the probe texts and the threshold: later starts run the probe texts
once in float32 (the activation maxima SmoothQuant's scales come from) and take the cached figures and float layers
without measuring again (a failed gate is cached too, and refuses at once).

Where all-int8 falls short, layers whose int8 hurts most are kept float (bfloat16 where the CPU has it natively,
else float32: `int8_linear.quantize_linears`), chosen by measurement (`choose_float_layers`): one block's layer
where that is enough, else all the blocks' layers of a kind. On all-MiniLM-L6-v2 both are the MLP's down projection,
whose GELU outputs quantize worst: the first block's lifts the mean from 0.99927 to 0.99933 on an AMX Xeon, all six
blocks' to 0.99963.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from wde.components.attention.base import AttentionBackend
from wde.components.model_input_builder import ModelInput
from wde.components.models import int8_linear
from wde.components.models.int8_linear import (block_linears, chain_layers, fusible_activations, input_maxima,
                                               kind_of, quantize_linears)
from wde.components.models.cpu_kernels import _host_lock, _read_cache, _write_cache, host_key
from wde.errors import ModelLoadError
from wde.request import TextPrompt

log = logging.getLogger("wde.models")

PROBE_MAX_TOKENS = 256
"""Probe texts are truncated to this many tokens (and the model's own limit)."""

PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "How do I reset my password if I no longer have access to my email account?",
    "def add(a, b):\n    return a + b",
    "SELECT name, count(*) FROM orders GROUP BY name HAVING count(*) > 10;",
    "The mitochondria is the powerhouse of the cell, producing ATP through oxidative phosphorylation.",
    "In 1969, Apollo 11 landed the first humans on the Moon; Neil Armstrong stepped out on July 21 at 02:56 UTC.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "¿Dónde está la estación de tren más cercana?",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "ok",
    "a",
    "!!!",
    "3.14159 2.71828 1.41421 1.73205",
    "Error: connection refused (errno 111) while connecting to 127.0.0.1:5432",
    "Customer review: the headphones broke after two days. Terrible build quality, would not buy again.",
    "Customer review: absolutely love this blender, it crushes ice in seconds and is easy to clean.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The Treaty of Westphalia in 1648 ended the Thirty Years' War and established the principle of state"
    " sovereignty in Europe, shaping international relations for centuries to come.",
    "Take two tablets every six hours with food; do not exceed eight tablets in 24 hours.",
    "Machine learning models can overfit when the training data is small relative to the number of parameters.",
    "URGENT!!! You have WON a FREE cruise — click http://example.com/win now",
    "The defendant appealed the ruling, arguing that the lower court had misapplied the statute of limitations.",
    "She sells sea shells by the sea shore.",
    "Q: How many legs does a spider have? A: Eight.",
    "user@example.com https://wde.example.org/docs?page=2#section-3",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "Preheat the oven to 200 °C, then bake the bread for 35 minutes until golden brown.",
    "The stock market fell 3% on Tuesday after the central bank raised interest rates by half a point.",
    "import torch\nx = torch.randn(4, 4)\nprint(x @ x.T)",
    " ".join(["A long passage about rivers, mountains and the history of trade routes across the continent."] * 12),
    " ".join(f"item {i}: {w}" for i, w in enumerate("alpha beta gamma delta epsilon zeta eta theta".split())),
)
"""The built-in probe set: a few dozen varied texts (short and long, several languages, code, numbers)."""


def read_calibration(path: str) -> list[str]:
    """The non-empty lines of a calibration file (one text a line)."""
    try:
        texts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"model.params.calibration: cannot read {path}: {e}") from None
    if not texts:
        raise ModelLoadError(f"model.params.calibration: {path} holds no text (one text a line)")
    return texts


def probe_batch(tokenizer: object, texts: list[str]) -> ModelInput:
    """The texts tokenized and packed as the packed input builder packs them (positions from 0 per sequence)."""
    limit = getattr(tokenizer, "max_length", None)
    max_length = min(PROBE_MAX_TOKENS, limit) if isinstance(limit, int) else PROBE_MAX_TOKENS
    encoded = tokenizer.encode([TextPrompt(t) for t in texts], max_length=max_length)  # type: ignore[attr-defined]
    lens = [len(ids) for ids, _ in encoded]
    lens_t = torch.tensor(lens, dtype=torch.long)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lens_t, 0, out=cu[1:])
    positions = torch.arange(int(lens_t.sum())) - torch.repeat_interleave(cu[:-1].long(), lens_t)
    types = None
    if any(t is not None for _, t in encoded):
        types = torch.tensor([x for ids, t in encoded for x in (t or [0] * len(ids))], dtype=torch.long)
    ids = torch.tensor([x for ids, _ in encoded for x in ids], dtype=torch.long)
    return ModelInput(ids, positions, cu, lens, max(lens), types)


def text_vectors(model: nn.Module, batch: ModelInput, pools: bool) -> torch.Tensor:
    """One float32 vector per text: the model's pooled output, or the mean of its output token states."""
    with torch.inference_mode():
        out = model(batch).float()
    if pools:
        return out
    bounds = batch.cu_seqlens.tolist()
    return torch.stack([out[a:b].mean(0) for a, b in zip(bounds[:-1], bounds[1:])])


def layers_by_kind(names: list[str]) -> dict[str, list[str]]:
    """`names` (in block order) grouped by layer kind (`kind_of`), each group in block order."""
    by_kind: dict[str, list[str]] = {}
    for name in names:
        by_kind.setdefault(kind_of(name), []).append(name)
    return by_kind


def float_candidates(names: list[str], keep: frozenset[str]) -> list[frozenset[str]]:
    """What the gate tries keeping float next, beside `keep`: of each layer kind not all kept, its first and its
    last block's layer not yet kept, and all its layers not yet kept."""
    found: dict[frozenset[str], None] = {}
    for layers in layers_by_kind(names).values():
        rest = [n for n in layers if n not in keep]
        if rest:
            for c in (frozenset(rest[:1]), frozenset(rest[-1:]), frozenset(rest)):
                found[c] = None
    return list(found)


def choose_float_layers(names: list[str], measure: Callable[[frozenset[str]], tuple[float, float]],
                        min_cosine: float, min_mean_cosine: float) -> tuple[frozenset[str], float, float]:
    """The layers (of `names`, in block order) to keep float, chosen a step at a time by `measure` (their names ->
    min and mean cosine): all-int8 when it passes; else, among the steps `float_candidates` offers, the single layer
    that measures best of those that bring both figures up to the thresholds, or, when no single layer does, the
    step that lifts the figures most; at most half the layers. Returns (names, min, mean) of the last step taken
    (short of the thresholds when no step lifted them further)."""
    keep: frozenset[str] = frozenset()
    low, mean = measure(keep)
    while low < min_cosine or mean < min_mean_cosine:
        tried = {c: measure(keep | c) for c in float_candidates(names, keep) if len(keep | c) <= len(names) // 2}
        passing = [c for c in tried if len(c) == 1 and tried[c][0] >= min_cosine and tried[c][1] >= min_mean_cosine]
        best = max(passing or tried, key=lambda c: tried[c], default=None)
        if best is None or not passing and tried[best] <= (low, mean):
            break
        keep, (low, mean) = keep | best, tried[best]
    return keep, low, mean


def named_layers(names: list[str], keep: frozenset[str]) -> list[str]:
    """`keep`'s layers by name, a kind whose layers are all kept by its kind (`encoder.layer.*.output.dense`)."""
    out = []
    for kind, layers in layers_by_kind(names).items():
        kept = [n for n in layers if n in keep]
        out += [kind] if kept and len(kept) == len(layers) else kept
    return sorted(out)


def gate_key(model_path: Path, texts: list[str], thresholds: tuple[float, float], variant: str = "") -> str:
    """What the verdict depends on: the host, the model's files (names, sizes, times), the probe texts and the
    float paths around the int8 layers (`variant`)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(model_path).rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(model_path)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update("\n".join(texts).encode())
    h.update(repr(int8_linear.SCALE_CORRUPTION).encode())  # the test hook's corrupted scales are another model
    # the thresholds decide which layers stay float, and bf16_pays in which dtype they do
    h.update(f"{thresholds}|{int8_linear.SMOOTHING_ALPHA}|{int8_linear.bf16_pays()}|{int8_linear.scheme()}|{variant}"
             .encode())
    return f"{host_key()}|int8-gate|{Path(model_path).resolve()}|{h.hexdigest()[:16]}"


def run_gate(model: nn.Module, tokenizer: object, model_path: Path, rows: int, min_cosine: float,
             min_mean_cosine: float, calibration: str | None,
             pools: bool = False, variant: str = "",
             attention: AttentionBackend | None = None) -> tuple[float, float, frozenset[str]]:
    """Quantize `model`'s block linear layers behind the fidelity gate; returns (min cosine, mean cosine, names of
    the layers kept float), or raises ModelLoadError when the minimum stays below `min_cosine` or the mean below
    `min_mean_cosine`.

    The probe texts' float32 forward also records each layer's input maxima (SmoothQuant's calibration). When
    all-int8 falls short, layers are kept float by measurement (`choose_float_layers`); a model still short of the
    thresholds is refused."""
    texts = read_calibration(calibration) if calibration else list(PROBE_TEXTS)
    key = gate_key(model_path, texts, (min_cosine, min_mean_cosine), variant)
    originals = block_linears(model)
    names = list(originals)  # in block order
    acts = fusible_activations(model, originals)
    batch = probe_batch(tokenizer, texts)
    with _host_lock():
        with input_maxima(originals) as maxima:
            ref = text_vectors(model, batch, pools)
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and {"min_cosine", "mean_cosine", "float_layers"} <= cached.keys():
            keep = frozenset(cached["float_layers"])
            quantize_linears(model, originals, rows, maxima, keep, acts)
            low, mean, source = float(cached["min_cosine"]), float(cached["mean_cosine"]), "cached"
        else:
            built: dict = {}  # each layer quantized (or cast) once, whatever the trials

            def measure(keep: frozenset[str]) -> tuple[float, float]:
                quantize_linears(model, originals, rows, maxima, keep, acts, built)
                chain_layers(model, lambda: model(batch), attention)  # what is served: bf16 outputs included
                cos = F.cosine_similarity(text_vectors(model, batch, pools), ref, dim=-1)
                return float(cos.min()), float(cos.mean())

            keep, low, mean = choose_float_layers(names, measure, min_cosine, min_mean_cosine)
            quantize_linears(model, originals, rows, maxima, keep, acts, built)
            source = f"measured on {len(texts)} texts"
            _write_cache(key, {"min_cosine": low, "mean_cosine": mean, "float_layers": sorted(keep)})
    dtype = "bfloat16" if int8_linear.bf16_pays() else "float32"
    floats = f"; kept in {dtype}: {', '.join(named_layers(names, keep))}" if keep else ""
    if low < min_cosine or mean < min_mean_cosine:
        short = [f"min cosine {low:.5f} < min_cosine {min_cosine}"] if low < min_cosine else []
        short += [f"mean cosine {mean:.5f} < min_mean_cosine {min_mean_cosine}"] if mean < min_mean_cosine else []
        raise ModelLoadError(f"quantization=int8: the int8 model's vectors fall short of float32's: {'; '.join(short)}"
                             f" (min {low:.5f}, mean {mean:.5f}, {source}{floats}); serve it in float32 or bfloat16,"
                             " or lower the threshold if that is acceptable")
    # where an int8 layer's output feeds the next unchanged, it quantizes it for it (same values, one pass fewer);
    # one whose output is the attention's q/k/v writes it in bf16 (the gate measured that)
    chain_layers(model, lambda: model(batch), attention)
    log.info("int8 fidelity gate passed: min cosine %.5f, mean %.5f to float32 (%s, thresholds %s / %s%s)", low,
             mean, source, min_cosine, min_mean_cosine, floats)
    return low, mean, keep
