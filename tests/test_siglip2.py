"""SigLIP 2 NaFlex (`Siglip2Model`): each image keeps its aspect ratio and is a sequence of its own patch grid, so
lengths vary per image in one batch. Both towers equal transformers' `get_text_features` / `get_image_features`
(the reference run as its processor runs it: padded to max_num_patches with `pixel_attention_mask` and
`spatial_shapes`), the patches equal `Siglip2ImageProcessor`'s unpadded rows, admission knows an image's length
from its header alone, and prepared patch arrays and misfit folders are refused by name.

The position embeddings are resized as SigLIP 2 was trained (big_vision: antialiased bilinear). The reference for that
is Pillow's BILINEAR resize (`trained_resize`), not whichever transformers is installed: transformers <= 5.23 resizes
with `F.interpolate(antialias=True)`, whose CPU kernel is wrong for grids one patch wide (docs/images.md), and 5.24
builds the weights itself. The transformers model runs with its resize replaced by that reference
(`Reference.image`); what each release does is pinned down separately (`test_installed_transformers_resize`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.tiny_clip import (CAPTIONS, SIGLIP2_MAX_PATCHES, SIGLIP2_PATCH, build_siglip2, exif_rotated_jpeg,
                             image_of_mode, scene)
from tests.test_clip_siglip import MODES, RAW, dense, reopened
from tests.test_clip_siglip import Reference as ClipReference
from tests.tiny_models import varied_texts
from wde import Engine, RequestError
from wde.components.image_input import BAD_IMAGE, TOO_LARGE
from wde.components.models.siglip2 import NaFlexEmbeddings
from wde.components.naflex import size_for_max_num_patches
from wde.errors import ModelLoadError
from wde.request import ImagePrompt

SIZES = [(41, 29), (23, 57), (30, 30), (7, 3), (301, 13), (1, 1), (13, 301), (64, 16), (17, 90), (5, 40)]
"""Widths x heights of several aspect ratios, so the patch grids (and lengths) differ from image to image."""
PATCH_DIM = 3 * SIGLIP2_PATCH ** 2


@pytest.fixture(scope="module")
def siglip2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_siglip2(tmp_path_factory.mktemp("tiny-siglip2"))


@pytest.fixture(scope="module")
def siglip2(siglip2_path: Path):
    with Engine.from_workflow("siglip2", siglip2_path) as engine:
        yield engine


class Reference(ClipReference):
    """transformers' Siglip2Model, tokenizer and (PIL backend) Siglip2ImageProcessor from the same folder."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        assert type(self.processor).__name__ == "Siglip2ImageProcessorPil"

    @torch.no_grad()
    def text(self, texts: list[str]) -> np.ndarray:
        """As SigLIP 2 is used (its processor's defaults): padded to max_length 64, no attention mask."""
        ids = self.tokenizer(texts, padding="max_length", max_length=64, return_tensors="pt").input_ids
        return self.model.get_text_features(input_ids=ids).pooler_output.numpy()

    def inputs(self, images: list[Any]) -> dict[str, torch.Tensor]:
        return self.processor(images=images, return_tensors="pt")

    def patches(self, image: Any) -> np.ndarray:
        """The processor's patches of one image without its padding rows, as [h, w, values]."""
        out = self.processor(images=[image], return_tensors="np")
        h, w = (int(v) for v in out.spatial_shapes[0])
        mask = out.pixel_attention_mask[0]
        assert mask[:h * w].all() and not mask[h * w:].any()
        return out.pixel_values[0][:h * w].reshape(h, w, -1)

    @torch.no_grad()
    def image(self, images: list[Any]) -> np.ndarray:
        return self.features(**self.inputs(images))

    @torch.no_grad()
    def grids(self, arrays: list[np.ndarray]) -> np.ndarray:
        """Prepared [h, w, values] patch arrays, padded to max_num_patches as the processor pads them."""
        most = SIGLIP2_MAX_PATCHES
        pixels = np.zeros((len(arrays), most, PATCH_DIM), np.float32)
        mask = np.zeros((len(arrays), most), np.int64)
        for i, array in enumerate(arrays):
            n = array.shape[0] * array.shape[1]
            pixels[i, :n], mask[i, :n] = array.reshape(n, -1), 1
        shapes = torch.tensor([array.shape[:2] for array in arrays])
        return self.features(pixel_values=torch.from_numpy(pixels), pixel_attention_mask=torch.from_numpy(mask),
                             spatial_shapes=shapes)

    def features(self, **inputs: torch.Tensor) -> np.ndarray:
        """`get_image_features` with the position embeddings resized by `trained_resize`, whatever the installed
        release's own `resize_positional_embeddings` does."""
        from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Siglip2VisionEmbeddings, "resize_positional_embeddings", staticmethod(resize_as_trained))
            return self.model.get_image_features(**inputs).pooler_output.numpy()


