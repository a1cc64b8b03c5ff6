"""The int8 peers' models for `peers.py`, exported once into a cache folder (not timed), each in its peer's venv.

- `ort-int8`: sentence-transformers' `export_dynamic_quantized_onnx_model` (ONNX Runtime dynamic quantization:
  int8 weights per channel, activations quantized per tensor at run time) with the config named after the host's
  ISA (`avx512_vnni`, else `avx2`); loaded with `backend="onnx"` and `file_name=onnx/model_qint8_avx512_vnni.onnx`
  (`model_quint8_avx2.onnx`).
- `openvino-int8`: NNCF post-training static quantization through optimum-intel's `OVQuantizer` with
  `OVQuantizationConfig()`'s defaults (8-bit, asymmetric activations, `model_type="transformer"`), the same path as
  sentence-transformers' `export_static_quantized_openvino_model` but calibrated on `calibration_texts()` (the
  workload generator with its own seeds, mixed lengths, one text per sample at its own length) instead of a hub
  data set; loaded with `backend="openvino"` and `file_name=openvino/openvino_model.xml`.

    /work/venvs/ort/bin/python benchmarks/peers_int8_export.py ort-int8 MODEL OUT [--config avx2]
    /work/venvs/ov/bin/python benchmarks/peers_int8_export.py openvino-int8 MODEL OUT [--samples 300]

OUT gets a complete sentence-transformers folder and `export.json` (what was exported, with which versions, in how
many seconds), written last: a folder without it is an unfinished export.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import sentences  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ORT_CONFIGS = ("avx512_vnni", "avx2")


def calibration_texts(n: int = 300) -> list[str]:
    """Half short (~28 words, as the timed short texts), half long (~150 words); seeds 11 and 12, which no timed or
    fidelity workload of peers.py uses."""
    return sentences(n - n // 2, mean_words=28, seed=11) + sentences(n // 2, mean_words=150, seed=12)


OPENVINO_FILE = "openvino/openvino_model.xml"


def openvino_config() -> dict[str, str]:
    """OpenVINO's own defaults, but float32 for what stays float when oneDNN is capped to AVX2 (`peers.py --isa
    avx2`): its default there is still bfloat16 on a CPU that has it, and its capped oneDNN then has no bfloat16
    Softmax (compiling fails); a host without AVX-512 runs float32."""
    return {"INFERENCE_PRECISION_HINT": "f32"} if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else {}


def export_ort_int8(model: str, out: Path, config: str) -> dict:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.backend import export_dynamic_quantized_onnx_model

    st = SentenceTransformer(model, device="cpu", backend="onnx")  # exports model.onnx through optimum
    st.save(str(out))
    export_dynamic_quantized_onnx_model(st, config, str(out))
    written = sorted(out.glob(f"onnx/model_*_{config}.onnx"))  # qint8 weights for avx512_vnni, quint8 for avx2
    if len(written) != 1:
        raise SystemExit(f"ort-int8: expected one onnx/model_*_{config}.onnx in {out}, found {written}")
    return {"file_name": str(written[0].relative_to(out)), "config": config}


def export_openvino_int8(model: str, out: Path, samples: int) -> dict:
    import nncf
    from optimum.intel import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu", backend="openvino",  # exports the float IR through optimum-intel
                             model_kwargs={"ov_config": openvino_config()})
    ov_model = st.transformers_model
    inputs = set(ov_model.input_names)
    data = []
    for text in calibration_texts(samples):
        encoded = st.tokenizer(text, truncation=True, max_length=st.max_seq_length, return_tensors="np")
        data.append({k: v for k, v in encoded.items() if k in inputs})
    config = OVQuantizationConfig(num_samples=len(data))
    OVQuantizer.from_pretrained(ov_model).quantize(nncf.Dataset(data), ov_config=OVConfig(quantization_config=config))
    st.save(str(out))  # the quantizer replaced the model in place: this writes the int8 IR
    xml = (out / OPENVINO_FILE).read_text()
    fake_quantize = xml.count('type="FakeQuantize"')
    if not fake_quantize:
        raise SystemExit(f"openvino-int8: {OPENVINO_FILE} in {out} has no FakeQuantize node: not quantized")
    return {"file_name": OPENVINO_FILE, "calibration_texts": len(data), "fake_quantize_nodes": fake_quantize}


def export(engine: str, model: str, out: str, config: str = "avx512_vnni", samples: int = 300) -> None:
    from importlib.metadata import version

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if engine == "ort-int8":
        info = export_ort_int8(model, path, config)
        packages = ("onnxruntime", "optimum", "optimum-onnx", "sentence-transformers", "transformers")
    elif engine == "openvino-int8":
        info = export_openvino_int8(model, path, samples)
        packages = ("openvino", "nncf", "optimum-intel", "sentence-transformers", "transformers")
    else:
        raise SystemExit(f"no int8 export for {engine!r}; known: ort-int8, openvino-int8")
    info.update(engine=engine, model=model, seconds=round(time.perf_counter() - t0, 1),
                versions={p: version(p) for p in packages})
    (path / "export.json").write_text(json.dumps(info, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", choices=["ort-int8", "openvino-int8"])
    ap.add_argument("model", help="a sentence-transformers folder")
    ap.add_argument("out", help="the folder to write")
    ap.add_argument("--config", default="avx512_vnni", choices=ORT_CONFIGS, help="ort-int8's quantization config")
    ap.add_argument("--samples", type=int, default=300, help="openvino-int8's calibration texts")
    args = ap.parse_args()
    export(args.engine, args.model, args.out, args.config, args.samples)
    print(Path(args.out, "export.json").read_text())


if __name__ == "__main__":
    main()
