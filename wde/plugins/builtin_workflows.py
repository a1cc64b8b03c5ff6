"""The bundled workflows (`workflows/*.yaml`) and the architectures they serve by default."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from wde.plugins.hookspecs import hookimpl

DEFAULT_ARCHITECTURES: dict[str, str] = {
    "BertModel": "bert",
    "XLMRobertaModel": "xlm_roberta",
    "RobertaModel": "xlm_roberta",
    "BertForSequenceClassification": "sequence_classification",
    "XLMRobertaForSequenceClassification": "xlm_roberta_sequence_classification",
    "RobertaForSequenceClassification": "xlm_roberta_sequence_classification",
    "Qwen2Model": "gte_qwen2",
    "Qwen2ForCausalLM": "gte_qwen2",
    "MistralModel": "e5_mistral",
    "MistralForCausalLM": "e5_mistral",
    "LlamaModel": "decoder_features",
    "LlamaForCausalLM": "decoder_features",
}


def workflows_dir() -> Path:
    """`workflows/` of a source checkout, or the copy installed as package data `wde.workflows`."""
    here = Path(__file__).resolve()
    checkout = here.parents[2] / "workflows"
    return checkout if checkout.is_dir() else here.parents[1] / "workflows"


@hookimpl
def register_workflows(register: Callable[[Path], None]) -> None:
    for path in sorted(workflows_dir().glob("*.yaml")):
        register(path)


@hookimpl
def register_architectures(register: Callable[[str, str], None]) -> None:
    for architecture, workflow in DEFAULT_ARCHITECTURES.items():
        register(architecture, workflow)