def trained_resize(table: torch.Tensor, height: int, width: int) -> np.ndarray:
    """A [side, side, dim] position table resized to [height, width, dim] as SigLIP 2 was trained (big_vision's
    `jax.image.scale_and_translate(method="bilinear", antialias=True)`): Pillow's BILINEAR resize of each channel as a
    float image, which is that antialiased triangle filter (its support widened by the scale when shrinking) in code
    that shares nothing with torch, transformers or WDE."""
    planes = [Image.fromarray(np.ascontiguousarray(table[:, :, d].detach().numpy(), np.float32))
              .resize((width, height), Image.Resampling.BILINEAR) for d in range(table.shape[-1])]
    return np.stack([np.asarray(plane) for plane in planes], axis=-1)


def resize_as_trained(positional_embeddings: torch.Tensor, spatial_shapes: torch.Tensor,
                      max_length: int) -> torch.Tensor:
    """`Siglip2VisionEmbeddings.resize_positional_embeddings`'s contract with `trained_resize` inside: [images,
    max_length, dim], each image's grid row by row, its padding rows a copy of the first (masked anyway)."""
    dim = positional_embeddings.shape[-1]
    out = torch.empty(len(spatial_shapes), max_length, dim, dtype=positional_embeddings.dtype)
    for i, (height, width) in enumerate(spatial_shapes.tolist()):
        resized = torch.from_numpy(trained_resize(positional_embeddings.float(), height, width)).reshape(-1, dim)
        out[i, :height * width] = resized
        out[i, height * width:] = resized[0]
    return out


