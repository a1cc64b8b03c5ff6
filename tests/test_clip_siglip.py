"""CLIP and SigLIP: both towers equal transformers' `get_text_features` / `get_image_features` (fp32 CPU), images are
preprocessed pixel for pixel as transformers' image processors do, a mixed batch of texts and images equals separate
calls, every accepted image shape works, bad images are refused by name, and docs/images.md's search example runs."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.tiny_clip import (CAPTIONS, build_siglip, build_siglip2, encoded, exif_rotated_jpeg, image_of_mode,
                             saved_as_processor, scene)
from tests.ranking import BATCH_TOLERANCE
from tests.tiny_models import varied_texts
from wde import Engine, PoolingParams, RequestError
from wde.errors import ModelLoadError
from wde.components.image_input import BAD_IMAGE, TOO_LARGE
from wde.components.model_input_builder import ModelInput
from wde.request import ImagePrompt

ROOT = Path(__file__).resolve().parents[1]
RAW = PoolingParams(normalize=False)
MODES = ["RGB", "RGBA", "L", "LA", "P", "P+transparency", "CMYK", "I;16", "1", "YCbCr"]
SIZES = [(41, 29), (23, 57), (30, 30), (7, 3), (301, 13), (1, 1)]


@pytest.fixture(scope="module")
def siglip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_siglip(tmp_path_factory.mktemp("tiny-siglip"))


@pytest.fixture(scope="module")
def siglip(siglip_path: Path):
    with Engine.from_workflow(None, siglip_path) as engine:
        yield engine


class Reference:
    """transformers' model, tokenizer and (PIL backend) image processor from the same folder."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
        self.siglip = self.model.config.model_type == "siglip"

    @torch.no_grad()
    def text(self, texts: list[str], pad: bool = True) -> np.ndarray:
        if self.siglip:  # as SigLIP is used: padded to the max length, no attention mask (the padding is attended)
            kwargs = dict(padding="max_length", max_length=self.tokenizer.model_max_length) if pad else {}
            rows = [self.model.get_text_features(input_ids=self.tokenizer([t], return_tensors="pt", **kwargs)
                                                 .input_ids).pooler_output[0] for t in texts]
            return torch.stack(rows).numpy()
        enc = self.tokenizer(texts, padding=True, return_tensors="pt")
        return self.model.get_text_features(**enc).pooler_output.numpy()

    def pixels(self, images: list[Any]) -> np.ndarray:
        return self.processor(images=images, return_tensors="np").pixel_values

    @torch.no_grad()
    def image(self, images: list[Any]) -> np.ndarray:
        pixels = torch.from_numpy(self.pixels(images))
        return self.model.get_image_features(pixel_values=pixels).pooler_output.numpy()


@pytest.fixture(scope="module")
def clip_ref(clip_path: Path) -> Reference:
    return Reference(clip_path)


@pytest.fixture(scope="module")
def siglip_ref(siglip_path: Path) -> Reference:
    return Reference(siglip_path)


def dense(engine: Engine, inputs: list[Any], params: PoolingParams = RAW) -> np.ndarray:
    return np.stack([o.outputs["dense"] for o in engine.encode(inputs, params)])


def odd_images() -> list[Image.Image]:
    return [image_of_mode(mode, *SIZES[i % len(SIZES)], seed=i) for i, mode in enumerate(MODES)]


def reopened(image: Image.Image) -> tuple[bytes, Image.Image]:
    """The image saved in a format that keeps its mode, and that file opened again as a reader would."""
    fmt = "JPEG" if image.mode == "CMYK" else "TIFF" if image.mode == "YCbCr" else "PNG"
    data = encoded(image, fmt)
    return data, Image.open(io.BytesIO(data))


