"""Params of the built-in components whose modules import torch, kept in a module that does not.

`wde validate`, `wde inspect` and `wde plugins` check a workflow's params against these models without importing
the components themselves (they are registered as `wde.registry.LazyComponent` references), so they start in a
fraction of a second. Each component module imports its model from here, so there is one definition of each.
Components whose modules are torch-free keep their params beside their code (tokenizer, scheduler, ...).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from wde.components.base import Params
from wde.components.image_limits import (IMAGE_FORMATS, MAX_IMAGE_ASPECT_RATIO, MAX_IMAGE_PIXELS,
                                         MAX_REQUEST_IMAGE_PIXELS)
from wde.components.input_processor import TextInputParams
from wde.components.request_processor import LazyTokenizeParams

CpuLinear = Literal["auto", "torch", "onednn"]
"""How a model's linear layers run on CPU (wde/components/models/cpu_linear.py)."""


class LoraParams(Params):
    """LoRA adapters applied per request (wde/components/lora.py, docs/adapters.md)."""

    modules: dict[str, str] = {}
    """Adapter name → PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`), loaded at start; a
    request picks one by name with the option `adapter` (`PoolingParams.options`); `none` (the default) is the base
    model. Requests for different adapters share a batch."""
    enable: bool = False
    """Make the model ready for adapters even when `modules` names none (adapters loaded at run time); on by
    itself when `modules` names any. Ready means every linear layer computes its adapters' deltas, so the CPU's
    fused linear+GELU kernels are not used (the delta is added before the activation)."""
    max_adapters: int = Field(8, ge=1, le=1024)
    """How many adapters may be loaded at once, at start and at run time together."""


class ModelParams(Params):
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """auto: float16 on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto: cuda when available, else cpu; or any torch device string."""
    cpu_linear: CpuLinear = "auto"
    """On CPU: linear layers through PyTorch (MKL) or oneDNN with prepacked weights; auto: oneDNN for float32 on
    AVX-512 hosts (about twice as fast) and for bfloat16 on native-bf16 hosts (wde/components/models/cpu_linear.py)."""
    mixed_precision: bool | Literal["auto"] = "auto"
    """With dtype bfloat16 or float16: only the linear layers (and attention and the activation on their outputs)
    run in that dtype; embeddings, norms and the residual stream stay float32, as under torch.autocast. auto: on
    for a CPU (min cosine to float32 0.99992 instead of 0.99984 on all-MiniLM-L6-v2), off elsewhere; true is CPU
    only. No effect in float32 (wde/components/models/mixed_precision.py)."""
    mixed_precision_kernels: Literal["auto", "low", "float32"] = "auto"
    """With mixed precision on: the dtype its linear layers and attention run in. low: the model's dtype; float32:
    float32 (weights too); auto: float32 for each where this CPU runs it clearly faster than the low dtype (some
    avx512_bf16 CPUs without AMX do), timed once per host on the model's shapes and cached
    (wde/components/models/cpu_kernels.py)."""
    lora: LoraParams = LoraParams()
    """Per-request LoRA adapters (docs/adapters.md); none by default."""
    quantization: Literal["none", "int8"] = "none"
    """int8: on CPU, float32 models only, the linear layers of the model's blocks run as int8 GEMMs (weights per
    output channel, activations per token) on CPUs with VNNI, or with AVX2 (weights bounded per adjacent pair);
    embeddings, norms, attention, pooler and heads stay float32. Behind a fidelity gate at load (`min_cosine`);
    refused with LoRA and on CPUs with neither (docs/int8.md)."""
    min_cosine: float = Field(0.99, gt=0, le=1)
    """With int8: the engine refuses to start when the int8 model's min cosine to float32 on the probe texts is
    below this."""
    min_mean_cosine: float = Field(0.9993, gt=0, le=1)
    """With int8: likewise for the mean cosine over the probe texts. The default keeps retrieval rankings: all-int8
    all-MiniLM-L6-v2 measures 0.99927 (Intel Xeon with AMX) and 0.99929 (Zen 5) and keeps 0.947 of the top 10 on
    word salad; the gate then keeps its first block's down projection float (AMX Xeon: 0.99933, top-10 0.960,
    2-3% slower; docs/int8.md)."""
    calibration: str | None = None
    """With int8: a file of probe texts for the fidelity gate, one a line (default: a built-in set)."""