def interpolated(table: torch.Tensor, height: int, width: int) -> np.ndarray:
    """What transformers <= 5.23 computes: `F.interpolate(mode="bilinear", antialias=True)` in float32."""
    planar = table.permute(2, 0, 1).unsqueeze(0).float()
    out = F.interpolate(planar, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return out[0].permute(1, 2, 0).numpy()


GRIDS = [(16, 1), (1, 16), (7, 2), (2, 7), (4, 4), (3, 3), (3, 5), (24, 1), (1, 24), (5, 1), (4, 1), (1, 1),
         (12, 2), (2, 3)]
"""Patch grids (h x w) within the tiny model's max_num_patches (24) that shrink, keep or stretch each side of its
4 x 4 table, one patch wide or tall among them: on CPU, `F.interpolate(antialias=True)` is wrong for an output one
column wide whose height changes."""


@pytest.fixture(scope="module")
def ref(siglip2_path: Path) -> Reference:
    return Reference(siglip2_path)


def odd_images() -> list[Image.Image]:
    return [image_of_mode(mode, *SIZES[i % len(SIZES)], seed=i) for i, mode in enumerate(MODES)]


# -- parity with transformers ---------------------------------------------------------------------------------------

def test_mixed_batch_of_variable_grids_equals_transformers(siglip2: Engine, ref: Reference) -> None:
    """Images of ten sizes and modes (ten grids, so ten lengths) and texts in one call: each image equals
    `get_image_features` on the processor's padded batch, each text `get_text_features`; lengths are the grids."""
    images = odd_images()
    texts = CAPTIONS + [t for t in varied_texts(12) if len(ref.tokenizer(t).input_ids) <= 64][:4]
    mixed: list[Any] = []
    for i, image in enumerate(images):
        mixed.append(image)
        if i < len(texts):
            mixed.append(texts[i])
    outs = siglip2.encode(mixed, RAW)
    is_image = [isinstance(x, Image.Image) for x in mixed]
    got = np.stack([o.outputs["dense"] for o in outs])
    inputs = ref.inputs(images)
    grids = [tuple(s) for s in inputs["spatial_shapes"].tolist()]
    assert len(set(grids)) >= 8 and len({h * w for h, w in grids}) >= 4  # grids and lengths really vary
    assert any(w == 1 and h != 4 for h, w in grids)  # a tall image one patch wide: where resizes have differed
    assert [o.num_prompt_tokens for o, m in zip(outs, is_image) if m] == [h * w for h, w in grids]
    assert all(o.prompt_token_ids == [] for o, m in zip(outs, is_image) if m)
    want_images = ref.image(images)
    assert np.abs(got[[i for i, m in enumerate(is_image) if m]] - want_images).max() <= 1e-4
    assert np.abs(got[[i for i, m in enumerate(is_image) if not m]] - ref.text(texts)).max() <= 1e-4
    for image, want in zip(images[:3], want_images):  # alone (no padding anywhere) as in the mixed batch
        assert np.abs(dense(siglip2, [image])[0] - want).max() <= 1e-4
    unit = siglip2.embed(images)  # the default: normalized, as Siglip2Model.forward normalizes both sides
    assert np.allclose(unit, want_images / np.linalg.norm(want_images, axis=1, keepdims=True), atol=1e-5)


def test_every_grid_shape_equals_transformers(siglip2: Engine, ref: Reference) -> None:
    """Prepared patch arrays of every grid in GRIDS (16 x 1, 1 x 16, 7 x 2, square, ...) in one batch and each alone
    equal `get_image_features` with the position embeddings resized as trained."""
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((h, w, PATCH_DIM)).astype(np.float32) for h, w in GRIDS]
    want = ref.grids(arrays)
    assert np.abs(dense(siglip2, [ImagePrompt(a, 0) for a in arrays]) - want).max() <= 1e-4
    for (h, w), array, row in zip(GRIDS, arrays, want):
        assert np.abs(dense(siglip2, [ImagePrompt(array, 0)])[0] - row).max() <= 1e-4, (h, w)


@pytest.mark.parametrize("side", [4, 16])
def test_position_table_is_resized_as_trained(side: int) -> None:
    """WDE's resized table equals Pillow's antialiased bilinear resize (`trained_resize`) for grids that shrink,
    keep and stretch each side, one patch wide or tall among them; resizing the transposed table to the transposed
    grid gives the transpose (the filter is the same along both axes)."""
    dim = 8
    cfg = type("Cfg", (), dict(patch_size=4, num_channels=3, hidden_size=dim, num_patches=side * side))()
    embeddings = NaFlexEmbeddings(cfg)
    with torch.no_grad():
        embeddings.position_embedding.weight.copy_(torch.randn(side * side, dim,
                                                               generator=torch.Generator().manual_seed(side)))
    table = embeddings.position_embedding.weight.detach().reshape(side, side, dim)
    transposed = NaFlexEmbeddings(cfg)
    with torch.no_grad():
        transposed.position_embedding.weight.copy_(table.transpose(0, 1).reshape(side * side, dim))
    for h, w in GRIDS + [(side, 1), (2 * side + 3, 1), (1, 2 * side + 3), (side + 5, 3), (8, 8), (32, 32)]:
        got = embeddings.resized(h, w).detach().reshape(h, w, dim).numpy()
        assert np.abs(got - trained_resize(table, h, w)).max() <= 1e-5, (side, h, w)
        flipped = transposed.resized(w, h).detach().reshape(w, h, dim).numpy()
        assert np.abs(flipped.transpose(1, 0, 2) - got).max() <= 1e-5, (side, h, w)