# -- parity with transformers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_text_tower_equals_get_text_features(family: str, request: pytest.FixtureRequest) -> None:
    engine, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    assert engine.workflow.name == family
    texts = CAPTIONS + [t for t in varied_texts(12) if len(ref.tokenizer(t).input_ids) <= engine.max_length][:8]
    got, want = dense(engine, texts), ref.text(texts)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4
    unit = engine.embed(texts)  # the default: normalized, as the model's own similarity normalizes
    assert np.allclose(unit, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-5)


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_vision_tower_equals_get_image_features(family: str, request: pytest.FixtureRequest) -> None:
    engine, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    images = odd_images()
    files = [reopened(im) for im in images]
    want = ref.image([opened for _, opened in files])
    assert np.abs(dense(engine, [data for data, _ in files]) - want).max() <= 1e-4  # file bytes, decoded here
    assert np.abs(dense(engine, images) - ref.image(images)).max() <= 1e-4  # PIL images


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_a_patch_size_that_does_not_divide_the_image_leaves_its_last_pixels_out(family: str, tmp_path: Path) -> None:
    """google/siglip-so400m-patch14-384's 384-pixel images cut in 14-pixel patches: 27 x 27 of them, the last 6 pixels
    of each side in no patch, as transformers' stride-14 convolution leaves them (the tiny towers: 32 pixels, 6-pixel
    patches, 5 x 5 and 2 left out). Both towers' image features equal `get_image_features`; before, refused."""
    from tests.tiny_clip import build_clip

    build = build_clip if family == "clip" else build_siglip
    folder = build(tmp_path / family, image_size=32, patch_size=6)
    ref = Reference(folder)
    images = odd_images()
    whole = np.asarray(images[0].convert("RGB").resize((32, 32)), dtype=np.uint8)
    cut = whole.copy()
    cut[-2:, :] = 255 - cut[-2:, :]  # pixels in no patch: the features do not change
    cut[:, -2:] = 255 - cut[:, -2:]
    with Engine.from_workflow(family, folder) as engine:
        assert engine.input_processor.image_size == (32, 32)
        got = dense(engine, images)
        a, b = dense(engine, [Image.fromarray(whole), Image.fromarray(cut)])
    want = ref.image(images)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4
    assert np.abs(a - b).max() <= 1e-6


