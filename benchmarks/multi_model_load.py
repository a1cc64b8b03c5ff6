"""Several models in one `wde serve` against one server per model, on the same CPU and the same mixed workload.

The models are all-MiniLM-L6-v2 (an embedder) and, with `--models embedder,reranker,classifier`, the same MiniLM
encoder under a random one-logit head (a cross-encoder reranker) and a random three-label head (a classifier), saved
to a temporary folder; every model is MiniLM-sized, so each request kind costs alike on both sides. Both sides are
started once and kept up: the combined server (every model behind one port, routed by `model`) and one server per
model (each its own process, as a deployment without multi-model support would run them).

Every load is the same: `--clients` concurrent clients, each sending the request kinds in turn (an embedding of one
text, a rerank of one query against `--documents` documents, a classification of one text) on one keep-alive
connection per kind, until `--requests` requests are done. The loads alternate between the two sides for
`--rounds` rounds (combined first in odd rounds, separate first in even ones), so a neighbour's load on a shared
CPU falls on both; each side's figures are the median over rounds. Prints per round and per model req/s, p50/p99,
then the medians side by side with the ratio combined / separate, and each round's own ratio (its two loads ran
back to back) with their median. The client (`_post`), the server start of one model (`serve_wde`) and the
health wait come from `benchmarks/serve_load.py`.

    python benchmarks/multi_model_load.py                                  # embedder + reranker
    python benchmarks/multi_model_load.py --models embedder,reranker,classifier --rounds 5 --requests 1200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from serve_load import _post, default_model, free_port, serve_wde, wait_healthy
from workload import sentences

KINDS = ("embedder", "reranker", "classifier")
"""The served names of the models this benchmark can run, in the order a client sends their requests."""

ROUTES = {"embedder": "/v1/embeddings", "reranker": "/v1/rerank", "classifier": "/classify"}


def build_heads(minilm: str, folder: Path) -> dict[str, str]:
    """Every model's folder: MiniLM itself, and MiniLM's encoder under a random reranker and classifier head."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    paths = {"embedder": minilm}
    for name, labels in (("reranker", 1), ("classifier", 3)):
        torch.manual_seed(0)
        out = folder / name
        AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=labels).eval().save_pretrained(out)
        AutoTokenizer.from_pretrained(minilm).save_pretrained(out)
        paths[name] = str(out)
    return paths


def serve_combined(port: int, models: list[tuple[str, str | None, str]]) -> None:
    """Every (folder, workflow, served name) behind one port: `wde serve --model A --model B ...` in one process."""
    from wde.server import ServerConfig, run_server
    from wde.server.model_config import ModelConfig

    run_server(ServerConfig(models=tuple(ModelConfig(m, w, n) for m, w, n in models), port=port,
                            max_concurrent_requests=4096))


def body(kind: str, name: str, texts: list[str], i: int, documents: int) -> bytes:
    """Request `i` of `kind`, for the model called `name` on the server it goes to."""
    text = texts[i % len(texts)]
    if kind == "reranker":
        docs = [texts[(i + j + 1) % len(texts)] for j in range(documents)]
        return json.dumps({"model": name, "query": text, "documents": docs, "truncate": True}).encode()
    return json.dumps({"model": name, "input": text, "truncate": True}).encode()


@dataclass
class Load:
    seconds: float = 0.0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: int = 0

    def rps(self, kind: str) -> float:
        return len(self.latencies[kind]) / self.seconds

    def ms(self, kind: str, q: float) -> float:
        return float(np.percentile(self.latencies[kind], q)) * 1000


async def mixed_load(targets: dict[str, tuple[str, str]], texts: list[str], clients: int, requests: int,
                     documents: int) -> Load:
    """`clients` clients, each sending the kinds of `targets` ({kind: (url, served name)}) in turn on one
    connection per kind, until `requests` requests are sent; latencies by kind."""
    kinds = list(targets)
    counter = iter(range(requests))
    result = Load(latencies={k: [] for k in kinds})

    async def client(c: int) -> None:
        conns = {}
        for kind, (url, _) in targets.items():
            host, port = url.removeprefix("http://").split(":")
            conns[kind] = (host, *await asyncio.open_connection(host, int(port)))
        try:
            turn = c  # clients start on different kinds, so each kind is in flight from the first request
            for i in counter:
                kind = kinds[turn % len(kinds)]
                turn += 1
                host, reader, writer = conns[kind]
                start = time.perf_counter()
                status = await _post(reader, writer, host, ROUTES[kind], body(kind, targets[kind][1], texts, i,
                                                                               documents))
                if status == 200:
                    result.latencies[kind].append(time.perf_counter() - start)
                else:
                    result.failures += 1
        finally:
            for _, _, writer in conns.values():
                writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    result.seconds = time.perf_counter() - start
    return result


def start(target, args: tuple) -> tuple[str, mp.Process]:
    port = free_port()
    proc = mp.get_context("spawn").Process(target=target, args=(port, *args))
    proc.start()
    return f"http://127.0.0.1:{port}", proc


