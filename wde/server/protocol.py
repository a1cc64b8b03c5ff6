"""Request bodies of every route, as pydantic models, and `parse`, which turns a bad body into a 422 naming the field.

Unknown fields are ignored, as OpenAI, Cohere/Jina and TEI (serde) servers do. Known fields are strict: no
coercion of `true` to 1, of "yes" to true or of 1.0 to 1, so a client's mistake is an error, not a guess.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from wde.server.errors import ApiError
from wde.server.quantize import Precision

TokenIds = list[int]
EmbedInput = Union[str, list[str], TokenIds, list[TokenIds]]
TeiInput = Union[str, TokenIds, list[Union[str, TokenIds]]]
Direction = Literal["right", "left"]


class Body(BaseModel):
    """Base of every request body: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True)


def _direction(value: Any) -> Any:
    """TEI accepts Right/Left as well as right/left."""
    return value.lower() if isinstance(value, str) else value


class PromptTruncation(Body):
    """vLLM's per-request truncation (/v1/embeddings, /pooling, /score): wde/server/truncation.py reads it."""

    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """-1: truncate to the model's limit; N >= 1: to N tokens (special tokens included), at most the limit."""
    truncation_side: Direction | None = None
    """vLLM's: which end truncation cuts ("right" keeps the first tokens, the default; "left" the last)."""


class RequestOptions(Body):
    """A WDE extension on the routes that embed: the workflow's per-request options (`PoolingParams.options`)."""

    options: dict[str, str] | None = None
    """e.g. {"task": "query"} for a late-interaction model's queries; an option or value the workflow does not take
    is a 422 naming `options.NAME` (`/info`'s `options` lists what it takes)."""


class EmbeddingOptions(PromptTruncation, RequestOptions):
    """What OpenAI's /v1/embeddings takes besides the inputs, in both of its bodies (`input`, vLLM's `messages`)."""

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=0)
    """0 means every dimension, as on Infinity (infinity_client sends 0 unless told otherwise)."""
    user: str | None = None
    embed_dtype: Precision = "float32"
    """Extension (vLLM's option name): int8/uint8/binary/ubinary quantized vectors, see wde/server/quantize.py."""
    truncate: bool = False
    """Extension: truncate over-long inputs instead of rejecting them."""
    prompt_name: str | None = None
    """Extension: a named instruction prefix of the model (e.g. "query"); texts only."""
    task: str | None = None
    """Jina's: what the inputs are for ("retrieval.query", "retrieval.passage"...), the model's `task` option
    (Service.jina_task); refused by name for a model that takes none, rather than ignored."""
    embedding_type: Literal["float", "base64", "binary", "ubinary"] | None = None
    """Jina's: the vectors as floats, as base64 float32 bytes (encoding_format base64) or as packed bits
    (embed_dtype binary / ubinary); with encoding_format or embed_dtype too it is refused (openai_routes)."""
    normalized: bool | None = None
    """Jina's: unit-length vectors (true) or the pooled ones as they are (false); left out: the model's own."""


class EmbeddingRequest(EmbeddingOptions):
    """OpenAI /v1/embeddings (also Infinity's and TEI's /embeddings)."""

    input: EmbedInput
    modality: Literal["text", "image", "audio"] | None = None
    """Infinity's: "image" makes every `input` an image URL or data:image URI (for an image-text model); audio
    answers 424."""


class ImageUrl(Body):
    """OpenAI's `image_url` of a content part: a data:image URI or an http(s) URL."""

    url: str
    detail: Literal["auto"] | None = None
    """OpenAI's resolution hint for chat models; an embedder sees every image at its one input size, so only
    "auto" (the default) is accepted."""


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(Body):
    role: str
    content: Union[str, list[ContentPart]]
    name: str | None = None


class ChatEmbeddingRequest(EmbeddingOptions):
    """vLLM's chat-style /v1/embeddings body (`EmbeddingChatRequest`): one conversation, one vector. A two-tower
    image-text model (CLIP, SigLIP) embeds one user message holding one text or one image."""

    messages: list[ChatMessage]
    chat_template: str | None = None
    """vLLM's; refused when given: a two-tower model has no chat template (nor do WDE's text embedders)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's; refused when given, as `chat_template`."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's; refused when given: images are preprocessed exactly as the model's preprocessor_config.json says."""


PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"]
"""vLLM's pooling tasks; wde/server/openai_routes.py serves the first three and refuses the others by name."""


