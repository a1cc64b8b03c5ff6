"""`wde.api` is the plugin authors' API: every name resolves, is documented in docs/plugins.md, and the
registration-side names import no torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import wde.api

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs/plugins.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", wde.api.__all__)
def test_every_public_name_resolves_and_is_documented(name: str) -> None:
    assert getattr(wde.api, name) is not None
    assert re.search(rf"`{re.escape(name)}[`(\[]", DOC), f"wde.api.{name} is not documented in docs/plugins.md"


def test_unknown_name_says_where_the_api_is() -> None:
    with pytest.raises(AttributeError, match="wde.api.__all__"):
        wde.api.PrivateThing  # noqa: B018


def test_registration_names_import_no_torch() -> None:
    """A plugin's hook module imports these; `wde plugins` / `wde validate` must stay torch-free."""
    code = ("import sys; from wde.api import hookimpl, LazyComponent, Params, ModelParams, AttentionParams, "
            "SentencePoolerParams; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_serve_option_checks_import_no_torch(tmp_path: Path) -> None:
    """`wde serve` checks its options and that each model folder is there before it imports torch, the engine and
    FastAPI: a typo or a wrong path is refused in one line at once, not after seconds of imports."""
    code = ("import sys; from wde.server import ServerConfig; from wde.server.model_config import from_options;"
            " from wde.model_source import ModelSource; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    probe = ("import sys; from wde.cli import main; code = 0\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('torch' in sys.modules, code)")
    for args in (["--model", str(tmp_path / "absent")], ["--model", "a", "--served-model-name", "x,y",
                                                          "--served-model-name", "z"]):
        out = subprocess.run([sys.executable, "-c", probe, "serve", *args], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
        assert out.stdout.split() == ["False", "1"], out.stdout + out.stderr
        assert out.stderr.startswith("Error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
