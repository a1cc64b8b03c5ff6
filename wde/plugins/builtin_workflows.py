"""The bundled workflows (`workflows/*.yaml`) and the architectures they serve by default."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import wde
from wde.errors import RegistryError
from wde.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from wde.model_source import ModelSource

DEFAULT_ARCHITECTURES: dict[str, str] = {
    "BertForSequenceClassification": "sequence_classification",
    "XLMRobertaForSequenceClassification": "xlm_roberta_sequence_classification",
    "RobertaForSequenceClassification": "xlm_roberta_sequence_classification",
    "Qwen2Model": "gte_qwen2",
    "Qwen2ForCausalLM": "gte_qwen2",
    "MistralModel": "e5_mistral",
    "MistralForCausalLM": "e5_mistral",
    "LlamaModel": "decoder_features",
    "LlamaForCausalLM": "decoder_features",
    "Qwen3Model": "qwen3_embedding",
    "ModernBertForMaskedLM": "modernbert",
    "ModernBertForSequenceClassification": "modernbert_sequence_classification",
    "NomicBertModel": "nomic_bert",
    "GteModel": "gte_multilingual",
    "JinaEmbeddingsV3Model": "jina_embeddings_v3",
    "EuroBertModel": "eurobert",
    "DistilBertModel": "distilbert",
    "DistilBertForSequenceClassification": "distilbert_sequence_classification",
    "MPNetModel": "mpnet",
    "CLIPModel": "clip",
    "SiglipModel": "siglip",
    "Siglip2Model": "siglip2",
    "ColPaliForRetrieval": "colpali",
    "ColQwen2ForRetrieval": "colqwen2",
    "Gemma3TextModel": "embeddinggemma",
    "DebertaV2Model": "deberta_v2",
    "DebertaV2ForSequenceClassification": "deberta_v2_sequence_classification",
}


@dataclass(frozen=True)
class EmbedderIfSentenceTransformers:
    """Picks the workflow for an architecture that an embedder and other families share (Qwen3ForCausalLM:
    Qwen3-Embedding, Qwen3-Reranker, Qwen3 chat models): the embedder when the model folder carries a
    sentence-transformers config, else an error naming the workflows to choose from."""

    architecture: str
    embedder: str
    others: tuple[str, ...]
    others_serve: str = ""
    """What the other workflows are for, shown in the error (e.g. "a Qwen3-Reranker checkpoint")."""

    def __call__(self, source: "ModelSource") -> str:
        if any(source.read_json(f) is not None for f in ("modules.json", "config_sentence_transformers.json")):
            return self.embedder
        others = " or ".join(f"--workflow {w}" for w in self.others)
        raise RegistryError(
            f"{source.path} declares {self.architecture}, which several workflows serve"
            f" ({', '.join((self.embedder, *self.others))}); {self.embedder} is picked only for a folder with a sentence-transformers config (modules.json"
            f" or config_sentence_transformers.json) and this one has none. Pass {others}"
            f"{f' for {self.others_serve}' if self.others_serve else ''}, or --workflow {self.embedder} to embed"
            " with it (in Python: Engine.from_workflow(name, model))")

    def __str__(self) -> str:
        return f"{self.embedder} (with a sentence-transformers config; else --workflow {'|'.join(self.others)})"


@dataclass(frozen=True)
class SpladeIfSparseEncoder:
    """Picks SPLADE for a masked-LM architecture (BertForMaskedLM is any BERT masked LM, not only SPLADE's) when
    the folder is a sentence-transformers SparseEncoder of the SPLADE kind (MLMTransformer or a fill-mask
    Transformer, then SpladePooling); any other folder is an error saying why and naming --workflow."""

    architecture: str
    workflow: str = "splade"

    def __call__(self, source: "ModelSource") -> str:
        from wde.components.sparse_encoder import sparse_encoder_problem  # torch-free

        problem = sparse_encoder_problem(source)
        if problem is None:
            return self.workflow
        raise RegistryError(
            f"{source.path} declares {self.architecture}, a masked-LM checkpoint, which WDE serves only as SPLADE"
            f" sparse embeddings (workflow {self.workflow}); that is picked only for a sentence-transformers"
            " SparseEncoder folder (modules.json: MLMTransformer, or a Transformer with transformer_task"
            f" 'fill-mask', then SpladePooling), and {problem}. Pass --workflow {self.workflow} to serve it as SPLADE"
            f" anyway (max over tokens of log(1 + relu(logits))); in Python: Engine.from_workflow({self.workflow!r},"
            " model)")

    def __str__(self) -> str:
        return f"{self.workflow} (with a sentence-transformers SparseEncoder config; else --workflow {self.workflow})"


@dataclass(frozen=True)
class MultiVectorIfMultiVectorEncoder:
    """Picks the late-interaction workflow for an architecture that dense embedders share (BertModel, XLM-R,
    ModernBERT) when the folder is a sentence-transformers MultiVectorEncoder or a PyLate v3 ColBERT (`model_type:
    MultiVectorEncoder` or `ColBERT` in config_sentence_transformers.json, or a MultiVectorMask in modules.json); the
    dense workflow for any other."""

    architecture: str
    dense: str
    multi_vector: str

    def __call__(self, source: "ModelSource") -> str:
        from wde.components.multi_vector_config import is_multi_vector_folder  # torch-free

        return self.multi_vector if is_multi_vector_folder(source) else self.dense

    def __str__(self) -> str:
        """What `wde plugins` lists: the dense workflow, which every folder but a MultiVectorEncoder gets."""
        return self.dense


@dataclass(frozen=True)
class MultiVectorByBackbone:
    """Picks the late-interaction workflow of a Stanford-NLP ColBERT folder (config.json: `HF_ColBERT`, which every
    backbone's checkpoint declares) by its backbone's `model_type`; any other backbone is an error naming those
    served."""

    architecture: str
    workflows: tuple[tuple[str, str], ...]
    """(model_type, workflow) pairs."""

    def __call__(self, source: "ModelSource") -> str:
        config = source.read_json("config.json") or {}
        model_type = config.get("model_type") if isinstance(config, dict) else None
        for served, workflow in self.workflows:
            if model_type == served:
                return workflow
        raise RegistryError(
            f"{source.path} declares {self.architecture} (a Stanford ColBERT checkpoint) on model_type {model_type!r};"
            f" WDE serves it on {', '.join(t for t, _ in self.workflows)} (workflows"
            f" {', '.join(sorted({w for _, w in self.workflows}))}). Pass --workflow to pick one anyway")

    def __str__(self) -> str:
        return "|".join(sorted({w for _, w in self.workflows})) + " (by the backbone's model_type)"


FOLDER_ARCHITECTURES = (
    EmbedderIfSentenceTransformers("Qwen3ForCausalLM", "qwen3_embedding", ("qwen3_reranker",),
                                   "a Qwen3-Reranker checkpoint"),
    SpladeIfSparseEncoder("BertForMaskedLM"),
    MultiVectorIfMultiVectorEncoder("BertModel", "bert", "multi_vector"),
    MultiVectorIfMultiVectorEncoder("XLMRobertaModel", "xlm_roberta", "multi_vector_xlm_roberta"),
    MultiVectorIfMultiVectorEncoder("RobertaModel", "xlm_roberta", "multi_vector_xlm_roberta"),
    MultiVectorIfMultiVectorEncoder("ModernBertModel", "modernbert", "multi_vector_modernbert"),
    MultiVectorByBackbone("HF_ColBERT", (("bert", "multi_vector"), ("xlm-roberta", "multi_vector_xlm_roberta"),
                                         ("roberta", "multi_vector_xlm_roberta"),
                                         ("modernbert", "multi_vector_modernbert"))),
)
"""Architectures whose workflow depends on the model folder's files."""


def workflows_dir() -> Path:
    """The bundled workflows: the package data `wde.workflows` (pyproject.toml maps it to the checkout's
    `workflows/`), found with `importlib.resources` in a regular or an editable install. Never a path relative to
    this file: in site-packages, `../workflows` may be another distribution's top-level package (llama-index-core
    pulls llama-index-workflows, which installs one). Only a source tree that is not installed (its root on
    sys.path, so `wde.workflows` does not import) falls back to the `workflows/` beside its `pyproject.toml`."""
    try:
        found = resources.files("wde.workflows")
    except ModuleNotFoundError:
        root = Path(wde.__file__).resolve().parents[1]
        if (root / "pyproject.toml").is_file() and (root / "workflows").is_dir():
            return root / "workflows"
        raise RegistryError("the bundled workflows (package data wde.workflows) are missing from this install"
                            f" of wde ({Path(wde.__file__).parent}); reinstall it") from None
    if isinstance(found, Path):
        return found
    # not a folder on disk as one Path (a namespace package gives a MultiplexedPath): its first folder
    return Path(next(iter(importlib.import_module("wde.workflows").__path__)))


@hookimpl
def register_workflows(register: Callable[[Path], None]) -> None:
    for path in sorted(workflows_dir().glob("*.yaml")):
        register(path)


@hookimpl
def register_architectures(register: Callable[[str, str | Callable[..., str]], None]) -> None:
    for architecture, workflow in DEFAULT_ARCHITECTURES.items():
        register(architecture, workflow)
    for rule in FOLDER_ARCHITECTURES:
        register(rule.architecture, rule)