def answer(url: str, kind: str, name: str, texts: list[str], documents: int) -> np.ndarray:
    """One request's numbers (vectors, scores or probabilities): the two sides must agree before timing."""
    got = httpx.post(f"{url}{ROUTES[kind]}", content=body(kind, name, texts, 0, documents),
                     headers={"content-type": "application/json"}, timeout=120)
    got.raise_for_status()
    data = got.json()
    if kind == "embedder":
        return np.array(data["data"][0]["embedding"])
    if kind == "reranker":
        return np.array([r["relevance_score"] for r in sorted(data["results"], key=lambda r: r["index"])])
    return np.array(data["data"][0]["probs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedder,reranker", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients per load")
    parser.add_argument("--requests", type=int, default=600, help="requests per load, all kinds together")
    parser.add_argument("--documents", type=int, default=4, help="documents per rerank request")
    parser.add_argument("--rounds", type=int, default=3, help="loads per side, alternated")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds or len(set(kinds)) != len(kinds):
        parser.error(f"--models {args.models!r}: give distinct names of {', '.join(KINDS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    texts = sentences(max(args.requests, 64) * (args.documents + 1))
    with tempfile.TemporaryDirectory(prefix="wde-multi-model-") as tmp:
        paths = build_heads(default_model(), Path(tmp))
        workflows = {"embedder": "bert", "reranker": None, "classifier": None}  # the heads': from the folder
        servers = {"combined": start(serve_combined, ([(paths[k], workflows[k], k) for k in kinds],))}
        servers.update({k: start(serve_wde, (workflows[k], paths[k])) for k in kinds})
        try:
            for url, proc in servers.values():
                wait_healthy(url, proc)
            combined = {k: (servers["combined"][0], k) for k in kinds}
            separate = {k: (servers[k][0], "bench") for k in kinds}
            for k in kinds:
                diff = np.abs(answer(combined[k][0], k, k, texts, args.documents)
                              - answer(separate[k][0], k, "bench", texts, args.documents)).max()
                print(f"{k}: combined vs separate, max abs diff {diff:.1e}")
            print(f"{len(kinds)} models ({', '.join(kinds)}), {args.clients} clients, {args.requests} requests per"
                  f" load ({args.documents} documents per rerank), {args.rounds} rounds, {os.cpu_count()} CPUs")
            for side in (combined, separate):  # warm-up
                asyncio.run(mixed_load(side, texts, args.clients, min(args.requests, 8 * args.clients),
                                       args.documents))
            runs: dict[str, list[Load]] = {"combined": [], "separate": []}
            for r in range(args.rounds):
                order = ("combined", "separate") if r % 2 == 0 else ("separate", "combined")
                for label in order:
                    side = combined if label == "combined" else separate
                    load = asyncio.run(mixed_load(side, texts, args.clients, args.requests, args.documents))
                    runs[label].append(load)
                    print(f"round {r + 1} {label:>8}: " + "  ".join(
                        f"{k} {load.rps(k):6.1f} req/s p50 {load.ms(k, 50):6.1f} p99 {load.ms(k, 99):6.1f} ms"
                        for k in kinds) + f"  failures {load.failures}", flush=True)
        finally:
            for _, proc in servers.values():
                proc.terminate()
            for _, proc in servers.values():
                proc.join(30)
    print(f"medians over {args.rounds} rounds:")
    print(f"{'model':>10}  {'combined req/s':>14} {'p50':>7} {'p99':>7}  {'separate req/s':>14} {'p50':>7} {'p99':>7}"
          f"  ratio")
    for k in kinds:
        med = {label: (statistics.median(x.rps(k) for x in loads), statistics.median(x.ms(k, 50) for x in loads),
                       statistics.median(x.ms(k, 99) for x in loads)) for label, loads in runs.items()}
        (c, c50, c99), (s, s50, s99) = med["combined"], med["separate"]
        print(f"{k:>10}  {c:14.1f} {c50:7.1f} {c99:7.1f}  {s:14.1f} {s50:7.1f} {s99:7.1f}  {c / s:.2f}x")
    total = {label: statistics.median(sum(x.rps(k) for k in kinds) for x in loads) for label, loads in runs.items()}
    print(f"{'all':>10}  {total['combined']:14.1f} {'':7} {'':7}  {total['separate']:14.1f} {'':7} {'':7}"
          f"  {total['combined'] / total['separate']:.2f}x")
    # Each round's two loads ran back to back: their ratio cancels a neighbour's load that changed between rounds.
    paired = [sum(c.rps(k) for k in kinds) / sum(s.rps(k) for k in kinds)
              for c, s in zip(runs["combined"], runs["separate"])]
    print(f"paired ratio combined / separate, all kinds, per round: {' '.join(f'{r:.2f}x' for r in paired)};"
          f" median {statistics.median(paired):.2f}x")


if __name__ == "__main__":
    main()
