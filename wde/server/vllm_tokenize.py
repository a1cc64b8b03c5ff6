"""vLLM's /tokenize and /detokenize bodies, served on the paths TEI's /tokenize shares with them.

`POST /tokenize` is TEI's route too: the body's keys decide which API is meant (TEI's `inputs`, vLLM's `prompt`
or `messages`), so a client of either moves by changing the URL. vLLM answers errors in OpenAI's shape, so a
vLLM body gets those; a TEI body keeps TEI's.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from wde.server.errors import ApiError
from wde.server.protocol import VllmDetokenizeRequest, VllmTokenizeRequest, parse
from wde.server.responses import JSONResponse
from wde.server.service import model_service

VLLM_KEYS = ("prompt", "messages")
"""Body keys that mark vLLM's /tokenize; TEI's is `inputs`."""


def is_vllm_body(raw: Any) -> bool:
    """Whether a /tokenize body is vLLM's; a body naming both APIs' input fields is a 422 naming them."""
    if not isinstance(raw, dict):
        return False
    vllm = [k for k in VLLM_KEYS if k in raw]
    if vllm and "inputs" in raw:
        named = " and ".join(f"`{k}`" for k in vllm)
        raise ApiError("validation", f"the body has both `inputs` (TEI's /tokenize) and {named} (vLLM's /tokenize):"
                       " send one of them", "inputs")
    return bool(vllm)


async def tokenize(request: Request, raw: dict[str, Any], limit: int) -> JSONResponse:
    """vLLM's answer: `{count, max_model_len, tokens, token_strs}` for one prompt of the model the body names, at
    most `limit` tokens (or the model's own limit, where it is higher)."""
    request.state.error_style = "openai"
    if "messages" in raw:
        raise ApiError("validation", "messages (vLLM's chat /tokenize) is not supported: it renders the messages"
                       " through a chat template, which WDE's prefill-only models do not have; send the text as"
                       " `prompt`", "messages")
    body = parse(VllmTokenizeRequest, raw)
    svc = model_service(request, body.model)
    limit = max(limit, svc.info.max_length)
    component = svc.hf_tokenizer()
    svc.check_texts([body.prompt], ["prompt"])
    ids, strs = await svc.off_loop(_encode, component, body.prompt, body.add_special_tokens,
                                   bool(body.return_token_strs))
    if len(ids) > limit:
        raise ApiError("validation", f"prompt: /tokenize answers at most {limit:,} tokens per request and this"
                       f" prompt has {len(ids):,}; send a shorter prompt", "prompt")
    return JSONResponse({"count": len(ids), "max_model_len": svc.info.max_length, "tokens": ids,
                         "token_strs": strs})


def _encode(component: Any, prompt: str, add_special_tokens: bool, strs: bool) -> tuple[list[int], list[str] | None]:
    tokenizer = component.hf_tokenizer  # this thread's own copy
    ids = tokenizer(prompt, add_special_tokens=add_special_tokens, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]
    return ids, tokenizer.convert_ids_to_tokens(ids) if strs else None


async def detokenize(request: Request, raw: Any) -> JSONResponse:
    """vLLM's `{"tokens": [...]}` to `{"prompt": text}`, decoded as vLLM does (special tokens kept), by the model
    the body names."""
    body = parse(VllmDetokenizeRequest, raw)
    svc = model_service(request, body.model)
    svc.hf_tokenizer()  # 'unsupported' before 'empty', as /tokenize refuses
    if not body.tokens:
        raise ApiError("empty", "tokens is empty: send at least one token id", "tokens")
    (text,) = await svc.decode([body.tokens], skip_special_tokens=False, names=["tokens"])
    return JSONResponse({"prompt": text})