def test_installed_transformers_resize() -> None:
    """Pins down what the installed transformers' `resize_positional_embeddings` does, so a release that changes it
    again is noticed: <= 5.23 is `F.interpolate(antialias=True)` (`interpolated`), >= 5.24 the trained resize. The
    two agree (1e-5) on every grid more than one patch wide and on an unchanged height; on CPU, where torch's
    antialiased kernel gives every row of a one-column output the first row's weights, they differ on the others
    (here up to ~2 for a 16 x 1 grid), which is why WDE builds the weights itself."""
    import transformers
    from packaging.version import Version
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    table = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(0))
    since_524 = Version(transformers.__version__).release >= (5, 24)
    for h, w in GRIDS:
        shapes = torch.tensor([[h, w]])
        got = Siglip2VisionEmbeddings.resize_positional_embeddings(table, shapes, h * w)[0].reshape(h, w, -1).numpy()
        trained, interp = trained_resize(table, h, w), interpolated(table, h, w)
        assert np.abs(got - (trained if since_524 else interp)).max() <= 1e-5, (transformers.__version__, h, w)
        if w > 1 or h == 4:
            assert np.abs(interp - trained).max() <= 1e-5, (h, w)
        else:  # right, or torch's CPU defect: every row a copy of the first
            assert np.abs(interp - trained).max() <= 1e-5 or (interp == interp[:1]).all(), (h, w)


def test_encoded_files_equal_transformers(siglip2: Engine, ref: Reference) -> None:
    files = [reopened(image) for image in odd_images()]
    got = dense(siglip2, [data for data, _ in files])
    assert np.abs(got - ref.image([opened for _, opened in files])).max() <= 1e-4


def test_batches_split_across_cpu_streams_give_the_same_vectors(siglip2: Engine, siglip2_path: Path) -> None:
    """Pieces of a batch of padded grids (`ModelInput.split`) keep each image's patches."""
    inputs: list[Any] = [*odd_images(), *CAPTIONS]
    want = dense(siglip2, inputs)
    params = {"params": {"cpu_streams": 3, "cpu_stream_min_tokens": 1, "cpu_stream_max_mean_tokens": 100000}}
    with Engine.from_workflow("siglip2", siglip2_path, runner=params) as engine:
        assert np.abs(dense(engine, inputs) - want).max() <= 1e-5


def test_left_padding_tokenizer_pads_before_the_text(tmp_path: Path) -> None:
    """`pad_text: max_length` pads on the tokenizer's padding_side, as `padding="max_length"` does."""
    folder = build_siglip2(tmp_path / "left", padding_side="left")
    reference = Reference(folder)
    assert reference.tokenizer.padding_side == "left"
    with Engine.from_workflow("siglip2", folder) as engine:
        out = engine.encode(CAPTIONS[:1], RAW)[0]
        assert np.abs(dense(engine, CAPTIONS) - reference.text(CAPTIONS)).max() <= 1e-4
    assert out.num_prompt_tokens == 64


# -- preprocessing ----------------------------------------------------------------------------------------------------

def test_patches_equal_the_image_processor_rows(siglip2: Engine, ref: Reference) -> None:
    """Every mode and size: the [h, w, 3*p*p] array equals the processor's unpadded rows; admission's length (from
    the file's header) is h*w."""
    pre = siglip2.input_processor.preprocessor
    for mode in MODES:
        for width, height in SIZES:
            image = image_of_mode(mode, width, height, seed=width * height)
            want = ref.patches(image)
            got = pre(image)
            assert got.dtype == np.float32 and got.shape == want.shape, (mode, width, height)
            assert np.abs(got - want).max() <= 1e-6, (mode, width, height)
            data, opened = reopened(image)
            prompt = siglip2.input_processor.image_prompt(data, "input")
            assert prompt.num_tokens == want.shape[0] * want.shape[1], (mode, width, height)
            pixels = siglip2.input_processor.preprocess(prompt)
            assert np.abs(pixels - ref.patches(opened)).max() <= 1e-6, (mode, width, height)