class AttentionParams(Params):
    causal: bool | None = None
    """True: causal mask; False: bidirectional; None: what the model config states, else the model's default."""


class SentencePoolerParams(Params):
    pooling: Literal["auto", "cls", "mean", "max", "last", "weightedmean", "mean_sqrt_len", "all"] = "auto"
    """auto: read sentence-transformers' Pooling config from the model folder (its modes and include_prompt);
    a mode set here replaces that config. The modules after Pooling (Dense, LayerNorm, Normalize) always run."""
    normalize: bool | Literal["auto"] = "auto"
    """auto: true when the model's modules.json ends with a Normalize module."""


class MultiVectorPoolerParams(Params):
    normalize: bool | Literal["auto"] = "auto"
    """L2-normalize each token vector; auto: when the folder's last module is a per-token Normalize (a request's
    `normalize` overrides it)."""


class MaxSimScorerParams(Params):
    similarity: Literal["auto", "maxsim", "meanmaxsim"] = "auto"
    """How query-token maxima add up: summed (maxsim) or averaged over the query's tokens (meanmaxsim); auto: the
    pooler's `similarity_fn_name` (the folder's, as `MultiVectorEncoder.similarity` reads it)."""


class ClassifierParams(Params):
    task: Literal["auto", "score", "probs"] = "auto"
    """auto: 'score' for a single-logit model (cross-encoder / reranker), 'probs' otherwise."""
    activation: Literal["auto", "sigmoid", "softmax", "none"] = "auto"
    """Used when a request leaves `activation` unset. auto: for 'score' the sentence-transformers activation
    saved in config.json (sigmoid when none is saved); for 'probs' sigmoid on multi-label models, else softmax."""


class BGEM3PoolerParams(Params):
    normalize: bool = True
    """Default L2 normalization of dense and ColBERT vectors (a request's `normalize` overrides it)."""
    sparse_file: str = "sparse_linear.pt"
    colbert_file: str = "colbert_linear.pt"


class BGEM3OutputParams(Params):
    sparse_keys: Literal["ids", "tokens"] = "ids"
    """Key the lexical weights by token id (FlagEmbedding's `lexical_weights`) or by token string."""


class SpladePoolerParams(Params):
    pooling_strategy: Literal["auto", "max", "sum"] = "auto"
    """How each vocabulary entry's per-token weights become one: max (SPLADE v2 and later) or sum; auto: the
    folder's SpladePooling config (max when the folder has none)."""
    activation_function: Literal["auto", "relu", "log1p_relu"] = "auto"
    """Per token: log(1 + relu(logit)), or log(1 + log(1 + relu(logit))) (OpenSearch's); auto: the folder's."""
    max_active_dims: int | None = Field(None, ge=1, description=(
        "keep only the N largest weights of each input; default: config_sentence_transformers.json's"
        " max_active_dims, else all"))


class SparseOutputParams(Params):
    sparse_keys: Literal["ids", "tokens"] = "ids"
    """Key the sparse weights by token id (TEI's /embed_sparse needs ids) or by token string."""


class YesNoScorerParams(Params):
    yes_token: str = Field("yes", min_length=1, description="vocabulary token whose logit means 'relevant'")
    no_token: str = Field("no", min_length=1, description="vocabulary token whose logit means 'not relevant'")
    activation: bool = Field(True, description="default when a request leaves `activation` unset: true gives"
                                               " P(yes) in [0, 1], false the log-odds logit_yes - logit_no")


