"""Messages between API servers and the engine core: msgpack through msgspec, arrays as raw bytes.

An API server sends `Submit` (tokenized texts), `SubmitImages` (images it decoded and preprocessed: their pixel
values) and `Abort`; the core answers with `Results`; the launcher sends `Gone` when an API server process died.
A numpy array of any dtype and shape travels as a msgpack extension (dtype, shape, bytes) and is read back without
a copy, never as a float list: a CLIP 224 px image is 3 x 224 x 224 float32 values, 602,112 bytes plus a header of
a few dozen. Images have a message of their own so that a text's bytes on the wire are what they were before
images existed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from wde.errors import RequestError
from wde.request import PoolingParams, RequestOutput

_ARRAY = 1
"""msgpack extension code of a numpy array."""


class Admitted(msgspec.Struct, array_like=True):
    """One request, validated and tokenized by the API server."""

    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None
    params: PoolingParams


class Submit(msgspec.Struct, tag=True, array_like=True):
    requests: list[Admitted]


class AdmittedImage(msgspec.Struct, array_like=True):
    """One image request, decoded and preprocessed by the API server: the core only checks the array's dtype and
    shape against its model (`ImageTextInputProcessor.image_prompt`). Any shape travels (CLIP and SigLIP send
    [3, height, width]; a variable-resolution model its own layout), with its vision-tower length."""

    request_id: str
    pixel_values: np.ndarray
    image_tokens: int
    params: PoolingParams


class SubmitImages(msgspec.Struct, tag=True, array_like=True):
    requests: list[AdmittedImage]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Gone(msgspec.Struct, tag=True, array_like=True):
    """From the launcher: the API server with this ZeroMQ routing id died; the core drops what it asked for (no one
    waits for those answers: their connections died with the process) and ignores its messages still in flight."""

    routing_id: bytes


class Output(msgspec.Struct, array_like=True):
    request_id: str
    outputs: dict[str, Any]
    num_prompt_tokens: int
    error: tuple[str, str | None, str] | None
    """(message, field, kind) of a `RequestError`."""
    queue_time: float
    tokenization_time: float
    inference_time: float


class Results(msgspec.Struct, tag=True, array_like=True):
    outputs: list[Output]
    failure: str | None = None
    """Set when the core failed every listed request at once (its loop restarted): the reason, for a 503."""


ToCore = Submit | SubmitImages | Abort | Gone


def _enc_hook(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:  # (not `ascontiguousarray`: it makes a 0-d array 1-d)
            value = value.copy(order="C")
        header = msgspec.msgpack.encode((value.dtype.str, value.shape))
        head = len(header).to_bytes(4, "little") + header
        data = bytearray(len(head) + value.nbytes)  # one copy of the values here, one into the message
        data[:len(head)] = head
        data[len(head):] = memoryview(value.reshape(-1)).cast("B")
        return msgspec.msgpack.Ext(_ARRAY, data)
    if isinstance(value, np.generic):
        return value.item()
    raise NotImplementedError(f"cannot send {type(value).__name__} to or from the engine core")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _ARRAY:
        raise ValueError(f"unknown msgpack extension {code}")
    size = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4:4 + size])
    return np.frombuffer(data[4 + size:], dtype=np.dtype(dtype)).reshape(tuple(shape))


def _dec_hook(kind: type, value: Any) -> Any:
    """A field typed `np.ndarray` takes only what `_ext_hook` made of an array extension."""
    if kind is np.ndarray and isinstance(value, np.ndarray):
        return value
    raise TypeError(f"expected a numpy array extension, got {type(value).__name__}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
to_core = msgspec.msgpack.Decoder(ToCore, ext_hook=_ext_hook, dec_hook=_dec_hook)
from_core = msgspec.msgpack.Decoder(Results, ext_hook=_ext_hook)


def pack_output(out: RequestOutput) -> Output:
    error = None if out.error is None else (str(out.error), out.error.field, out.error.kind)
    return Output(out.request_id, out.outputs, out.num_prompt_tokens, error, out.queue_time, out.tokenization_time,
                  out.inference_time)


def unpack_output(out: Output, token_ids: list[int] | None) -> RequestOutput:
    error = None if out.error is None else RequestError(out.error[0], out.error[1], out.error[2])  # type: ignore[arg-type]
    return RequestOutput(out.request_id, out.outputs, out.num_prompt_tokens, error, token_ids,
                         queue_time=out.queue_time, tokenization_time=out.tokenization_time,
                         inference_time=out.inference_time)
