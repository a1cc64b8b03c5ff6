"""Load test of `wde.ray_serve` (1 and 2 replicas behind Ray Serve's proxy) against `wde serve`, and the proxy's own
cost per request.

The same load as benchmarks/serve_load.py (N keep-alive connections, each sending /v1/embeddings requests of K texts
until a fixed total is done) against, one after the other:

- `wde serve` in its own process (one engine, all the cores);
- a local Ray cluster (`ray.init(num_cpus=CORES)`) serving `build_app` with 1 replica (`num_cpus` = all the cores)
  and then 2 replicas (half the cores each), through Ray's HTTP proxy;
- the proxy's overhead: a deployment that answers a constant JSON body at once, through Ray's proxy, as a plain
  deployment and as a FastAPI app behind `serve.ingress` (the way `wde.ray_serve` serves WDE's app), against the
  same constant route on a bare uvicorn + FastAPI server: the difference in latency is what the proxy and its hop
  to the replica add to every request, whatever the model.

Prints requests/s, inputs/s, p50 and p99 latency for each. On a machine with fewer cores than replicas want,
replicas share the CPU (Ray's `num_cpus` is a reservation, not a cap): say so with the figures.

    python benchmarks/ray_serve_load.py --clients 1,64 --requests 2000
    python benchmarks/ray_serve_load.py --clients 64 --texts-per-request 8 --replicas 1,2,4 --cores 8
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import httpx

from serve_load import LoadResult, default_model, free_port, int_list, load, run_server, serve_wde, wait_healthy
from workload import sentences


def report(name: str, clients: int, per_request: int, result: LoadResult) -> None:
    print(f"{name:>14} clients {clients:4d} x {per_request:3d} texts: {result.rps:8.1f} req/s"
          f" {result.inputs / result.seconds:9.1f} inputs/s  p50 {result.percentile(50):7.1f} ms"
          f"  p99 {result.percentile(99):7.1f} ms  failures {result.failures}", flush=True)


def sweep_url(name: str, url: str, texts: list[str], sweep: list[tuple[int, int]]) -> dict:
    results = {}
    for clients, per_request in sweep:
        asyncio.run(load(url, texts[:clients * per_request], clients, per_request))  # warm-up
        results[(clients, per_request)] = result = asyncio.run(load(url, texts, clients, per_request))
        report(name, clients, per_request, result)
    return results


def serve_constant(port: int) -> None:
    """The bare baseline of the proxy measurement: FastAPI on uvicorn answering a constant body."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/embeddings")
    async def constant() -> dict:
        return {"object": "list", "data": []}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--workflow", default=None, help="WDE workflow (default: chosen from the model)")
    parser.add_argument("--clients", type=int_list, default=[1, 64], help="comma-separated, e.g. 1,64")
    parser.add_argument("--texts-per-request", type=int_list, default=[1], help="comma-separated, e.g. 1,8")
    parser.add_argument("--requests", type=int, default=2000, help="texts sent per load (per sweep point)")
    parser.add_argument("--replicas", type=int_list, default=[1, 2], help="Ray Serve replica counts to run")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="CPUs of the local Ray cluster, split evenly between the replicas")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = args.model or default_model()
    texts = sentences(args.requests)
    sweep = [(c, k) for k in args.texts_per_request for c in args.clients]
    print(f"{args.requests} texts per load, clients {args.clients}, texts per request {args.texts_per_request},"
          f" model {model}, {args.cores} cores for Ray")

    run_server("wde serve", serve_wde, (args.workflow, model, 0, ()), texts, sweep)
    port = free_port()
    proc = mp.get_context("spawn").Process(target=serve_constant, args=(port,))
    proc.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        bare = sweep_url("bare constant", f"http://127.0.0.1:{port}", texts, sweep)
    finally:
        proc.terminate()
        proc.join(30)

    import ray
    from ray import serve

    from wde.ray_serve import build_app

    @serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
    class Constant:
        async def __call__(self, request: object) -> dict:
            return {"object": "list", "data": []}

    def constant_app() -> object:
        from fastapi import FastAPI

        app = FastAPI()

        @app.post("/v1/embeddings")
        async def constant() -> dict:
            return {"object": "list", "data": []}

        return app

    @serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
    @serve.ingress(constant_app)
    class ConstantIngress:  # as wde.ray_serve's replicas are: a FastAPI app behind serve.ingress
        pass

    ray.init(num_cpus=args.cores, include_dashboard=False, log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        proxied = {}
        for label, deployment in (("ray constant", Constant), ("ray ASGI const", ConstantIngress)):
            serve.run(deployment.bind(), name="constant", route_prefix="/")
            proxied[label] = sweep_url(label, url, texts, sweep)
            serve.delete("constant")
        for label, results in proxied.items():
            for point in sweep:
                extra_ms = results[point].percentile(50) - bare[point].percentile(50)
                print(f"Ray's proxy ({label}), clients {point[0]:4d} x {point[1]:3d} texts: +{extra_ms:.1f} ms per"
                      f" request at p50 ({results[point].rps:.0f} req/s at most through it here, bare uvicorn"
                      f" {bare[point].rps:.0f})")
        for n in args.replicas:
            started = time.monotonic()
            serve.run(build_app({"model": model, "workflow": args.workflow, "served_model_name": "bench",
                                 "max_concurrent_requests": 4096, "num_replicas": n,
                                 "ray_actor_options": {"num_cpus": max(args.cores / n, 0.5)}}),
                      name="wde", route_prefix="/")
            print(f"{n} replica(s) up in {time.monotonic() - started:.0f} s", flush=True)
            httpx.post(f"{url}/v1/embeddings", json={"input": texts[:4]}, timeout=120).raise_for_status()
            sweep_url(f"ray {n} replica{'s' if n > 1 else ''}", url, texts, sweep)
            serve.delete("wde")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