class TorchRunnerParams(Params):
    cpu_streams: int | Literal["auto"] = Field("auto", description=(
        "On CPU: split each batch of several sequences into this many pieces computed at once, each on an equal"
        " share of torch's intra-op threads (wde/components/cpu_streams.py); 1 turns it off. auto: one per"
        " thread, at most 4. Ignored on GPUs."))
    cpu_stream_min_tokens: int = Field(256, ge=1, description=(
        "On CPU: split a batch only into pieces of at least this many tokens; smaller batches run whole on every"
        " thread (below ~256 tokens a piece, Python overhead under the interpreter lock makes streams slower)."))
    cpu_stream_max_mean_tokens: int = Field(64, ge=1, description=(
        "On CPU: split only batches whose sequences average fewer tokens than this; batches of longer ones run whole"
        " on every thread, where the attention kernel and the GEMMs keep every thread busy (all-MiniLM-L6-v2, 2"
        " threads, bf16 / int8, whole against split: 207-token texts 1.03x / 1.21x, 85 tokens 1.04x / 1.11x, 55"
        " tokens 0.97x / 1.09x, 32 tokens 0.92x / 0.92x)."))

    @field_validator("cpu_streams")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("cpu_streams must be 'auto' or an integer >= 1")
        return v


class ImageTextInputParams(TextInputParams):
    """`image_text_input`: `text_input`'s params, plus the limits and options of image inputs
    (wde/components/image_input.py, docs/images.md)."""

    max_image_bytes: int = Field(20 * 2**20, gt=0, description=(
        "refuse an encoded image (file bytes; a base64 string counts its decoded size) larger than this"))
    max_image_pixels: int = Field(MAX_IMAGE_PIXELS, gt=0, description=(
        "refuse an image whose width x height exceeds this, read from its header before any pixel is decoded (a"
        " decompression bomb: a small file that decodes to gigabytes); Pillow's own guard, which refuses twice its"
        " Image.MAX_IMAGE_PIXELS, stays in force too"))
    max_image_aspect_ratio: float = Field(MAX_IMAGE_ASPECT_RATIO, ge=1, description=(
        "refuse an image whose longer side is more than this many times its shorter one, read from its header"
        " (a 1 x 100,000 strip is 125 bytes as a PNG; no model sees anything useful in it)"))
    max_request_image_pixels: int = Field(MAX_REQUEST_IMAGE_PIXELS, gt=0, description=(
        "refuse a server request whose images add up to more than this many pixels (width x height, from their"
        " headers, before any is decoded): the decoding one request can make the server do"))
    image_formats: tuple[str, ...] = Field(IMAGE_FORMATS, min_length=1, description=(
        "the file formats decoded (Pillow's names); any other is refused by name before its header is parsed"
        " (FITS, EPS, PSD, ICO, ...: formats whose decoders are slow, call out to Ghostscript, or rarely hold"
        " photos). GIF and multi-frame files give their first frame"))
    allow_local_paths: bool = Field(False, description=(
        "accept a local file path as {'image': '/path/to/file'} (wde embed turns it on; a server never should)."
        " A pathlib.Path object, which only Python code can make, is always accepted"))
    exif_transpose: bool = Field(True, description=(
        "turn a photo upright by its EXIF orientation tag first, as transformers' load_image does"))


class ImageTextRequestParams(LazyTokenizeParams):
    """`image_text`: `lazy_tokenize`'s params, plus how images are decoded and texts padded for the text tower."""

    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = Field("auto", description=(
        "threads that decode and preprocess the images the scheduler picks, at once (Pillow releases the"
        " interpreter lock while it decodes and resizes); auto: the CPU count, at most 4"))
    background_image_pixels: int = Field(4_000_000, ge=0, description=(
        "images with more pixels than this (width x height) are decoded on the scheduler's background thread, so"
        " one large photo never stalls the batches of others; 0 decodes every image with its batch"))

    pad_text: Literal["none", "max_length"] = Field("none", description=(
        "max_length: pad every text's token ids to the max length with the pad token, as SigLIP and SigLIP 2 were"
        " trained and as their processors are used (padding='max_length'), on the side the tokenizer pads (its"
        " padding_side): their text towers attend to the padding and pool the last position"))


class ProjectedPoolerParams(Params):
    normalize: bool = True
    """Default L2 normalization of the embeddings (a request's `normalize` overrides it); the model's own
    image-text similarity (CLIPModel / SiglipModel forward) normalizes both sides."""
