"""`wde.ray_serve.build_app` on a local 2-CPU Ray cluster: the app `wde serve` serves, through Ray Serve's proxy, with
sentence-transformers' vectors; autoscaling from 1 to 2 replicas and back; a replica killed under load answers every
request (an error is allowed, a hang is not) and is replaced; several models behind one router.

Generous timeouts everywhere: the CPU is small and shared, and no assertion depends on how fast it is."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests import tiny_models
from wde.engine import EngineLoad
from wde.ray_serve import RayServeArgsError, build_app, parse_model

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'wde[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'wde[ray]')")

MEAN = "pooler.params.pooling=mean"
"""The tiny random folders have no sentence-transformers Pooling config."""
REPLICA = {"num_cpus": 0.5}
"""Small enough that the proxy, the controller and two replicas share the test cluster's 2 CPUs."""
DEADLINE_S = 240.0
"""The longest any wait below may take before the test fails (a slow shared CPU, not a wrong answer)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> str:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for(what: str, check, timeout: float = DEADLINE_S) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            pytest.fail(f"waited {timeout:.0f} s for {what}; serve.status(): {serve.status()}")
        time.sleep(0.25)


def replicas(app: str, deployment: str, state: str = "RUNNING") -> int:
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return status.deployments[deployment].replica_states.get(state, 0)


def test_args_are_validated_and_refused_by_name() -> None:
    config, options = parse_model({"model": "m", "set": "pooler.params.pooling=mean", "max_concurrent_requests": "8",
                                   "token_id_inputs": "false",
                                   "allowed_origins": "https://a.example, https://b.example",
                                   "autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}',
                                   "ray_actor_options": {"num_gpus": 0.25}})
    assert config.overrides == ["pooler.params.pooling=mean"] and config.max_concurrent_requests == 8
    assert config.token_id_inputs is False and config.allowed_origins == ("https://a.example", "https://b.example")
    assert options.autoscaling_config == {"min_replicas": 1, "max_replicas": 4}
    assert options.ray_actor_options == {"num_gpus": 0.25} and options.max_ongoing_requests == 8
    config, _ = parse_model({"model": "m", "max_image_pixels": "1000", "set": '["a.b=1", "c.d=2"]'})
    assert config.overrides == ["a.b=1", "c.d=2", "input_processor.params.max_image_pixels=1000"]
    refusals = {
        "modle": ("modle: unknown argument (did you mean 'model'?)", {"modle": "m"}),
        "port": ("port: not taken by wde.ray_serve: Ray Serve's proxy listens", {"port": 8000}),
        "api_servers": ("api_servers: not taken by wde.ray_serve", {"api_servers": 2}),
        "limit": ("max_concurrent_requests must be an integer, at least 1", {"max_concurrent_requests": 0}),
        "type": ("max_client_batch_size: Input should be a valid integer", {"max_client_batch_size": "many"}),
        "both": ("num_replicas: give a number of replicas or autoscaling_config, not both",
                 {"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}),
        "key": ("api_key is empty", {"api_key": " "}),
    }
    for case, (message, args) in refusals.items():
        with pytest.raises(RayServeArgsError, match=None) as e:
            parse_model(args)
        assert message in str(e.value), (case, str(e.value))
    with pytest.raises(RayServeArgsError, match=r"models\[1\]\.sett: unknown argument \(did you mean 'set'\?\)"):
        build_app({"models": [{"model": "a"}, {"model": "b", "sett": "x=1"}]})
    with pytest.raises(RayServeArgsError, match="models: give a list"):
        build_app({"models": []})
    _, options = parse_model({"max_concurrent_requests": 16})
    assert options.max_ongoing_requests == 16  # Ray holds back what the app would answer 429


def test_router_refuses_two_models_called_alike() -> None:
    import asyncio
    from types import SimpleNamespace

    from wde.ray_serve import Router

    def handle(*names: str) -> SimpleNamespace:
        async def remote() -> tuple[str, ...]:
            return names

        return SimpleNamespace(names=SimpleNamespace(remote=remote))

    router = Router.__new__(Router)
    with pytest.raises(RayServeArgsError, match=r"'b' names models\[0\] and models\[1\]"):
        asyncio.run(router.__init__([handle("a", "b"), handle("b", "c")], [None, None]))


def test_engine_load_counts_queued_and_running_inputs_and_tokens(tiny_bert: Path) -> None:
    """What the autoscaler gauges read (`Engine.load`): one batch holds two of three 52-token inputs (a budget of
    128 tokens); the third is tokenized and queued (sync executor) or already handed to the device (thread)."""
    from wde import Engine

    texts = ["word " * 50] * 3  # 50 words, [CLS] and [SEP]: 52 tokens
    budget = "scheduler.params.max_num_batched_tokens=128"
    with Engine.from_workflow(None, tiny_bert, overrides=[MEAN, budget, "executor.name=sync"]) as engine:
        for text in texts:
            engine.add_request(text)
        assert engine.load() == EngineLoad(queued_inputs=3, queued_tokens=0, running_inputs=0, running_tokens=0)
        assert len(engine.step()) == 2
        assert engine.load() == EngineLoad(queued_inputs=1, queued_tokens=52, running_inputs=0, running_tokens=0)
    with Engine.from_workflow(None, tiny_bert, overrides=[MEAN, budget, "executor.name=thread"]) as engine:
        for text in texts:
            engine.add_request(text)
        assert len(engine.step()) == 2  # the first batch finished while the second was handed to the device
        assert engine.load() == EngineLoad(queued_inputs=0, queued_tokens=0, running_inputs=1, running_tokens=52)
        assert len(engine.step()) == 1
        assert engine.load() == EngineLoad(0, 0, 0, 0)


def test_metrics_expose_the_engine_load_per_model() -> None:
    """/metrics' autoscaler gauges read `load` at scrape time (an engine in this process) or are written by the
    engine core after each step (`on_core_step`, split mode)."""
    from types import SimpleNamespace

    from wde.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    engine = SimpleNamespace(info=SimpleNamespace(token_budget=2048), queue_depth=3, num_restarts=0, num_pending=5,
                             active_calls=2, num_aborted=0, healthy=True, seconds_since_step=0.1,
                             load=EngineLoad(queued_inputs=3, queued_tokens=40, running_inputs=2, running_tokens=90))
    metrics.for_model("a").bind(engine)
    metrics.for_model("b").on_core_step(EngineLoad(7, 70, 1, 11), restarts=0)
    text = metrics.render().decode()
    for line in ('wde_queue_depth{model="a"} 3.0', 'wde_queued_tokens{model="a"} 40.0',
                 'wde_running_inputs{model="a"} 2.0', 'wde_running_tokens{model="a"} 90.0',
                 'wde_queue_depth{model="b"} 7.0', 'wde_queued_tokens{model="b"} 70.0',
                 'wde_running_inputs{model="b"} 1.0', 'wde_running_tokens{model="b"} 11.0'):
        assert line in text, line


def st_vectors(path: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)


def test_routes_through_rays_proxy_equal_sentence_transformers(cluster: str, minilm_path: Path) -> None:
    serve.run(build_app({"model": minilm_path, "ray_actor_options": REPLICA, "served_model_name": "minilm"}),
              name="parity", route_prefix="/")
    texts = ["a cat sat on the mat", "Ray Serve runs WDE replicas", "naïve café"]
    want = st_vectors(minilm_path, texts)
    with httpx.Client(base_url=cluster, timeout=120) as client:
        r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts}, headers={"x-request-id": "r-1"})
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-request-id") == ["r-1"]  # once: Ray's proxy adds it, the app's copy is dropped
        got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
        assert np.abs(got - want).max() <= 1e-4
        r = client.post("/embed", json={"inputs": texts})
        assert r.status_code == 200, r.text
        assert np.abs(np.array(r.json(), np.float32) - want).max() <= 1e-4
        r = client.post("/v1/embeddings", json={"model": "other", "input": "x"})
        assert r.status_code == 404 and "model 'other' is not served here" in r.json()["error"]["message"]
        r = client.post("/v1/embeddings", json={"input": ["x"] * 3000})  # wde serve's own limit, its own error
        assert r.status_code == 422 and "2048" in r.text
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        for series in ("wde_queue_depth", "wde_queued_tokens", "wde_running_inputs", "wde_running_tokens",
                       "wde_active_requests"):
            assert series in metrics, series
    serve.delete("parity")


def load(url: str, stop: threading.Event, statuses: list, body: dict, clients: int, timeout: float) -> list:
    """`clients` threads posting `body` until `stop`; each answer's status (or the exception) lands in
    `statuses`. Every request has `timeout` seconds: a hang fails the test as an `httpx.TimeoutException`."""

    def client() -> None:
        with httpx.Client(timeout=timeout) as c:
            while not stop.is_set():
                try:
                    statuses.append(c.post(url, json=body).status_code)
                except httpx.TimeoutException as e:
                    statuses.append(e)
                except httpx.TransportError as e:  # the connection dropped: answered, with an error
                    statuses.append(type(e).__name__)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")  # Ray 2.60 moves metrics_interval_s
def test_autoscales_up_under_load_and_back_down(cluster: str, tiny_bert: Path) -> None:
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
                   "downscale_delay_s": 3, "look_back_period_s": 2}
    serve.run(build_app({"model": tiny_bert, "set": MEAN, "ray_actor_options": REPLICA,
                         "autoscaling_config": autoscaling}),
              name="scale", route_prefix="/")
    assert replicas("scale", "WDE") == 1
    stop, statuses = threading.Event(), []
    threads = load(f"{cluster}/v1/embeddings", stop, statuses, {"input": tiny_models.corpus(32)}, 6, 120)
    try:
        wait_for("a second replica under load", lambda: replicas("scale", "WDE") == 2)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert statuses and all(s == 200 for s in statuses), set(map(str, statuses))
    wait_for("the deployment back at one replica", lambda: replicas("scale", "WDE") == 1
             and replicas("scale", "WDE", "STOPPING") == 0)
    serve.delete("scale")


def test_replica_killed_under_load_answers_every_request(cluster: str, tiny_bert: Path) -> None:
    serve.run(build_app({"model": tiny_bert, "set": MEAN, "ray_actor_options": REPLICA,
                         "num_replicas": 2}),
              name="faults", route_prefix="/")
    stop, statuses = threading.Event(), []
    threads = load(f"{cluster}/v1/embeddings", stop, statuses, {"input": tiny_models.corpus(64)}, 6, 120)
    try:
        wait_for("requests to flow", lambda: len(statuses) >= 12)
        victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith("SERVE_REPLICA::faults#WDE#"))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        served = len(statuses)
        wait_for("requests answered after the kill", lambda: len(statuses) >= served + 24)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert not any(t.is_alive() for t in threads)
    hung = [s for s in statuses if isinstance(s, httpx.TimeoutException)]
    assert not hung, f"{len(hung)} requests hung"
    assert statuses.count(200) >= len(statuses) - 12, set(map(str, statuses))  # only those in flight may fail
    wait_for("the controller to replace the replica", lambda: replicas("faults", "WDE") == 2)
    r = httpx.post(f"{cluster}/v1/embeddings", json={"input": "after"}, timeout=120)
    assert r.status_code == 200, r.text
    serve.delete("faults")


def test_several_models_behind_one_router(cluster: str, tmp_path: Path) -> None:
    from wde import Engine

    a = tiny_models.build_bert(tmp_path / "a", seed=1)
    b = tiny_models.build_bert(tmp_path / "b", seed=2)
    serve.run(build_app({"ray_actor_options": REPLICA, "api_key": "k", "set": MEAN,
                         "models": [{"model": a, "served_model_name": "alpha"},
                                    {"model": b, "served_model_name": "beta", "num_replicas": 1}]}),
              name="many", route_prefix="/")
    texts = ["one text", "another one"]
    auth = {"Authorization": "Bearer k"}
    with httpx.Client(base_url=cluster, timeout=120, headers=auth) as client:
        for name, path in (("alpha", a), ("beta", b)):
            r = client.post("/v1/embeddings", json={"model": name, "input": texts})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            with Engine.from_workflow(None, path, overrides=[MEAN]) as engine:
                want = engine.embed(texts)
            assert np.abs(np.array([d["embedding"] for d in r.json()["data"]], np.float32) - want).max() <= 1e-5
        r = client.post("/embed", json={"inputs": texts})  # TEI names no model: the first one answers
        assert r.status_code == 200
        with Engine.from_workflow(None, a, overrides=[MEAN]) as engine:
            want = engine.embed(texts, normalize=True)  # TEI's /embed normalizes by default
        assert np.abs(np.array(r.json(), np.float32) - want).max() <= 1e-5
        r = client.post("/v1/embeddings", json={"model": "gamma", "input": "x"})
        assert r.status_code == 404 and "'alpha', 'beta'" in r.json()["error"]["message"]
        assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {"alpha", "beta"}
        assert client.get("/health").status_code == 200
        assert 'wde_queue_depth{model="beta"}' in client.get("/metrics", params={"model": "beta"}).text
    r = httpx.post(f"{cluster}/v1/embeddings", json={"model": "gamma", "input": "x"}, timeout=120)
    assert r.status_code == 401  # without the key the router leaks no model names

    # beta's only replica killed under load: nothing hangs (Ray's handle resends the router's calls once the
    # replacement serves; one that fails is answered 503 with Retry-After), and beta serves again
    answers: list = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=cluster, timeout=120, headers=auth) as c:
            while not stop.is_set():
                try:
                    r = c.post("/v1/embeddings", json={"model": "beta", "input": tiny_models.corpus(16)})
                    answers.append((r.status_code, r.headers.get("retry-after"), r.json()))
                except httpx.HTTPError as e:
                    answers.append((repr(e), None, None))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for("requests to beta", lambda: len(answers) >= 8)
        victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith("SERVE_REPLICA::many#WDE-1#"))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        wait_for("beta's replica replaced", lambda: replicas("many", "WDE-1") == 1
                 and replicas("many", "WDE-1", "STARTING") == 0 and len(answers) >= 40)
        done = len(answers)
        wait_for("beta answering again", lambda: len(answers) >= done + 4)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    errors = [a for a in answers if a[0] != 200]
    assert all(a[0] == 503 and a[1] == "1" and "retrying is safe" in a[2]["error"]["message"] for a in errors), errors
    assert answers[-1][0] == 200
    serve.delete("many")


def test_rolling_update_loses_no_request(cluster: str, tmp_path: Path) -> None:
    """Deploying a new model version under load: every request is answered 200, first by the old model's replica,
    then by the new one's. One replica a version, the hardest case (no other old replica takes the requests while the
    new one starts) and half the replica starts of two (this test took 99 s of CI's time with two)."""
    from wde import Engine

    old, new = tiny_models.build_bert(tmp_path / "v1", seed=3), tiny_models.build_bert(tmp_path / "v2", seed=4)
    text = "the same text, old and new"
    versions = {}
    for name, path in (("v1", old), ("v2", new)):
        with Engine.from_workflow(None, path, overrides=[MEAN]) as engine:
            versions[name] = engine.embed([text])[0]
    args = {"set": MEAN, "served_model_name": "m", "ray_actor_options": REPLICA, "num_replicas": 1}
    serve.run(build_app({**args, "model": old}), name="roll", route_prefix="/")
    answers: list = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                try:
                    r = c.post(f"{cluster}/v1/embeddings", json={"model": "m", "input": text})
                    answers.append(np.array(r.json()["data"][0]["embedding"]) if r.status_code == 200 else r.text)
                except httpx.HTTPError as e:
                    answers.append(repr(e))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for("requests to flow", lambda: len(answers) >= 8)
        serve.run(build_app({**args, "model": new}), name="roll", route_prefix="/")  # returns once v2 serves
        done = len(answers)
        wait_for("answers after the update", lambda: len(answers) >= done + 8)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    failed = [a for a in answers if isinstance(a, str)]
    assert not failed, failed[:3]
    which = ["v1" if np.abs(a - versions["v1"]).max() <= 1e-5 else "v2" for a in answers]
    assert which[0] == "v1" and which[-1] == "v2"
    assert all(np.abs(a - versions[w]).max() <= 1e-5 for a, w in zip(answers, which))
    serve.delete("roll")