def test_clip_legacy_eos_token_id_pools_the_highest_token_id(clip_path: Path, tmp_path: Path) -> None:
    """Configs from before transformers #24773 say eos_token_id 2; transformers then pools at the highest id."""
    folder = tmp_path / "legacy-eos"
    shutil.copytree(clip_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = 2
    (folder / "config.json").write_text(json.dumps(cfg))
    ref = Reference(folder)
    with Engine.from_workflow("clip", folder) as engine:
        got = dense(engine, CAPTIONS)
    assert np.abs(got - ref.text(CAPTIONS)).max() <= 1e-4


def test_siglip_without_padding_equals_the_unpadded_reference(siglip: Engine, siglip_path: Path,
                                                              siglip_ref: Reference) -> None:
    """`pad_text: none` embeds the unpadded tokens. sentence-transformers pads a batch to its longest text with an
    attention mask (not as SigLIP was trained), so it agrees with this for texts sent one at a time, and with both
    workflows for images."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(siglip_path), device="cpu")
    with Engine.from_workflow("siglip", siglip_path, request_processor={"params": {"pad_text": "none"}}) as engine:
        out = engine.encode(CAPTIONS, RAW)
        got = np.stack([o.outputs["dense"] for o in out])
    assert [o.prompt_token_ids[-1] for o in out] == [siglip_ref.tokenizer.eos_token_id] * 3
    assert np.abs(got - siglip_ref.text(CAPTIONS, pad=False)).max() <= 1e-4
    assert np.abs(got - np.stack([st.encode([t])[0] for t in CAPTIONS])).max() <= 1e-4
    images = [scene(k) for k in range(3)]
    assert np.abs(st.encode(images) - dense(siglip, images)).max() <= 1e-4


def test_sentence_transformers_clip_module(clip: Engine, clip_path: Path) -> None:
    """sentence-transformers (>= 5.4) loads the folder as a multimodal Transformer module calling
    get_text_features / get_image_features; its embeddings are WDE's."""
    import warnings

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import CLIPModel

    images = [scene(k) for k in range(3)] + odd_images()[:3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        legacy = SentenceTransformer(modules=[CLIPModel(str(clip_path))], device="cpu")  # the deprecated module
    for st in (SentenceTransformer(str(clip_path), device="cpu"), legacy):
        assert np.abs(st.encode(CAPTIONS) - dense(clip, CAPTIONS)).max() <= 1e-4
        assert np.abs(st.encode(images) - dense(clip, images)).max() <= 1e-4


# -- preprocessing ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_preprocessing_equals_the_image_processor_pixel_for_pixel(family: str, request: pytest.FixtureRequest) -> None:
    engine, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    pre = engine.input_processor.preprocessor
    for mode in MODES:
        for width, height in SIZES:
            image = image_of_mode(mode, width, height, seed=width * height)
            want = ref.pixels([image])[0]
            got = pre(image)
            assert got.dtype == np.float32 and got.shape == want.shape, (mode, width, height)
            assert np.abs(got - want).max() <= 1e-6, (mode, width, height)
            data, opened = reopened(image)
            pixels = engine.input_processor.preprocess(engine.input_processor.image_prompt(data, "input"))
            assert np.abs(pixels - ref.pixels([opened])[0]).max() <= 1e-6, (mode, width, height)


def test_legacy_preprocessor_config_reads_as_transformers_reads_it(clip_path: Path, tmp_path: Path) -> None:
    """openai/clip-vit-* ship `"size": 224, "crop_size": 224` and `feature_extractor_type`: read by transformers'
    rules (shortest edge, square crop)."""
    folder = tmp_path / "legacy-preprocessor"
    shutil.copytree(clip_path, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "CLIPFeatureExtractor", "size": 30, "crop_size": 30, "do_center_crop": True,
        "do_normalize": True, "do_resize": True, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    ref = Reference(folder)
    with Engine.from_workflow("clip", folder) as engine:
        for image in odd_images():
            assert np.abs(engine.input_processor.preprocessor(image) - ref.pixels([image])[0]).max() <= 1e-6


@pytest.mark.parametrize("family", ["clip", "siglip", "siglip2"])
def test_a_folder_saved_by_transformers_5_reads_its_processor_config(family: str, request: pytest.FixtureRequest,
                                                                     tmp_path: Path) -> None:
    """transformers 5 saves a processor as processor_config.json with the image processor nested under
    "image_processor", and no preprocessor_config.json: such a folder serves the same vectors as the original."""
    if family == "siglip2":
        original = build_siglip2(tmp_path / "original")
    else:
        original = request.getfixturevalue(f"{family}_path")
    folder = saved_as_processor(original, tmp_path / "saved")
    images = [encoded(image_of_mode("RGB", 23 + 7 * i, 41 - 5 * i, seed=i)) for i in range(4)]
    inputs = [*images, CAPTIONS[0]]
    with Engine.from_workflow(None, original) as before, Engine.from_workflow(None, folder) as after:
        assert after.workflow.name == family
        assert np.array_equal(dense(before, inputs), dense(after, inputs))
        if family != "siglip2":
            ref = Reference(folder)
            for data in images:
                got = after.input_processor.preprocess(after.input_processor.image_prompt(data, "input"))
                assert np.abs(got - ref.pixels([Image.open(io.BytesIO(data))])[0]).max() <= 1e-6


def test_processor_config_wins_over_preprocessor_config_as_in_transformers(clip_path: Path, tmp_path: Path) -> None:
    """With both files, transformers reads the nested processor_config.json entry; so does WDE (a stale
    preprocessor_config.json beside it is ignored, by both)."""
    folder = saved_as_processor(clip_path, tmp_path / "both")
    stale = json.loads(json.dumps(json.loads((folder / "processor_config.json").read_text())["image_processor"]))
    stale["image_mean"], stale["crop_size"], stale["size"] = [0.0, 0.0, 0.0], {"height": 12, "width": 12}, {"shortest_edge": 12}
    (folder / "preprocessor_config.json").write_text(json.dumps(stale))
    ref = Reference(folder)
    with Engine.from_workflow("clip", folder) as engine:
        assert engine.input_processor.image_size == (30, 30)
        for image in odd_images():
            assert np.abs(engine.input_processor.preprocessor(image) - ref.pixels([image])[0]).max() <= 1e-6
    (folder / "processor_config.json").unlink()
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match="neither a preprocessor_config.json nor a processor_config.json"):
        Engine.from_workflow("clip", folder)


def test_exif_orientation_is_applied_as_load_image_does(clip: Engine, clip_ref: Reference) -> None:
    data, upright = exif_rotated_jpeg(41, 29)
    got = clip.input_processor.preprocess(clip.input_processor.image_prompt(data, "input"))
    assert np.abs(got - clip_ref.pixels([upright])[0]).max() <= 1e-6


# -- batches ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_mixed_batch_equals_separate_calls(family: str, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(family)
    images = [image_of_mode("RGB", 31 + i, 29 + 2 * i, seed=i) for i in range(22)]  # 22 x 26 tokens: split on 2 cores
    texts = CAPTIONS * 3
    mixed: list[Any] = []
    for i, image in enumerate(images):
        mixed.append(image)
        if i < len(texts):
            mixed.append(texts[i])
    got = dense(engine, mixed)
    is_image = [isinstance(x, Image.Image) for x in mixed]
    assert np.abs(got[[i for i, m in enumerate(is_image) if m]] - dense(engine, images)).max() <= 1e-5
    assert np.abs(got[[i for i, m in enumerate(is_image) if not m]] - dense(engine, texts)).max() <= 1e-5
    outs = engine.encode(mixed[:2], RAW)
    assert outs[0].num_prompt_tokens == 26 - (family == "siglip") and outs[0].prompt_token_ids == []


def test_model_input_split_and_select_keep_pixels_with_their_sequences() -> None:
    lens, mask = [3, 5, 5, 2, 5, 4], [False, True, True, False, True, False]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    ids = torch.arange(int(cu[-1]))
    positions = torch.cat([torch.arange(n) for n in lens])
    pixels = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 3, 2, 2)
    batch = ModelInput(ids, positions, cu, lens, 5, None, [PoolingParams()] * 6, pixels, mask)
    pieces = batch.split(3)
    assert [p.image_mask for p in pieces] and sum(p.num_seqs for p in pieces) == 6
    assert torch.equal(torch.cat([p.pixel_values for p in pieces if p.pixel_values is not None]), pixels)
    (t_idx, text), (i_idx, image) = batch.by_modality()
    assert t_idx == [0, 3, 5] and i_idx == [1, 2, 4]
    assert text.seq_lens == [3, 2, 4] and text.input_ids.tolist() == [0, 1, 2, 13, 14, 20, 21, 22, 23]
    assert image.pixel_values[:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0] and image.cu_seqlens.tolist() == [0, 5, 10, 15]
    odd = batch.select([4, 1])
    assert odd.pixel_values[:, 0, 0, 0].tolist() == [2.0, 0.0] and odd.image_mask == [True, True]


# -- accepted shapes and refused images -------------------------------------------------------------------------------

def test_every_accepted_image_shape_gives_the_same_embedding(clip_path: Path, tmp_path: Path) -> None:
    image = image_of_mode("RGB", 41, 29)
    data = encoded(image)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    uri = f"data:image/png;base64,{b64}"
    shapes = [data, bytearray(data), memoryview(data), Image.open(io.BytesIO(data)), path, uri, {"image": data},
              {"image": uri}, {"image": b64}, {"image": str(path)}, {"image": Image.open(path)}]
    with Engine.from_workflow("clip", clip_path, input_processor={"params": {"allow_local_paths": True}}) as engine:
        # alone, each shape's batch is the same tensor shape: bit for bit the same pixels give the same vector
        alone = np.stack([dense(engine, [shape])[0] for shape in shapes])
        assert np.abs(alone - alone[0]).max() == 0.0
        # in one batch, rows of one GEMM agree within the batch tolerance, not bit for bit (a GEMM's last bits
        # follow a row's place in its blocking: 2.7e-7 under the AVX2 cap)
        vectors = dense(engine, shapes)
        assert np.abs(vectors - alone[0]).max() <= BATCH_TOLERANCE
        single = engine.embed(data)
        assert single.shape == (24,) and np.isclose(np.linalg.norm(single), 1.0)
        assert engine.embed({"image": uri}).shape == (24,) and engine.embed(["a", path]).shape == (2, 24)


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (a decompression bomb is exactly such a header)."""
    png = encoded(Image.new("L", (1, 1)))
    ihdr = png.index(b"IHDR")
    body = png[ihdr:ihdr + 4] + struct.pack(">II", width, height) + png[ihdr + 12:ihdr + 17]
    return png[:ihdr] + body + struct.pack(">I", zlib.crc32(body)) + png[ihdr + 21:]


BAD = [
    (b"hello, I am not an image", BAD_IMAGE, "is not an image"),
    (encoded(image_of_mode("RGB", 64, 64))[:400], BAD_IMAGE, "truncated or corrupt"),
    (_png_claiming(8000, 8000), TOO_LARGE, "64000000 pixels; the limit is 33554432"),
    (_png_claiming(30000, 30000), TOO_LARGE, "decompression bomb"),
    (encoded(Image.new("F", (5, 5)), "TIFF"), BAD_IMAGE, "mode 'F'"),
    (encoded(Image.new("I", (5, 5)), "TIFF"), BAD_IMAGE, "mode 'I'"),
    ({"image": "https://example.com/cat.png"}, BAD_IMAGE, "does not fetch images"),
    ({"image": "data:image/png,abc"}, BAD_IMAGE, "without ';base64'"),
    ({"image": "not base64 !!"}, BAD_IMAGE, "not valid base64"),
    ("data:image/png;base64,AAAA", BAD_IMAGE, "is not an image"),
    ({"image": b"", "text": "x"}, "validation", "cannot also have ['text']"),
    (b"", "empty", "is empty"),
    ({"image": "/etc/hostname"}, BAD_IMAGE, "not valid base64"),  # a path string needs allow_local_paths
    (3.5, "validation", "must be a text or an image"),
]


@pytest.mark.parametrize("bad,kind,reason", BAD, ids=[r for _, _, r in BAD])
def test_bad_images_are_refused_naming_the_input(clip: Engine, bad: Any, kind: str, reason: str) -> None:
    with pytest.raises(RequestError) as info:
        clip.encode(["a caption", bad, "another caption"])
    message = str(info.value)
    assert message.startswith("input[1]: input") and reason in message, message
    assert info.value.kind == kind
    assert not clip.has_unfinished()
    assert dense(clip, ["a caption", image_of_mode("L", 9, 9)]).shape == (2, 24)  # the engine goes on


def test_byte_limit_is_checked_before_decoding(clip_path: Path) -> None:
    data = encoded(image_of_mode("RGB", 200, 200))
    params = {"params": {"max_image_bytes": len(data) - 1, "max_image_pixels": 40_000}}
    with Engine.from_workflow("clip", clip_path, input_processor=params) as engine:
        for form in (data, {"image": base64.b64encode(data).decode()}):
            with pytest.raises(RequestError, match=r"image size limit is \d+ bytes") as info:
                engine.make_request(form)
            assert info.value.kind == TOO_LARGE
        with pytest.raises(RequestError, match="40401 pixels; the limit is 40000"):
            engine.make_request(Image.new("RGB", (201, 201)))


def test_a_prepared_image_of_the_wrong_shape_is_refused(clip: Engine) -> None:
    with pytest.raises(RequestError, match="float32 array of shape"):
        clip.make_request(ImagePrompt(np.zeros((3, 8, 8), np.float32), 26))


def test_admission_checks_only_the_header_and_pixels_are_made_when_scheduled(clip: Engine, clip_path: Path) -> None:
    """A queued image holds its file, not its pixels (as a queued text holds no tokens); a large one is decoded on
    the scheduler's background thread and gives the same embedding."""
    data = encoded(image_of_mode("RGB", 300, 200))
    request = clip.make_request({"image": data})
    assert isinstance(request.prompt, ImagePrompt) and request.prompt.data == data
    assert request.prompt.pixels == 60_000 and request.prompt.num_tokens == 26
    small = [encoded(image_of_mode("RGB", 20 + i, 25)) for i in range(3)]
    want = dense(clip, [data, *small])
    params = {"params": {"background_image_pixels": 10_000, "workers": 2}}
    with Engine.from_workflow("clip", clip_path, request_processor=params) as engine:
        assert engine.components["request_processor"].is_large(engine.make_request(data))
        assert np.abs(dense(engine, [data, *small]) - want).max() <= 1e-6


def test_text_only_workflows_are_unchanged(tiny_bert: Path) -> None:
    """A text workflow never sees image inputs: bytes are not a text."""
    with Engine.from_workflow("bert", tiny_bert, pooler={"params": {"pooling": "mean"}}) as engine:
        with pytest.raises(RequestError, match="must be a string"):
            engine.encode([b"\x89PNG"])
        assert engine.input_builder.name == "packed"


# -- docs -------------------------------------------------------------------------------------------------------------

def test_docs_search_example_runs(clip_path: Path, clip_ref: Reference, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/images.md's text→image search example, verbatim but for the model folder, on the tiny CLIP: its scores
    are the cosine similarities of transformers' features, and its ranking theirs."""
    doc = (ROOT / "docs/images.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Example: text→image search"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    files = ["red.png", "blue.png", "stripes.png"]
    for kind, name in enumerate(files):
        scene(kind).save(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(code.replace('"openai/clip-vit-base-patch32"', repr(str(clip_path))), "docs/images.md", "exec"),
         namespace)
    namespace["clip"].close()
    text = clip_ref.text(namespace["captions"])
    image = clip_ref.image([Image.open(tmp_path / f) for f in files])
    cosine = (text / np.linalg.norm(text, axis=1, keepdims=True)) @ (image / np.linalg.norm(image, axis=1,
                                                                                          keepdims=True)).T
    assert np.abs(namespace["scores"] - cosine).max() <= 1e-5
    assert namespace["ranking"] == [[files[j] for j in np.argsort(-row, kind="stable")] for row in cosine]
