"""The built-in components, registered through the same hook third-party plugins use.

Each is registered as a `LazyComponent` reference ("module:Class") with its params model, which lives in a module
that imports no torch: `wde validate` / `inspect` / `plugins` resolve and check workflows without importing a
single component module (tests/test_cli_fit.py fails if one of them imports torch). A new built-in is one line
here; if its params model sits in a torch-importing module, move it to `wde/components/params.py`.
"""

from __future__ import annotations

from typing import Callable

from wde.components.base import Params
from wde.components.executor import ThreadExecutorParams
from wde.components.input_processor import TextInputParams
from wde.components.params import ImageTextInputParams, ImageTextRequestParams, ProjectedPoolerParams
from wde.components.params import (AttentionParams, BGEM3OutputParams, BGEM3PoolerParams, ClassifierParams, ModelParams,
                                   MaxSimScorerParams, MultiVectorPoolerParams, SentencePoolerParams,
                                   SparseOutputParams, SpladePoolerParams, TorchRunnerParams, YesNoScorerParams)
from wde.components.request_processor import LazyTokenizeParams
from wde.components.reranker_prompt import AffixTokenizerParams, InstructionPairParams
from wde.components.scheduler import FCFSParams
from wde.components.tokenizer import HFTokenizerParams
from wde.plugins.hookspecs import hookimpl
from wde.registry import LazyComponent

_BUILTINS: tuple[tuple[str, str, str, type[Params]], ...] = (
    # kind, name, "module:Class" under wde.components, params model (from a torch-free module)
    ("tokenizer", "hf_tokenizer", "tokenizer:HFTokenizer", HFTokenizerParams),
    ("tokenizer", "affix_tokenizer", "reranker_prompt:AffixTokenizer", AffixTokenizerParams),
    ("input_processor", "text_input", "input_processor:TextInputProcessor", TextInputParams),
    ("input_processor", "instruction_pair", "reranker_prompt:InstructionPairInput", InstructionPairParams),
    ("input_processor", "image_text_input", "image_input:ImageTextInputProcessor", ImageTextInputParams),
    ("input_processor", "multi_vector_input", "multi_vector:MultiVectorInput", TextInputParams),
    ("input_processor", "col_retrieval_input", "col_retrieval_input:ColRetrievalInput", ImageTextInputParams),
    ("request_processor", "lazy_tokenize", "request_processor:LazyTokenizeRequestProcessor", LazyTokenizeParams),
    ("request_processor", "image_text", "multimodal:ImageTextRequestProcessor", ImageTextRequestParams),
    ("request_processor", "multi_vector_tokenize", "multi_vector:MultiVectorTokenize", LazyTokenizeParams),
    ("request_processor", "col_retrieval", "col_retrieval:ColRetrievalTokenize", ImageTextRequestParams),
    ("scheduler", "fcfs", "scheduler:FCFSScheduler", FCFSParams),
    ("model_input_builder", "packed", "model_input_builder:PackedInputBuilder", Params),
    ("model_input_builder", "packed_multimodal", "multimodal:MultimodalInputBuilder", Params),
    ("model_input_builder", "multi_vector_packed", "multi_vector:MultiVectorInputBuilder", Params),
    ("model_input_builder", "col_retrieval_packed", "col_retrieval:ColRetrievalInputBuilder", Params),
    ("attention", "auto", "attention.auto:AutoBackend", AttentionParams),
    ("attention", "torch_sdpa", "attention.torch_sdpa:TorchSDPABackend", AttentionParams),
    ("attention", "cpu_varlen", "attention.cpu_varlen:CpuVarlenBackend", AttentionParams),
    ("attention", "cpu_flash_varlen", "attention.cpu_flash:CpuFlashVarlenBackend", AttentionParams),
    ("attention", "triton_varlen", "attention.triton_varlen:TritonVarlenBackend", AttentionParams),
    ("model", "bert", "models.bert:BertModel", ModelParams),
    ("model", "xlm_roberta", "models.bert:XLMRobertaModel", ModelParams),
    ("model", "qwen2", "models.qwen2:Qwen2Model", ModelParams),
    ("model", "qwen3", "models.qwen3:Qwen3Model", ModelParams),
    ("model", "llama", "models.llama:LlamaModel", ModelParams),
    ("model", "mistral", "models.llama:MistralModel", ModelParams),
    ("model", "nomic_bert", "models.rotary_encoders:NomicBertModel", ModelParams),
    ("model", "gte", "models.rotary_encoders:GteModel", ModelParams),
    ("model", "eurobert", "models.eurobert:EuroBertModel", ModelParams),
    ("model", "distilbert", "models.distilbert:DistilBertModel", ModelParams),
    ("model", "mpnet", "models.mpnet:MPNetModel", ModelParams),
    ("model", "modernbert", "models.modernbert:ModernBertModel", ModelParams),
    ("model", "jina_embeddings_v3", "models.jina_v3:JinaEmbeddingsV3Model", ModelParams),
    ("model", "clip", "models.clip:ClipModel", ModelParams),
    ("model", "siglip", "models.clip:SiglipModel", ModelParams),
    ("model", "siglip2", "models.siglip2:Siglip2Model", ModelParams),
    ("model", "gemma3", "models.gemma3:Gemma3TextModel", ModelParams),
    ("model", "bert_mlm", "models.bert_mlm:BertForMaskedLM", ModelParams),
    ("model", "deberta_v2", "models.deberta_v2:DebertaV2Model", ModelParams),
    ("model", "col_retrieval", "models.col_retrieval:ColRetrievalModel", ModelParams),
    ("pooler", "sentence", "pooler:SentencePooler", SentencePoolerParams),
    ("pooler", "projected", "multimodal:ProjectedPooler", ProjectedPoolerParams),
    ("pooler", "sentence_tokens", "token_states:SentenceTokensPooler", SentencePoolerParams),
    ("pooler", "bge_m3", "bge_m3:BGEM3Pooler", BGEM3PoolerParams),
    ("pooler", "splade", "splade:SpladePooler", SpladePoolerParams),
    ("pooler", "multi_vector", "multi_vector:MultiVectorPooler", MultiVectorPoolerParams),
    ("pooler", "col_retrieval", "col_retrieval:ColRetrievalPooler", MultiVectorPoolerParams),
    ("pooler", "classifier", "classifier:ClassifierPooler", ClassifierParams),
    ("pooler", "yes_no_score", "causal_lm_scorer:YesNoScorer", YesNoScorerParams),
    ("scorer", "cross_encoder", "scorer:CrossEncoderScorer", Params),
    ("scorer", "cosine", "scorer:CosineScorer", Params),
    ("scorer", "maxsim", "scorer:MaxSimScorer", MaxSimScorerParams),
    ("scorer", "dot", "scorer:DotScorer", Params),
    ("scorer", "euclidean", "scorer:EuclideanScorer", Params),
    ("scorer", "manhattan", "scorer:ManhattanScorer", Params),
    ("scorer", "none", "scorer:NoScorer", Params),
    ("scorer", "auto", "scorer:AutoScorer", Params),
    ("runner", "torch", "runner:TorchRunner", TorchRunnerParams),
    ("executor", "sync", "executor:SyncExecutor", Params),
    ("executor", "thread", "executor:ThreadExecutor", ThreadExecutorParams),
    ("output_processor", "embedding", "output_processor:EmbeddingOutputProcessor", Params),
    ("output_processor", "bge_m3", "bge_m3:BGEM3OutputProcessor", BGEM3OutputParams),
    ("output_processor", "sparse", "splade:SparseOutputProcessor", SparseOutputParams),
)

