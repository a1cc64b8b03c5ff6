"""Image inputs for two-tower embedders (CLIP, SigLIP, SigLIP 2 NaFlex): what counts as an image, decoding it
safely, and turning it into the model's pixel values exactly as its image processor would.

Admission (`Engine.make_request`) only checks an image: its byte size, its base64, its first bytes (a format in
`image_formats`) and its header (width x height and aspect ratio within the limits, a supported mode;
wde/components/image_limits.py). Decoding and preprocessing come later: offline, when the scheduler picks the
request, as tokenization does for texts (the `image_text` request processor calls
`ImageTextInputProcessor.preprocess` on its worker threads, large images on the scheduler's background thread);
served, before the call enters the engine (wde/components/image_decode.py, or an API server in split mode). The
model step only sees finished float32 arrays. Nothing here imports torch.

Preprocessing follows the model folder's `preprocessor_config.json`, read by transformers itself (so legacy keys
such as `"size": 224` mean what they mean there), and reproduces transformers' PIL backend step by step: convert
to RGB (transparency composited onto white), resize with Pillow's filter, center crop, rescale in float64 then
float32, normalize in float32. The result equals `AutoImageProcessor.from_pretrained(folder, backend="pil")` bit
for bit (tests/test_clip_siglip.py). transformers' torchvision backend (its default when torchvision is installed)
resizes with torch's antialiased bicubic and differs from both by a few intensity levels here and there. A NaFlex
processor (`Siglip2ImageProcessor`) keeps each image's aspect ratio and cuts it into a patch grid whose size varies
per image (wde/components/naflex.py); admission then computes each image's length from its header.

An image request refused here raises `RequestError` naming the input, with kind "bad_image" (not an image, a
format outside the allow-list, truncated or corrupt, an unsupported mode, an image URL) or "image_too_large" (over
the byte, pixel or aspect-ratio limit, or a request's images over its pixel budget).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import sys
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from wde.components.base import BuildContext
from wde.components.image_limits import (BAD_IMAGE, TOO_LARGE, check_formats, check_request_pixels, check_size,
                                         open_image)
from wde.components.input_processor import InputName, TextInputProcessor
from wde.components.params import ImageTextInputParams
from wde.errors import ModelLoadError, RequestError, one_line
from wde.request import ImagePrompt, PoolingParams, Prompt, Request

if TYPE_CHECKING:
    from wde.components.naflex import NaFlexPreprocessor


SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV",
                             "I;16", "I;16L", "I;16B", "I;16N"})
"""Pillow modes an image may decode to. Refused: 32-bit integer ("I") and floating-point ("F") images, whose values
have no agreed mapping to 8-bit RGB (Pillow would clip them), and modes Pillow cannot convert to RGB ("La", ...).
16-bit images ("I;16") convert as transformers converts them: Pillow clips each value to 255."""

_DATA_URI = re.compile(r"data:image/[A-Za-z0-9.+-]+((?:;[A-Za-z0-9=._+-]+)*?)(;base64)?,", re.IGNORECASE)

CLASS_TOKENS: dict[str, int] = {"clip": 1, "siglip": 0}
"""Tokens a vision tower adds to an image's patches, by config `model_type` (CLIP's class token; SigLIP has none)."""

NAFLEX_MODELS = ("siglip2",)
"""Config `model_type`s whose vision tower takes NaFlex patch grids of any shape (wde/components/naflex.py)."""

_PROCESSORS = ("CLIPImageProcessor", "CLIPFeatureExtractor", "SiglipImageProcessor")
"""Image processor classes (with or without their Fast / Pil suffix) whose pipeline `ImagePreprocessor` implements."""


CROP_FIRST_AREA = 16
"""An image whose resized size would be over this many times its center crop's area (more elongated than 16:1 when
CLIP resizes its short edge to the crop's side) is resized only in the region the crop keeps (Pillow's `resize`
with a `box`), so the work and memory stay those of the crop whatever the aspect ratio: transformers resizes all
of it first (224 x 2,240,000 pixels, 1.5 GB, for a 1 x 10,000 strip). Its pixels can then differ from
transformers' by a few intensity levels (Pillow's filter starts from another origin); every image within the
factor is resized as transformers resizes it, to the bit."""


def _pil() -> Any:
    from PIL import Image

    return Image


def is_image(value: Any) -> bool:
    """Whether an input is an image (see docs/images.md for the shapes): bytes, a PIL image, a path object, a
    `data:image/...` URI string, a mapping with an "image" key, or an already prepared `ImagePrompt`."""
    if isinstance(value, (bytes, bytearray, memoryview, PurePath, ImagePrompt)):
        return True
    if isinstance(value, str):
        return value[:11].lower() == "data:image/"
    if isinstance(value, Mapping):
        return "image" in value
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)


@dataclass(frozen=True)
class ImagePreprocessor:
    """One model's image pipeline, read from its `preprocessor_config.json` (`from_source`); `__call__` turns a
    decoded PIL image into float32 pixel values [3, height, width]. Pure Pillow and numpy: thread-safe."""

    kind: str
    do_resize: bool
    size: tuple[tuple[str, int], ...]
    resample: int
    do_center_crop: bool
    crop_size: tuple[int, int] | None
    values: ValueSteps

    @classmethod
    def from_source(cls, source: Any) -> "ImagePreprocessor":
        name, proc, where = load_image_processor(source)
        if name not in _PROCESSORS:
            raise ModelLoadError(f"{where}: image processor {type(proc).__name__} is not one WDE reproduces with a"
                                 f" fixed output size ({', '.join(_PROCESSORS)})")
        return cls.from_processor(name, proc, where)

    @classmethod
    def from_processor(cls, name: str, proc: Any, where: Any) -> "ImagePreprocessor":
        """The pipeline of transformers' image processor `proc` (class `name`, read from `where`)."""
        if getattr(proc, "do_pad", None):
            raise ModelLoadError(f"{where}: do_pad is set, which {name} pipelines in WDE do not do")
        size = _size_dict(getattr(proc, "size", None))
        if set(size) not in ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}):
            raise ModelLoadError(f"{where}: size {size} is not a {{height, width}} or {{shortest_edge}} size")
        crop = _size_dict(getattr(proc, "crop_size", None)) if getattr(proc, "do_center_crop", False) else None
        if crop is not None and set(crop) != {"height", "width"}:
            raise ModelLoadError(f"{where}: crop_size {crop} must give height and width")
        resample = getattr(proc, "resample", 3)
        try:
            resample = int(resample if resample is not None else 2)
        except (TypeError, ValueError):
            raise ModelLoadError(f"{where}: resample {resample!r} is not a Pillow resampling filter") from None
        pre = cls(name, bool(getattr(proc, "do_resize", False)), tuple(sorted(size.items())), resample,
                  crop is not None, (crop["height"], crop["width"]) if crop else None, ValueSteps.from_processor(proc, where))
        if pre.output_size is None:
            raise ModelLoadError(f"{where}: its images come out in sizes that depend on the input (resize to"
                                 " shortest_edge without a center crop); the model needs one size")
        return pre

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every preprocessed image, or None when it depends on the input."""
        if self.crop_size is not None:
            return self.crop_size
        size = dict(self.size)
        if self.do_resize and "height" in size:
            return size["height"], size["width"]
        return None

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to: transformers' rules, to the pixel."""
        size = dict(self.size)
        if "height" in size:
            return size["height"], size["width"]
        short_edge = size["shortest_edge"]
        if "longest_edge" in size:  # transformers' get_size_with_aspect_ratio
            longest, raw = size["longest_edge"], None
            lo, hi = float(min(height, width)), float(max(height, width))
            if hi / lo * short_edge > longest:
                raw = longest * lo / hi
                short_edge = int(round(raw))
            if (height <= width and height == short_edge) or (width <= height and width == short_edge):
                return height, width
            if width < height:
                return (int(raw * height / width) if raw is not None else int(short_edge * height / width)), short_edge
            return short_edge, (int(raw * width / height) if raw is not None else int(short_edge * width / height))
        short, long = (width, height) if width <= height else (height, width)  # get_resize_output_image_size
        new_short, new_long = short_edge, int(short_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def kept_region(self, height: int, width: int) -> tuple[int, int, int, int] | None:
        """(left, top, right, bottom), in the resized image's pixels, of what the center crop keeps of an image
        resized to height x width, when that image would be over `CROP_FIRST_AREA` times the crop's area; else
        None (resize all of it, then crop, as transformers does)."""
        if self.crop_size is None:
            return None
        crop_h, crop_w = self.crop_size
        if height * width <= CROP_FIRST_AREA * crop_h * crop_w:
            return None
        top, left = max(0, (height - crop_h) // 2), max(0, (width - crop_w) // 2)
        return left, top, min(width, left + crop_w), min(height, top + crop_h)

    def __call__(self, image: Any) -> np.ndarray:
        image = to_rgb(image)
        if self.do_resize:
            height, width = self.resized_size(image.height, image.width)
            kept = self.kept_region(height, width)
            if kept is None:
                image = image.resize((width, height), resample=self.resample)
            else:  # an elongated image: resize only the part the crop keeps, never the whole strip
                left, top, right, bottom = kept
                sx, sy = image.width / width, image.height / height
                image = image.resize((right - left, bottom - top), resample=self.resample,
                                     box=(left * sx, top * sy, right * sx, bottom * sy))
        pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
        if self.crop_size is not None:
            pixels = center_crop(pixels, self.crop_size)
        return np.ascontiguousarray(self.values(pixels), dtype=np.float32)


@dataclass(frozen=True)
class ValueSteps:
    """The value steps every image pipeline ends with: an image processor's `do_rescale`, `rescale_factor`,
    `do_normalize`, `image_mean` and `image_std`; `__call__` applies them to a [C, H, W] array."""

    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_processor(cls, proc: Any, where: Any) -> "ValueSteps":
        """`proc`'s settings; a mean or std without one value per RGB channel is refused."""
        mean, std = getattr(proc, "image_mean", None), getattr(proc, "image_std", None)
        do_normalize = bool(getattr(proc, "do_normalize", False))
        if do_normalize and (not _three(mean) or not _three(std)):
            raise ModelLoadError(f"{where}: image_mean and image_std must have one value per RGB channel")
        return cls(bool(getattr(proc, "do_rescale", False)), float(getattr(proc, "rescale_factor", 1 / 255)),
                   do_normalize, tuple(float(x) for x in mean or ()), tuple(float(x) for x in std or ()))

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return rescale_normalize(pixels, self.rescale_factor if self.do_rescale else None,
                                 (self.image_mean, self.image_std) if self.do_normalize else None)


def rescale_normalize(pixels: np.ndarray, rescale_factor: float | None,
                      mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None) -> np.ndarray:
    """transformers' PIL-backend `rescale` (in float64, then float32) and `normalize` (in float32) of a [C, H, W]
    array, operation for operation, so the result is theirs to the bit."""
    if rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    elif not np.issubdtype(pixels.dtype, np.floating):
        pixels = pixels.astype(np.float32)
    if mean_std is not None:
        mean = np.array(mean_std[0], dtype=pixels.dtype)
        std = np.array(mean_std[1], dtype=pixels.dtype)
        pixels = ((pixels.T - mean) / std).T
    return pixels


def image_processor_file(source: Any) -> Any:
    """The file of a model folder that holds its image processor's settings, with transformers' precedence
    (`ImageProcessingMixin.get_image_processor_dict`): `processor_config.json` when it nests them under
    "image_processor" (how transformers 5 saves a whole processor: `CLIPProcessor.save_pretrained`), else
    `preprocessor_config.json` (how transformers 4 saved it, and how an image processor alone is saved)."""
    nested = source.read_json("processor_config.json")
    if isinstance(nested, Mapping) and isinstance(nested.get("image_processor"), Mapping):
        return source.path / "processor_config.json"
    if source.read_json("preprocessor_config.json") is not None:
        return source.path / "preprocessor_config.json"
    raise ModelLoadError(f"{source.path} has neither a preprocessor_config.json nor a processor_config.json with an"
                         " \"image_processor\" entry: an image-text workflow preprocesses images exactly as the"
                         " model's image processor says, so its settings must be there (save_pretrained the model's"
                         " image processor or processor into the folder)")


def load_image_processor(source: Any) -> tuple[str, Any, Any]:
    """(class name without its Pil / Fast suffix, transformers' PIL-backend image processor, its config path) of a
    model folder: read by transformers itself, so legacy keys mean what they mean there, and from the file
    transformers reads (`image_processor_file`)."""
    where = image_processor_file(source)
    import transformers
    from transformers import AutoImageProcessor

    kwargs = {"backend": "pil"} if int(transformers.__version__.split(".")[0]) >= 5 else {"use_fast": False}
    try:
        proc = AutoImageProcessor.from_pretrained(source.path, trust_remote_code=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - any refusal of the config is the folder's fault
        raise ModelLoadError(f"cannot read {where}: {one_line(e)}") from None
    return type(proc).__name__.removesuffix("Pil").removesuffix("Fast"), proc, where


def _short(text: str, at_most: int = 120) -> str:
    return text if len(text) <= at_most else f"{text[:at_most]}..."


def _size_dict(size: Any) -> dict[str, int]:
    if size is None:
        return {}
    items = dict(size) if isinstance(size, Mapping) else {k: getattr(size, k) for k in vars(size)}
    return {k: int(v) for k, v in items.items() if v is not None}


def _three(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and len(values) == 3


def to_rgb(image: Any) -> Any:
    """RGB, as transformers' `convert_to_rgb`: an image with an alpha band or a transparency colour is composited
    onto white first."""
    Image = _pil()
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' `center_crop` of a [C, H, W] array, zero padding included for an image smaller than the crop."""
    height, width = pixels.shape[-2:]
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    bottom, right = top + crop_h, left + crop_w
    if top >= 0 and bottom <= height and left >= 0 and right <= width:
        return pixels[..., top:bottom, left:right]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros_like(pixels, shape=pixels.shape[:-2] + (new_h, new_w))
    top_pad, left_pad = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded[..., top_pad:top_pad + height, left_pad:left_pad + width] = pixels
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[..., max(0, top):min(new_h, bottom), max(0, left):min(new_w, right)]


class ImageTextInputProcessor(TextInputProcessor):
    """`text_input` for models with a text and a vision tower: a text (str, `{"text"}`, `{"token_ids"}`) goes to
    the text tower as before; an image goes to the vision tower.

    An image is raw bytes (`bytes`, `bytearray`, `memoryview`), a PIL image, a `pathlib.Path`, a
    `data:image/...;base64,...` URI string, or a mapping `{"image": ...}` holding any of those, a bare base64
    string, or (with `allow_local_paths`) a file path string. Image URLs are refused (no fetching: no SSRF).
    Prompts (`prompt_name`) apply to texts only.

    Admission stays cheap, as for texts (which are tokenized only when scheduled): the byte limit, the base64, the
    format (from the first bytes) and the file's header (pixel and aspect-ratio limits, a supported mode) are
    checked here, and `check_request` sums a served call's pixels; `preprocess` decodes and turns it into pixel
    values later (offline when the scheduler picks it; served before the call enters the engine). So a queue of
    pending images holds their files, not their pixels.
    """

    name = "image_text_input"
    Params = ImageTextInputParams
    takes_images = True

    def __init__(self, params: ImageTextInputParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        if params.pairs != "forbid":
            raise ModelLoadError("input_processor.params.pairs must be 'forbid': an image-text embedder embeds single"
                                 " texts and images")
        from wde.components.naflex import NaFlexPreprocessor  # it builds on this module's helpers

        self.formats: tuple[str, ...] = check_formats(params.image_formats)
        """The file formats decoded (Pillow's names); any other is refused by name (wde/components/image_limits.py)."""
        self.preprocessor: ImagePreprocessor | NaFlexPreprocessor = image_preprocessor(ctx.source)
        self.naflex: NaFlexPreprocessor | None = None
        """The NaFlex pipeline (SigLIP 2) when images keep their aspect ratio and vary in length; else None."""
        self.image_size: tuple[int, int] | None = None
        """(height, width) of every preprocessed image; None for NaFlex."""
        self.image_tokens: int | None = None
        """Tokens each image takes in the vision tower (its patches, plus a class token where the model has one);
        None for NaFlex, where `num_tokens(width, height)` depends on the image."""
        if isinstance(self.preprocessor, NaFlexPreprocessor):
            self.naflex = naflex_check(ctx.source, self.preprocessor)
        else:
            self.image_size = self.preprocessor.output_size
            self.image_tokens = vision_tokens(ctx.source, self.image_size)  # type: ignore[arg-type]

    def num_tokens(self, width: int, height: int) -> int:
        """Sequence length of a width x height image (as decoded, before EXIF orientation) in the vision tower: a
        constant for fixed-size models, its patch grid's size for NaFlex (which an EXIF rotation does not change)."""
        if self.naflex is not None:
            return self.naflex.num_tokens(width, height)
        return self.image_tokens  # type: ignore[return-value]

    def to_prompt(self, inputs: Any, params: PoolingParams, field: InputName = "input") -> Prompt:
        name = field[1] if isinstance(field, tuple) else field
        if is_image(inputs):
            return self.image_prompt(inputs, name)
        if not isinstance(inputs, (str, Mapping, list, tuple)):
            raise RequestError(f"{name} must be a text or an image (bytes, a PIL image, a data:image/... URI or"
                               f" {{'image': ...}}), got {type(inputs).__name__}", name)
        return super().to_prompt(inputs, params, field)

    def image_prompt(self, value: Any, field: str) -> ImagePrompt:
        """Check one image input (limits, format, size, mode: its header only); `RequestError` naming `field` when
        it is refused."""
        if isinstance(value, Mapping):
            extra = sorted(str(k) for k in value if k != "image")
            if extra:
                raise RequestError(f"{field} is an image ({{'image': ...}}) and cannot also have {extra}; send texts"
                                   " and images as separate inputs", field)
            value, field = value["image"], f"{field}.image"
        if isinstance(value, ImagePrompt):
            return self._check_prepared(value, field)
        if isinstance(value, _pil().Image):
            self._check_image(value, field)
            try:  # a lazily opened file is read now, once: worker threads then only read the loaded pixels
                value.load()
            except Exception as e:  # noqa: BLE001 - a truncated file behind the caller's image
                raise RequestError(f"{field} is a truncated or corrupt image: {one_line(e)}", field,
                                   kind=BAD_IMAGE) from None
            return ImagePrompt(value, self.num_tokens(value.width, value.height), value.width * value.height)
        data = self._image_bytes(value, field)
        with self._open(data, field) as image:
            self._check_image(image, field)
            return ImagePrompt(data, self.num_tokens(image.width, image.height), image.width * image.height)

    def check_request(self, requests: Sequence[Request], names: Sequence[InputName]) -> None:
        """Refuse a server request whose images add up to more than `max_request_image_pixels` (their headers'
        width x height, before any is decoded), naming the input that passes it."""
        pixels = [r.prompt.pixels if isinstance(r.prompt, ImagePrompt) else 0 for r in requests]
        check_request_pixels(pixels, names, self.params.max_request_image_pixels)

    def preprocess(self, prompt: ImagePrompt, field: str = "input") -> np.ndarray:
        """The pixel values of an admitted image: decoded (EXIF orientation applied), converted and preprocessed
        as the model's image processor does. Thread-safe; `RequestError` (kind "bad_image") for a file that turns
        out truncated or corrupt."""
        data = prompt.data
        if isinstance(data, np.ndarray):
            return data
        if isinstance(data, (bytes, bytearray)):
            image = self._decode(bytes(data), field)
        else:
            image = data
        try:
            return self.preprocessor(image)
        except Exception as e:  # noqa: BLE001 - pixel data Pillow cannot read or convert
            raise RequestError(f"{field} is a truncated or corrupt image: {one_line(e)}", field,
                               kind=BAD_IMAGE) from None

    # -- checks ---------------------------------------------------------------------------------------------------

    def _check_prepared(self, prompt: ImagePrompt, field: str) -> ImagePrompt:
        data = prompt.data
        if not isinstance(data, np.ndarray):
            return self.image_prompt(data, field)
        if self.naflex is not None:
            return self._check_patches(data, field)
        expected = (3, *self.image_size)  # type: ignore[misc]
        if data.dtype != np.float32 or data.shape != expected:
            raise RequestError(f"{field}: prepared pixel values must be a float32 array of shape {expected}", field,
                               kind=BAD_IMAGE)
        return ImagePrompt(data, self.image_tokens, 0)  # type: ignore[arg-type]

    def _check_patches(self, data: np.ndarray, field: str) -> ImagePrompt:
        """A NaFlex image's prepared patches: float32 [h_patches, w_patches, 3 * patch_size**2], at most
        max_num_patches of them (the model interpolates its position embeddings to any grid, but the processor
        never makes more, and the scheduler budgets by this length)."""
        pre = self.naflex
        assert pre is not None
        if data.dtype != np.float32 or data.ndim != 3 or data.shape[2] != pre.patch_dim or 0 in data.shape:
            raise RequestError(f"{field}: prepared pixel values must be a float32 array of shape (h_patches,"
                               f" w_patches, {pre.patch_dim}), got {data.dtype} {tuple(data.shape)}", field,
                               kind=BAD_IMAGE)
        tokens = int(data.shape[0] * data.shape[1])
        if tokens > pre.max_num_patches:
            raise RequestError(f"{field}: prepared pixel values have {data.shape[0]}x{data.shape[1]} = {tokens}"
                               f" patches; the limit is {pre.max_num_patches} (the image processor's"
                               " max_num_patches)", field, kind=TOO_LARGE)
        return ImagePrompt(data, tokens, 0)

    def _check_image(self, image: Any, field: str) -> None:
        check_size(*image.size, field, self.params)
        if image.mode not in SUPPORTED_MODES:
            kind = f" {image.format}" if getattr(image, "format", None) else ""
            raise RequestError(f"{field} is a{kind} image of mode {image.mode!r}, which is not supported (supported:"
                               " 1-bit, 8-bit and 16-bit grayscale, palette, RGB(A), CMYK, YCbCr, LAB, HSV; not 32-bit"
                               " integer or float images)", field, kind=BAD_IMAGE)

    def _image_bytes(self, value: Any, field: str) -> bytes:
        limit = self.params.max_image_bytes
        if isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        elif isinstance(value, PurePath):
            data = self._read_file(str(value), field)
        elif isinstance(value, str):
            data = self._from_string(value, field)
        else:
            raise RequestError(f"{field} must be image bytes, a data:image/... URI or a base64 string, got"
                               f" {type(value).__name__}", field, kind=BAD_IMAGE)
        if not data:
            raise RequestError(f"{field} is empty: no image bytes", field, kind="empty")
        if len(data) > limit:
            raise RequestError(f"{field} has {len(data)} bytes; the image size limit is {limit} bytes"
                               " (input_processor.params.max_image_bytes)", field, kind=TOO_LARGE)
        return data

    def _from_string(self, value: str, field: str) -> bytes:
        text = value.strip()
        match = _DATA_URI.match(text)
        if match is not None:
            if not match.group(2):
                raise RequestError(f"{field} is a data: URI without ';base64': send the image base64-encoded"
                                   " (data:image/png;base64,...)", field, kind=BAD_IMAGE)
            return self._b64(text[match.end():], field)
        if text[:5].lower() == "data:":
            raise RequestError(f"{field} is a data: URI of a non-image media type; expected data:image/...;base64,...",
                               field, kind=BAD_IMAGE)
        if re.match(r"[a-z][a-z0-9+.-]*://", text, re.IGNORECASE):
            raise RequestError(f"{field} is a URL; WDE does not fetch images over the network: send the image"
                               " bytes as a data:image/...;base64,... URI", field, kind=BAD_IMAGE)
        if self.params.allow_local_paths:
            try:
                is_file = len(text) < 4096 and os.path.isfile(text)
            except (OSError, ValueError):
                is_file = False
            if is_file:
                return self._read_file(text, field)
            try:
                return self._b64(text, field)
            except RequestError as e:
                if e.kind == TOO_LARGE:
                    raise
                raise RequestError(f"{field} is neither an existing image file ({_short(text)}) nor base64 image"
                                   " data", field, kind=BAD_IMAGE) from None
        return self._b64(text, field)

    def _b64(self, payload: str, field: str) -> bytes:
        payload = re.sub(r"\s+", "", payload)
        limit = self.params.max_image_bytes
        if len(payload) // 4 * 3 > limit + 2:
            raise RequestError(f"{field} holds about {len(payload) // 4 * 3} bytes of base64 image data; the image"
                               f" size limit is {limit} bytes (input_processor.params.max_image_bytes)", field,
                               kind=TOO_LARGE)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{field} is not valid base64 image data (nor a data:image/...;base64,... URI)", field,
                               kind=BAD_IMAGE) from None

    def _read_file(self, path: str, field: str) -> bytes:
        try:
            size = os.stat(path).st_size
            if size > self.params.max_image_bytes:
                raise RequestError(f"{field}: {_short(path)} has {size} bytes; the image size limit is"
                                   f" {self.params.max_image_bytes} bytes (input_processor.params.max_image_bytes)",
                                   field, kind=TOO_LARGE)
            with open(path, "rb") as f:
                return f.read(self.params.max_image_bytes + 1)
        except OSError as e:
            raise RequestError(f"{field}: cannot read image file {_short(path)}: {e.strerror or one_line(e)}", field,
                               kind=BAD_IMAGE) from None

    def _open(self, data: bytes, field: str) -> Any:
        """The image of `data`, its header read (format, size, mode), no pixel decoded yet; a format outside
        `image_formats` is refused by name before its header is parsed."""
        return open_image(data, self.formats, field)

    def _decode(self, data: bytes, field: str) -> Any:
        from PIL import ImageOps

        image = self._open(data, field)
        self._check_image(image, field)
        try:
            image.load()
            if self.params.exif_transpose:
                image = ImageOps.exif_transpose(image)
        except Exception as e:  # noqa: BLE001 - OSError("image file is truncated"), SyntaxError, EOFError, ...
            kind = f"{image.format} image" if image.format else "image"
            raise RequestError(f"{field} is a truncated or corrupt {kind}: {one_line(e)}", field,
                               kind=BAD_IMAGE) from None
        return image


def image_preprocessor(source: Any) -> "ImagePreprocessor | NaFlexPreprocessor":
    """The image pipeline of a model folder: fixed-size (CLIP, SigLIP) or NaFlex (SigLIP 2), by its image
    processor's class."""
    from wde.components.naflex import NAFLEX_PROCESSORS, NaFlexPreprocessor

    name, proc, where = load_image_processor(source)
    if name in NAFLEX_PROCESSORS:
        return NaFlexPreprocessor.from_processor(name, proc, where)
    if name not in _PROCESSORS:
        raise ModelLoadError(f"{where}: image processor {type(proc).__name__} is not one WDE reproduces"
                             f" ({', '.join(_PROCESSORS + NAFLEX_PROCESSORS)})")
    return ImagePreprocessor.from_processor(name, proc, where)


def naflex_check(source: Any, pre: "NaFlexPreprocessor") -> "NaFlexPreprocessor":
    """`pre`, once the model is one whose vision tower takes NaFlex patches of the processor's patch size."""
    cfg = source.hf_config
    model_type = getattr(cfg, "model_type", None)
    vision = getattr(cfg, "vision_config", None)
    if model_type not in NAFLEX_MODELS or vision is None:
        raise ModelLoadError(f"{source.path}: the image processor {pre.kind} makes variable-resolution (NaFlex)"
                             f" patches, which config model_type {model_type!r} does not take (NaFlex models:"
                             f" {', '.join(NAFLEX_MODELS)})")
    patch = vision.patch_size
    if not isinstance(patch, int) or patch != pre.patch_size:
        raise ModelLoadError(f"{source.path}: the image processor cuts {pre.patch_size}-pixel patches but the vision"
                             f" tower takes patch_size {patch} (vision_config.patch_size)")
    if int(getattr(vision, "num_channels", 3)) != 3:
        raise ModelLoadError(f"{source.path}: vision_config.num_channels is {vision.num_channels}; images are RGB")
    return pre


def vision_tokens(source: Any, size: tuple[int, int]) -> int:
    """Sequence length of one preprocessed image in the model's vision tower; refuses a processor whose output size
    is not the model's `vision_config.image_size`."""
    cfg = source.hf_config
    model_type = getattr(cfg, "model_type", None)
    vision = getattr(cfg, "vision_config", None)
    if model_type in NAFLEX_MODELS:
        raise ModelLoadError(f"{source.path}: config model_type {model_type!r} takes variable-resolution (NaFlex)"
                             " patches, but the folder's image processor makes fixed-size images; save the model's"
                             " own image processor (Siglip2ImageProcessor) into the folder")
    if model_type not in CLASS_TOKENS or vision is None:
        raise ModelLoadError(f"{source.path}: config model_type {model_type!r} is not a two-tower image-text model WDE"
                             f" knows ({', '.join(CLASS_TOKENS)})")
    image_size, patch = int(vision.image_size), int(vision.patch_size)
    if tuple(size) != (image_size, image_size):
        raise ModelLoadError(f"{source.path}: the image processor makes {size[0]}x{size[1]} images but the vision"
                             f" tower takes {image_size}x{image_size} (vision_config.image_size)")
    return (image_size // patch) ** 2 + CLASS_TOKENS[model_type]
