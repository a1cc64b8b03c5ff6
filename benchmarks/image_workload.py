"""Generated image workloads for the image benchmarks (deterministic for a seed): photo-sized pictures of varied
sizes, half JPEG and half PNG, as encoded files, so every side pays for decoding as a real corpus makes it."""

from __future__ import annotations

import io

import numpy as np


def picture(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """[height, width, 3] uint8: smooth colour gradients, a few flat rectangles and mild noise, roughly what a
    photo costs to decode and resize (pure noise would make PNGs of several megabytes)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, 3)
    base = np.stack([127 + 120 * np.sin(x / width * np.pi * (c + 1) + phase[c]) * np.cos(y / height * np.pi)
                     for c in range(3)], axis=-1)
    for _ in range(4):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        base[y0:y0 + rng.integers(10, height // 2), x0:x0 + rng.integers(10, width // 2)] = rng.uniform(0, 255, 3)
    return np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)


def images(n: int, min_px: int = 300, max_px: int = 800, seed: int = 0) -> list[bytes]:
    """`n` encoded images, each side uniform in [min_px, max_px]; even ones JPEG (quality 90), odd ones PNG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        width, height = (int(v) for v in rng.integers(min_px, max_px + 1, 2))
        buf = io.BytesIO()
        image = Image.fromarray(picture(width, height, rng))
        if i % 2 == 0:
            image.save(buf, "JPEG", quality=90)
        else:
            image.save(buf, "PNG")
        out.append(buf.getvalue())
    return out
