"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"}` and
`POST /v1/unload_lora_adapter` `{"lora_name"}` (docs/adapters.md).

They change the model a request's `?model=` names (the default model without one), which must have been started with
adapters enabled (`--lora-modules`, or `--set model.params.lora.enable=true`); the bound is its
`model.params.lora.max_adapters`. Like every route they are behind `--api-key` when one is set. A loaded adapter is
then a `model` requests may name (`ServedModels.pick`). With an engine core in its own process (`--api-servers N`),
the adapters are those loaded at start: these routes answer 424 there.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from wde.async_engine import AsyncEngine
from wde.errors import ModelLoadError
from wde.server.errors import ApiError
from wde.server.protocol import Body, body_schema, parse, read_json
from wde.server.service import ServedModels, Service, model_service
from wde.server.startup import StartupError

router = APIRouter()

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""What an adapter may be called: it becomes a `model` name and a key of `model.params.lora.modules`."""


def lora_module_overrides(specs: Sequence[str], model_count: int) -> list[str]:
    """`wde serve --lora-modules NAME=PATH` (repeatable) as the `--set` overrides that load them into the served
    model; one line naming the problem (a `StartupError`) for a bad spec or a server of several models."""
    if specs and model_count > 1:
        raise StartupError("--lora-modules applies to a server of one model; with several, give each its adapters"
                           " with --set MODEL:model.params.lora.modules.NAME=PATH")
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path.strip():
            raise StartupError(f"--lora-modules {spec!r}: give NAME=PATH (a PEFT adapter folder)")
        if not ADAPTER_NAME.fullmatch(name):
            raise StartupError(f"--lora-modules {spec!r}: an adapter name is letters, digits, '_' and '-'")
        out.append(f"model.params.lora.modules.{name}={json.dumps(path.strip())}")
    return out


class LoadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    """vLLM's: replace an adapter of that name that is loaded already (else that is refused)."""


class UnloadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_int_id: int | None = None
    """vLLM's numeric id; WDE names adapters only, so it is refused when given."""


def _engine(svc: Service) -> AsyncEngine:
    if not isinstance(svc.engine, AsyncEngine):
        raise ApiError("unsupported", "LoRA adapters load at run time only where the engine runs in the API server's"
                       " process (--api-servers 0); load them at start with --lora-modules")
    return svc.engine


@router.post("/v1/load_lora_adapter", openapi_extra=body_schema(LoadLoraAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = parse(LoadLoraAdapterRequest, await read_json(request))
    svc = model_service(request)
    engine = _engine(svc)
    models: ServedModels = request.app.state.models
    models.check_adapter_name(body.lora_name, lambda message: ApiError("validation", message, "lora_name"), svc)
    try:
        if body.load_inplace and body.lora_name in svc.adapters():
            await svc.off_loop(engine.engine.unload_lora_adapter, body.lora_name)
        await svc.off_loop(engine.engine.load_lora_adapter, body.lora_name, body.lora_path)
    except ModelLoadError as e:
        raise ApiError("validation", str(e), "lora_path" if "adapter " in str(e) else "lora_name") from None
    finally:
        engine.info = engine.engine.info  # what the routes read of the model: its adapters now
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=body_schema(UnloadLoraAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = parse(UnloadLoraAdapterRequest, await read_json(request))
    if body.lora_int_id is not None:
        raise ApiError("validation", "lora_int_id: WDE names adapters only; send lora_name", "lora_int_id")
    svc = model_service(request)
    engine = _engine(svc)
    if body.lora_name not in svc.adapters():
        loaded = ", ".join(svc.adapters()) or "none"
        raise ApiError("not_found", f"LoRA adapter {body.lora_name!r} is not loaded by model {svc.model_name!r};"
                       f" loaded: {loaded}", "lora_name")
    try:
        await svc.off_loop(engine.engine.unload_lora_adapter, body.lora_name)
    except ModelLoadError as e:
        raise ApiError("not_found", str(e), "lora_name") from None
    finally:
        engine.info = engine.engine.info
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