_BIAS, _WINDOW = "attention_bias", "attention_window"
CAPABILITIES: dict[tuple[str, str], frozenset[str]] = {
    # what a model needs from its attention backend / what a backend supports (`wde validate` checks they fit;
    # tests/test_capabilities.py checks each equals the class's uses_attention_* / supports_* flags)
    ("attention", "auto"): frozenset({_BIAS, _WINDOW}),
    ("attention", "torch_sdpa"): frozenset({_BIAS, _WINDOW}),
    ("attention", "triton_varlen"): frozenset({_BIAS, _WINDOW}),
    ("attention", "cpu_varlen"): frozenset({_WINDOW}),
    ("attention", "cpu_flash_varlen"): frozenset({_WINDOW}),
    ("model", "mpnet"): frozenset({_BIAS}),
    ("model", "modernbert"): frozenset({_WINDOW}),
    ("model", "gemma3"): frozenset({_WINDOW}),
    ("model", "deberta_v2"): frozenset({_BIAS}),
}

BUILTIN_COMPONENTS: tuple[LazyComponent, ...] = tuple(
    LazyComponent(kind, name, f"wde.components.{target}", params, CAPABILITIES.get((kind, name), frozenset()))
    for kind, name, target, params in _BUILTINS
)


@hookimpl
def register_components(register: Callable[[LazyComponent], None]) -> None:
    for component in BUILTIN_COMPONENTS:
        register(component)