class PoolingRequest(PromptTruncation, RequestOptions):
    """/pooling in vLLM's shape: `data[i].data` holds the `task`'s output; `outputs` (extension) adds WDE outputs
    (sparse, colbert...) under their own names."""

    input: EmbedInput
    model: str | None = None
    task: PoolingTask | None = None
    input_type: Literal["query", "document"] | None = None
    """Whether the inputs are queries or documents, for a model whose workflow takes the `task` option (late
    interaction: `options.task`); refused by name where it takes none."""
    modality: Literal["text", "image"] | None = None
    """Infinity's, as on /embeddings: "image" makes every `input` an image URL or data:image URI (a page-image
    model's token vectors: wde/server/image_sides.py)."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each output's bytes (`wde.server.responses.encode_array`: row-major, `embed_dtype`, `endianness`)
    with its `shape` beside them; vLLM's `bytes` (a binary body) is refused by name."""
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """vLLM's element type of base64 outputs; fp8 is refused by name, and so is anything but float32 with
    `encoding_format: float` (JSON numbers: vLLM ignores it there)."""
    endianness: Literal["native", "little", "big"] = "native"
    """vLLM's byte order of base64 outputs: `native` is the server's own (little-endian on x86 and ARM)."""
    use_activation: bool | None = None
    """vLLM's: false gives the embedding unnormalized, or a classifier's / cross-encoder's logits."""
    outputs: list[str] | None = None
    truncate: bool = False
    truncation_direction: Direction = "right"
    normalize: bool | None = None
    prompt_name: str | None = None
    dimensions: int | None = Field(None, gt=0)

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class Document(Body):
    text: str


class RerankRequest(Body):
    """Cohere/Jina/vLLM rerank."""

    query: str
    documents: list[Union[str, Document]]
    model: str | None = None
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate: bool = False
    raw_scores: bool = False


class TeiRerankRequest(Body):
    """TEI /rerank."""

    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False
    return_text: bool = False

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class ScoreContent(Body):
    """vLLM's multimodal score side (`ScoreMultiModalParam`): each image_url part is one input of the side."""

    content: list[ContentPart]


ScoreSide = Union[str, list[str], ScoreContent]


class ScoreRequest(PromptTruncation):
    """vLLM /score: one pair of sides, each a text or a list (1:1, 1:N, N:N), under any of vLLM's field pairs:
    `queries`/`documents`, `queries`/`items`, `data_1`/`data_2` or `text_1`/`text_2` (score_routes.py picks)."""

    text_1: ScoreSide | None = None
    text_2: ScoreSide | None = None
    data_1: ScoreSide | None = None
    data_2: ScoreSide | None = None
    queries: ScoreSide | None = None
    documents: ScoreSide | None = None
    items: ScoreSide | None = None
    model: str | None = None
    truncate: bool = False
    raw_scores: bool = False
    use_activation: bool | None = None
    """vLLM's: false gives logits, as `raw_scores: true`."""


class ClassifyRequest(Body):
    """vLLM /classify."""

    input: Union[str, list[str]]
    model: str | None = None
    truncate: bool = False


class InfinityClassifyRequest(Body):
    """Infinity /classify (infinity_client always sends `raw_scores`, which tells it from vLLM's body)."""

    input: Union[str, list[str]]
    model: str | None = None
    raw_scores: bool = False
    truncate: bool = False
    """Extension, as on vLLM's /classify."""


class TeiEmbedRequest(RequestOptions):
    """TEI /embed."""

    inputs: TeiInput
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    normalize: bool = True
    dimensions: int | None = Field(None, gt=0)
    embed_dtype: Precision = "float32"
    """Extension, as on /v1/embeddings: quantized vectors."""
    encoding_format: Literal["float", "base64"] = "float"
    """Extension, as on /v1/embeddings: base64 of each vector's bytes instead of a JSON array."""

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class TeiSparseRequest(Body):
    """TEI /embed_sparse."""

    inputs: TeiInput
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class PredictParameters(Body):
    """The Hugging Face Inference API's text-classification `parameters` (huggingface_hub's InferenceClient)."""

    top_k: int | None = Field(None, gt=0)
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None


class TeiPredictRequest(Body):
    """TEI /predict: a text, a [text, text_pair] pair, or a batch of [text] / [text, text_pair] lists."""

    inputs: Union[str, list[str], list[list[str]]]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False
    parameters: PredictParameters | None = None
    """Extension: the Hugging Face Inference API's `top_k` and `function_to_apply`; a body carrying it gets that
    API's answer for a single input (a list holding its one list of predictions)."""

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class TeiTokenizeRequest(Body):
    """TEI /tokenize."""

    inputs: Union[str, list[str]]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class TeiEmbedAllRequest(RequestOptions):
    """TEI /embed_all: every token's final hidden state."""

    inputs: TeiInput
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class SimilarityInputs(Body):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(Body):
    """TEI's /similarity `parameters` (where TEI reads them; the same names at the top level also work)."""

    truncate: bool | None = None
    truncation_direction: Direction | None = None
    prompt_name: str | None = None

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class TeiSimilarityRequest(Body):
    """TEI /similarity: cosine similarity of `source_sentence` with each of `sentences`."""

    inputs: SimilarityInputs
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    parameters: SimilarityParameters | None = None

    _direction = field_validator("truncation_direction", mode="before")(_direction)


class TeiDecodeRequest(Body):
    """TEI /decode: token ids back to text."""

    ids: Union[TokenIds, list[TokenIds]]
    skip_special_tokens: bool = True


CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereText(Body):
    type: Literal["text"]
    text: str


class CohereImageUrl(Body):
    url: str
    """A data:image URI, or an http(s) URL on a host the server fetches from (--allow-image-fetch)."""


class CohereImage(Body):
    type: Literal["image_url"]
    image_url: CohereImageUrl


class CohereInput(Body):
    content: list[Annotated[Union[CohereText, CohereImage], Field(discriminator="type")]]


class CohereEmbedRequest(Body):
    """Cohere v2 /v2/embed."""

    model: str | None = None
    input_type: str | None = None
    """search_query / search_document / classification / clustering, mapped to the workflow's prompts (of texts);
    "image" for images (Cohere's v3 models require it with `images`)."""
    texts: list[str] | None = None
    images: list[str] | None = None
    """data:image URIs (or, with --allow-image-fetch, http(s) URLs) for an image-text model."""
    inputs: list[CohereInput] | None = None
    max_tokens: int | None = Field(None, gt=0)
    output_dimension: int | None = Field(None, gt=0)
    embedding_types: list[CohereEmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] | None = None
    """Left out: Cohere's default, END, unless the server embeds long inputs in chunks (--long-inputs chunk)."""
    priority: int | None = None
    """Accepted and ignored: requests are served first come, first served."""


class CohereRerankRequest(RerankRequest):
    """Cohere v2 / vLLM /v2/rerank: the /v1/rerank body plus Cohere's per-document token cap."""

    max_tokens_per_doc: int | None = Field(None, gt=0)
    priority: int | None = None


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: Any) -> M:
    """Validate a JSON body; a bad one becomes `ApiError("validation")` naming each bad field."""
    if not isinstance(body, dict):
        raise ApiError("validation", f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        problems = []
        fields = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"] if not _is_union_tag(x))
            fields.append(loc)
            problems.append(f"{loc}: {err['msg']}")
        raise ApiError("validation", "invalid request: " + "; ".join(dict.fromkeys(problems)),
                       fields[0] if fields else None) from None


def _is_union_tag(part: Any) -> bool:
    """Pydantic names union members in error locations (`input.str`, `input.list[int]`); hide them."""
    return isinstance(part, str) and (part in {"str", "int"} or part[:1].isupper()
                                      or part.startswith(("list[", "function-", "union[")))


async def read_json(request: Request) -> Any:
    """The request body as JSON; malformed or too deeply nested JSON is a 400 (it never reached validation)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError("bad_json", f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("bad_json", "the request body is nested too deeply to be a request") from None


def _is_one_input(value: Any) -> bool:
    """OpenAI/TEI `input(s)` holding a single input: one text or one token-id list."""
    return isinstance(value, str) or bool(value) and all(isinstance(x, int) for x in value)


def item_names(field: str, value: Any) -> list[str]:
    """How errors name the inputs of `field`: the field itself for one text (or one token-id list), else
    `field[i]` (a list of one text included, so the name points at the element that is wrong)."""
    return [field] if _is_one_input(value) else [f"{field}[{i}]" for i in range(len(value))]


def embed_items(value: Any) -> list[Any]:
    """OpenAI/TEI `input(s)`: one text, token ids, or a list of either, as a list of engine inputs."""
    if _is_one_input(value):
        return [value if isinstance(value, str) else {"token_ids": list(value)}]
    return [x if isinstance(x, str) else {"token_ids": list(x)} for x in value]


def body_schema(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route that reads its body itself: the spec describes the JSON body of `models`.

    Routes parse with `read_json` + `parse` (so every error has our shape), which FastAPI cannot see; this puts
    the models' JSON Schema into /openapi.json, for clients and fuzzers. Pydantic's `$defs` are inlined, as the
    operation cannot add to `components`; several models (one route, two shapes) become an `anyOf`.
    """
    schemas = [_inline_defs(model.model_json_schema()) for model in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each `{"$ref": "#/$defs/X"}` replaced by X itself (request models are not recursive)."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(x, seen) for x in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref[len("#/$defs/"):]
            if name in seen:
                raise ValueError(f"recursive request model {name} cannot be inlined")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**resolve(defs[name], seen + (name,)), **resolve(rest, seen)}
        return {k: resolve(v, seen) for k, v in node.items()}

    return resolve(schema, ())


class VertexRequest(Body):
    """TEI's /vertex (Vertex AI custom containers): each instance is one TEI request body of the model's task."""

    instances: list[dict[str, Any]]


class VllmTokenizeRequest(Body):
    """vLLM's /tokenize completion form. (Its chat form, `messages`, needs a chat template, which WDE's prefill-only
    models do not have: refused by name in wde/server/vllm_tokenize.py.)"""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class VllmDetokenizeRequest(Body):
    """vLLM's /detokenize: one token-id list back to its text, special tokens kept (vLLM decodes them)."""

    model: str | None = None
    tokens: TokenIds