def test_grid_search_is_transformers_and_symmetric() -> None:
    """The patch grid of every size up to 130 x 130 at several max_num_patches is transformers' own; swapping width
    and height transposes it (so an EXIF rotation keeps the length admission counted)."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

    for most in (1, 7, SIGLIP2_MAX_PATCHES, 256):
        for height in range(1, 131, 3):
            for width in range(1, 131, 7):
                got = size_for_max_num_patches(height, width, 16, most)
                assert got == get_image_size_for_max_num_patches(height, width, 16, most), (height, width, most)
                assert (got[0] // 16) * (got[1] // 16) <= most
                assert size_for_max_num_patches(width, height, 16, most) == got[::-1]


def test_exif_rotation_transposes_the_grid_and_keeps_the_length(siglip2: Engine, ref: Reference) -> None:
    data, upright = exif_rotated_jpeg(64, 16)
    prompt = siglip2.input_processor.image_prompt(data, "input")
    pixels = siglip2.input_processor.preprocess(prompt)
    want = ref.patches(upright)
    assert pixels.shape == want.shape and want.shape[0] > want.shape[1]  # taller than wide, as viewed
    assert prompt.num_tokens == want.shape[0] * want.shape[1]
    assert np.abs(pixels - want).max() <= 1e-6


# -- prepared arrays and refusals --------------------------------------------------------------------------------------

def test_prepared_patch_arrays(siglip2: Engine) -> None:
    """An already preprocessed image is [h_patches, w_patches, 3*p*p] float32 (what crosses to an engine core);
    other shapes, dtypes and grids over max_num_patches are refused naming the field and the limit."""
    image, wide = scene(1), image_of_mode("RGB", 90, 17)
    patches = siglip2.input_processor.preprocessor(image)
    request = siglip2.make_request(ImagePrompt(patches, 0))
    assert request.prompt.num_tokens == patches.shape[0] * patches.shape[1]
    received = np.frombuffer(siglip2.input_processor.preprocessor(wide).tobytes(), np.float32).reshape(
        siglip2.input_processor.preprocessor(wide).shape)  # read-only, as an array off the wire is
    assert received.shape != patches.shape and not received.flags.writeable
    got = dense(siglip2, [ImagePrompt(patches, 0), "a caption", ImagePrompt(received, 0)])
    assert np.abs(got - dense(siglip2, [image, "a caption", wide])).max() == 0.0
    for bad, kind, reason in [
        (np.zeros((3, 16, 16), np.float32), BAD_IMAGE, f"shape (h_patches, w_patches, {PATCH_DIM})"),
        (np.zeros((2, 3, PATCH_DIM), np.float64), BAD_IMAGE, "float64"),
        (np.zeros((0, 3, PATCH_DIM), np.float32), BAD_IMAGE, "(0, 3, 48)"),
        (np.zeros((5, 5, PATCH_DIM), np.float32), TOO_LARGE,
         f"5x5 = 25 patches; the limit is {SIGLIP2_MAX_PATCHES} (the image processor's max_num_patches)"),
    ]:
        with pytest.raises(RequestError) as info:
            siglip2.encode(["a caption", ImagePrompt(bad, 0)])
        assert info.value.kind == kind and reason in str(info.value) and "input[1]" in str(info.value)
    assert not siglip2.has_unfinished()
    assert dense(siglip2, ["a caption", image]).shape == (2, 32)  # the engine goes on


def _variant(source: Path, folder: Path, preprocessor: dict[str, Any]) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config.update(preprocessor)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change,message", [
    ({"patch_size": 8}, "cuts 8-pixel patches but the vision tower takes patch_size 4"),
    ({"image_processor_type": "SiglipImageProcessor", "size": {"height": 16, "width": 16}},
     "takes variable-resolution (NaFlex) patches, but the folder's image processor makes fixed-size images"),
    ({"do_resize": False}, "do_resize is false"),
])
def test_misfit_image_processors_are_refused(siglip2_path: Path, tmp_path: Path, change: dict, message: str) -> None:
    folder = _variant(siglip2_path, tmp_path / "variant", change)
    with pytest.raises(ModelLoadError, match="image_text_input") as info:
        Engine.from_workflow("siglip2", folder)
    assert message in str(info.value)


def test_a_naflex_processor_with_a_fixed_size_model_is_refused(tmp_path: Path) -> None:
    from tests.tiny_clip import build_siglip

    folder = build_siglip(tmp_path / "siglip")
    config = {"image_processor_type": "Siglip2ImageProcessor", "patch_size": 6, "max_num_patches": 25}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config model_type 'siglip' does not take \(NaFlex models: siglip2\)"):
        Engine.from_workflow("siglip", folder)


def test_workflow_is_picked_from_architectures() -> None:
    from wde.registry import get_registry

    assert get_registry().workflow_for(["Siglip2Model"]) == "siglip2"
