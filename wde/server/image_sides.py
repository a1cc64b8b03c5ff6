"""Images on the routes that return token vectors and scores, for a model that embeds page images (ColPali,
ColQwen2; docs/images.md "Page retrieval"):

- vLLM's /pooling with Infinity's `modality: "image"` (as /embeddings takes it): every `input` is an image URL or
  a data:image URI, so `task: "token_embed"` gives a page's token vectors;
- /score and /v1/score with a side in vLLM's multimodal shape, `{"content": [{"type": "image_url", "image_url":
  {"url": ...}}, ...]}`: each image_url part is one input of that side (a text query scored against page images).

Image references are resolved as every image route resolves them (wde/server/image_inputs.py: data URIs as they
are, URLs fetched only from --allow-image-fetch hosts), and a model that embeds texts only answers 424 naming the
field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wde.server.errors import ApiError
from wde.server.image_inputs import image_inputs, require_images
from wde.server.protocol import ImagePart, PoolingRequest, ScoreContent, ScoreRequest, embed_items, item_names

if TYPE_CHECKING:
    from fastapi import Request

    from wde.server.service import Service


async def pooling_inputs(svc: "Service", request: "Request", body: PoolingRequest) -> tuple[list[Any], bool]:
    """(the engine inputs of a /pooling body, whether they are images): texts or token ids as they are; with
    `modality: "image"` each input an image reference."""
    if body.modality != "image":
        return embed_items(body.input), False
    require_images(svc, "modality", "modality 'image'")
    values = [body.input] if isinstance(body.input, str) else list(body.input)
    if not all(isinstance(v, str) for v in values):
        raise ApiError("validation", "input: with modality 'image' it is an image URL or data:image URI, or a list"
                       " of them, not token ids", "input")
    if body.prompt_name is not None:
        raise ApiError("validation", "prompt_name applies to texts, and with modality 'image' every input is an"
                       " image; leave it out", "prompt_name")
    return await image_inputs(svc, request, values, item_names("input", body.input), "input"), True


async def score_images(svc: "Service", request: "Request", body: ScoreRequest,
                       sides: tuple[str, str]) -> tuple[ScoreRequest, bool]:
    """`body` with each side given as `{"content": [...]}` replaced by the list of its images' engine inputs, and
    whether there were any. Only image_url parts are taken there: texts are sent as strings."""
    update: dict[str, list[Any]] = {}
    for field in sides:
        side = getattr(body, field)
        if not isinstance(side, ScoreContent):
            continue
        names = [f"{field}.content[{i}]" for i in range(len(side.content))]
        texts = [n for n, part in zip(names, side.content) if not isinstance(part, ImagePart)]
        if texts:
            raise ApiError("validation", f"{texts[0]} is a text part; {field}.content carries image_url parts (send"
                           f" texts as a string or a list of strings)", texts[0])
        if not side.content:
            raise ApiError("empty", f"{field}.content is empty: send at least one image_url part", field)
        require_images(svc, f"{field}.content", f"{field}.content (image_url parts)")
        values = [part.image_url.url for part in side.content]  # type: ignore[union-attr]
        update[field] = await image_inputs(svc, request, values, [f"{n}.image_url" for n in names], field)
    return (body.model_copy(update=update) if update else body), bool(update)
