"""What bounds the work one image, and one request's images, can make WDE do: every check here reads only an
image's first bytes and its header (format, width, height), so a refused image costs nothing but those bytes.

- the format: only the formats in `image_formats` are parsed at all (PNG, JPEG, WebP, GIF, BMP, TIFF by default);
  any other is refused by name before its header is parsed. Pillow reads dozens of formats, some of them slow to
  decode (a 196 kB FITS file held the interpreter lock for 6.5 s and took 700 MB), some handed to external programs
  (EPS goes to Ghostscript where it is installed), none of them what a photo is sent as;
- width x height within `max_image_pixels`: a decompression bomb is a small file whose header promises gigapixels;
- the aspect ratio within `max_image_aspect_ratio`: a 1 x 100,000 PNG is 125 bytes, and resizing its short edge to
  a model's 224 pixels would make 224 x 22,400,000 (wde/components/image_input.py also resizes only what the crop
  keeps of such a strip, so even a raised limit cannot blow up);
- the sum over a server request's images within `max_request_image_pixels`, checked before any of them is decoded
  (`check_request_pixels`, called as a call is admitted): what one request can make the server decode.

This module is torch-free and imports Pillow only when an image is opened (params.py reads its defaults).
"""

from __future__ import annotations

import io
from typing import Any, Iterable, Sequence

from wde.errors import ModelLoadError, RequestError, one_line

BAD_IMAGE = "bad_image"
TOO_LARGE = "image_too_large"
"""`RequestError.kind` of refused images: a client error (HTTP 400), and one over a size limit (HTTP 413)."""

MAX_IMAGE_PIXELS = 2 ** 25
"""33,554,432 pixels: 8K UHD (7680 x 4320) and 24-megapixel camera photos (6000 x 4000) pass; decoded as RGB that
is 100 MB, a quarter of Pillow's own decompression-bomb error threshold (2 x 89,478,485 pixels)."""

MAX_IMAGE_ASPECT_RATIO = 200.0
"""Longer side / shorter side: panoramas (4:1 to 10:1) and long web screenshots (1:30) pass; a strip of pixels
whose resize would dwarf the image does not."""

MAX_REQUEST_IMAGE_PIXELS = 2 ** 28
"""268,435,456 pixels in one server request: 8 images at the per-image limit, 64 of 4 megapixels, 5,350 of
224 x 224; about 800 MB decoded as RGB in all, decoded a few at a time."""

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""Pillow format names decoded by default. A JPEG with several pictures (MPO, phone cameras) is a JPEG: its first
picture is taken, as a GIF's or a TIFF's first frame is."""

_PREFIX = 16
"""Bytes Pillow's format detectors look at (`Image.open` reads 16)."""


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """`formats` as Pillow names them (upper case), each one Pillow can open; `ModelLoadError` naming the first it
    does not know."""
    from PIL import Image

    Image.init()
    names = tuple(dict.fromkeys(f.upper() for f in formats))
    unknown = [f for f in names if f not in Image.OPEN]
    if unknown:
        raise ModelLoadError(f"input_processor.params.image_formats: Pillow cannot open {', '.join(unknown)}"
                             f" (formats it opens: {', '.join(sorted(Image.OPEN))})")
    return names


def open_image(data: bytes, formats: Sequence[str], field: str) -> Any:
    """The image of `data`, its header read (format, size, mode) and no pixel decoded, if it is in one of
    `formats`; a `RequestError` naming `field` (kind "bad_image") naming the format otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError as e:
        raise RequestError(f"{field} is a decompression bomb: {one_line(e)}", field, kind=TOO_LARGE) from None
    except UnidentifiedImageError:
        other = format_of(data[:_PREFIX], exclude=formats)
        if other is not None:
            raise RequestError(f"{field} is in the {other} format, which this server does not decode (it decodes"
                               f" {', '.join(formats)}: input_processor.params.image_formats)", field,
                               kind=BAD_IMAGE) from None
        raise RequestError(f"{field} is not an image: no image format recognizes its {len(data)} bytes", field,
                           kind=BAD_IMAGE) from None
    except Exception as e:  # noqa: BLE001 - a header Pillow cannot parse
        raise RequestError(f"{field} is not a readable image: {one_line(e)}", field, kind=BAD_IMAGE) from None


def format_of(prefix: bytes, exclude: Iterable[str] = ()) -> str | None:
    """The name of the first Pillow format (other than `exclude`) whose signature test accepts these first bytes,
    or None: only the signature tests run (a few byte comparisons each), never a format's parser."""
    from PIL import Image

    Image.init()
    skip = set(exclude)
    for name in Image.ID:
        accept = Image.OPEN.get(name, (None, None))[1]
        if name in skip or accept is None:
            continue
        try:
            if accept(prefix):
                return name
        except Exception:  # noqa: BLE001 - a signature test that trips on short input says no
            continue
    return None


def check_size(width: int, height: int, field: str, params: Any) -> None:
    """Refuse an image whose header says it has no pixels, more than `max_image_pixels`, or a longer side more than
    `max_image_aspect_ratio` times its shorter one; `RequestError` naming `field` and the limit."""
    if width < 1 or height < 1:
        raise RequestError(f"{field} has no pixels ({width}x{height})", field, kind=BAD_IMAGE)
    pixels = width * height
    if pixels > params.max_image_pixels:
        raise RequestError(f"{field} is {width}x{height} = {pixels} pixels; the limit is {params.max_image_pixels}"
                           " (input_processor.params.max_image_pixels: a decompression bomb guard)", field,
                           kind=TOO_LARGE)
    ratio = max(width, height) / min(width, height)
    if ratio > params.max_image_aspect_ratio:
        raise RequestError(f"{field} is {width}x{height}, an aspect ratio of {ratio:.0f}:1; the limit is"
                           f" {params.max_image_aspect_ratio:g}:1 (input_processor.params.max_image_aspect_ratio)",
                           field, kind=TOO_LARGE)


def check_request_pixels(pixels: Sequence[int], names: Sequence[Any], limit: int) -> None:
    """Refuse a request whose images (`pixels`: width x height of each input, 0 for a text or an image already
    decoded) add up to more than `limit`, naming the input that passes it; before any of them is decoded."""
    total = 0
    for count, name in zip(pixels, names):
        total += count
        if count and total > limit:
            field = name if isinstance(name, str) else name[-1]
            raise RequestError(f"{field}: the images of this request add up to {total} pixels with this one; the"
                               f" limit per request is {limit} (input_processor.params.max_request_image_pixels):"
                               " send fewer or smaller images per request", field, kind=TOO_LARGE)
