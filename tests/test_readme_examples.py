"""Every ```python block of README.md runs verbatim, each in a fresh interpreter outside the source tree, with the
bundled model (all-MiniLM-L6-v2, offline). A block that raises fails the test with its traceback.

The prose around a block shows more calls on its `engine` inline (`engine.embed(texts, truncate=True, ...)`): each
complete one (no `...` placeholder) runs too, after the block, on sample `texts`. Blocks that talk to a live server
(`http://127.0.0.1:8000`) are tests/test_docs_examples.py's: they need one.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """(README.md:LINE, code) of every fenced block whose language is python."""
    blocks, lang, start, lines = [], None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, lines = line[3:].strip().lower(), n, []
            else:
                if lang in ("python", "py"):
                    blocks.append((f"{path.name}:{start}", "\n".join(lines) + "\n"))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def inline_engine_calls(path: Path) -> list[str]:
    """Inline code spans of the document that are complete calls on `engine` (they parse, no `...`)."""
    calls = []
    prose = re.sub(r"(?ms)^```.*?^```[^\n]*$", "", path.read_text(encoding="utf-8"))  # fenced blocks out
    for span in re.findall(r"`([^`]+)`", prose.replace("\n", " ")):  # a span may wrap across lines
        if span.startswith("engine.") and "..." not in span:
            try:
                ast.parse(span, mode="eval")
            except SyntaxError:
                continue
            calls.append(span)
    return calls


SAMPLE = 'texts = inputs = ["Prefill only.", "No decode loop.", "word " * 1000]\n'
"""What the inline calls' placeholders stand for: two short texts and one longer than the model's 256 tokens."""


def with_inline_calls(code: str, calls: list[str]) -> str:
    if not re.search(r"^engine\s*=", code, re.M):
        return code
    return code + SAMPLE + "".join(f"{call}  # inline in the README\n" for call in calls)


BLOCKS = [(where, with_inline_calls(code, inline_engine_calls(README)))
          for where, code in python_blocks(README) if "127.0.0.1:8000" not in code]


def test_readme_has_python_examples() -> None:
    assert BLOCKS, "README.md has no ```python block"
    assert any("# inline in the README" in code for _, code in BLOCKS), "no inline engine call found"


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_readme_python_block_runs_verbatim(where: str, code: str, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WDE_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)  # the installed package, as a reader of the README has it
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{where} raised:\n{result.stderr[-4000:]}"


def test_the_checker_catches_a_failing_block(tmp_path: Path) -> None:
    """The extraction itself: a block after prose is found, and a README block that raises is reported."""
    doc = tmp_path / "README.md"
    doc.write_text("# x\n\n```bash\nwde serve\n```\n\ntext\n\n```python\nfrom wde import Engine\n"
                   "engine = Engine.from_workflow('bert')\n```\n\n`engine.embed(texts, truncate=True,\n"
                   'prompt_name="query")` and `engine.encode(inputs, PoolingParams(...))`\n', encoding="utf-8")
    (where, code), = python_blocks(doc)
    calls = inline_engine_calls(doc)
    assert where == "README.md:9" and calls == ['engine.embed(texts, truncate=True, prompt_name="query")']
    result = subprocess.run([sys.executable, "-c", with_inline_calls(code, calls)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "WDE_DEVICE": "cpu"})
    assert result.returncode != 0 and "prompt_name 'query' is not defined" in result.stderr
