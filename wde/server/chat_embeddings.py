"""vLLM's chat-style embedding request (`messages` on /v1/embeddings), for a two-tower image-text model.

vLLM embeds a whole conversation as one vector, rendered through the model's chat template. CLIP and SigLIP have
no chat template and no joint text-image input: their text tower embeds a text and their vision tower an image,
each on its own. So WDE takes what such a model can embed, exactly: one user message whose content is one text
(a string or a text part) or one image_url part, giving one vector, as vLLM's own CLIP and SigLIP examples send.
Everything else is refused by name rather than reinterpreted: several messages, other roles, several parts, a
text and an image together, a chat template. Batches of images go to /v2/embed `images` or /embeddings with
`modality: "image"`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wde.server.errors import ApiError
from wde.server.image_inputs import IMAGE_MODELS, check_one_part, image_inputs, require_images, text_input
from wde.server.protocol import ChatEmbeddingRequest, ImagePart, TextPart

if TYPE_CHECKING:
    from fastapi import Request

    from wde.server.service import Service

BATCH_HINT = ("for a batch, send /v2/embed with `images` (or `inputs`), or /embeddings with `modality: \"image\"`"
              " and a list of images")


async def chat_input(svc: "Service", request: "Request", body: ChatEmbeddingRequest) -> tuple[Any, str]:
    """The one engine input of a chat-style body and the name its errors go by."""
    for option in ("chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
        if getattr(body, option) is not None:
            raise ApiError("validation", f"{option} is not supported: a two-tower image-text model has no chat"
                           " template or multimodal processor options; each message part is embedded as it is",
                           option)
    if not body.messages:
        raise ApiError("empty", "messages is empty: send one user message", "messages")
    if len(body.messages) > 1:
        raise ApiError("validation", f"messages has {len(body.messages)} messages; a chat-style request gives one"
                       " vector, and a two-tower image-text model embeds one text or one image, with no chat template"
                       f" to join messages: send one user message ({BATCH_HINT})", "messages")
    message = body.messages[0]
    if message.role != "user":
        raise ApiError("validation", f"messages[0].role is {message.role!r}; send one 'user' message holding the text"
                       " or image to embed (there is no chat template, so other roles have no meaning here)",
                       "messages[0].role")
    where = "messages[0].content"
    content = message.content
    if isinstance(content, str):
        _texts_need_chat(svc)
        return text_input(content), where
    images = [i for i, p in enumerate(content) if isinstance(p, ImagePart)]
    if images:
        require_images(svc, f"{where}[{images[0]}].image_url", f"{where}[{images[0]}] is an image_url part")
    else:
        _texts_need_chat(svc)
    if not content:
        raise ApiError("empty", f"{where} is empty: send one text or one image_url part", where)
    check_one_part(where, len(images), len(content), f"one message is one vector: send one part ({BATCH_HINT})")
    part = content[0]
    if isinstance(part, TextPart):
        return text_input(part.text), f"{where}[0].text"
    name = f"{where}[0].image_url"
    (image,) = await image_inputs(svc, request, [part.image_url.url], [name], "messages")
    return image, name


def _texts_need_chat(svc: "Service") -> None:
    """Text messages are served where images are: on a text embedder, `input` is the way (no chat template)."""
    if not svc.takes_images:
        raise ApiError("unsupported", f"messages (vLLM's chat-style embedding request) is served for {IMAGE_MODELS},"
                       f" which embed one text or one image per message; workflow {svc.info.workflow!r} embeds texts:"
                       " send them as `input` (WDE applies no chat template)", "messages")
