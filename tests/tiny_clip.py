"""Tiny random CLIP and SigLIP folders (model, tokenizer and image processor saved together), and generated images
of odd sizes and modes for the preprocessing tests. No weights are committed: everything is built in seconds."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.tiny_models import corpus

CAPTIONS = ["a red square on white", "a blue circle in the dark", "green stripes across the field"]


def clip_tokenizer():
    """A byte-level BPE trained on the tiny corpus with CLIP's normalizer and pre-tokenizer, wrapped in
    transformers' CLIPTokenizer (which rebuilds CLIP's pipeline around the vocabulary and merges)."""
    from transformers import CLIPTokenizer

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tk = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="</w>", unk_token=eos))
    tk.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                          normalizers.Lowercase()])
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
                                   r"""[^\s\p{L}\p{N}]+"""), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.train_from_iterator(corpus() + CAPTIONS * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[bos, eos], end_of_word_suffix="</w>",
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tk.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=40)


def siglip_tokenizer(pad_token: str = "</s>", max_length: int = 32, padding_side: str = "right"):
    """A Unigram tokenizer (SentencePiece style: lowercase, Metaspace) appending `</s>`, with `</s>` as the pad
    token as SigLIP's has (SigLIP 2's Gemma tokenizer pads with `<pad>`, id 0), as a fast tokenizer (SigLIP's own
    class needs the sentencepiece package)."""
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.Unigram())
    tk.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator(corpus() + CAPTIONS * 5, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tk.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", pad_token=pad_token, unk_token="<unk>",
                                   model_max_length=max_length, padding_side=padding_side)


def _jitter(model: torch.nn.Module, seed: int) -> None:
    """Random norms, biases and class/probe vectors too (a default init leaves LayerNorms at 1/0, which would hide
    a norm or a bias that is skipped)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _save(folder: Path, model_cls: type, cfg: object, jitter_seed: int, tokenizer: object | None,
          preprocessor: dict) -> Path:
    """`model_cls(cfg)` from seed 0 with jittered norms and biases, saved to `folder` with the tokenizer (when not
    saved already) and `preprocessor` as preprocessor_config.json."""
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    _jitter(model, jitter_seed)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return folder


def build_clip(folder: Path, *, eos_token_id: int | None = None, text_hidden: int = 32, vision_hidden: int = 32,
               act: str = "quick_gelu", image_size: int = 30, patch_size: int = 6) -> Path:
    from transformers import CLIPConfig, CLIPModel

    tok = clip_tokenizer()
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=40, hidden_act=act,
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id if eos_token_id is None else eos_token_id),
        vision_config=dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=2,
                           num_attention_heads=4, image_size=image_size, patch_size=patch_size, hidden_act=act),
        projection_dim=24)
    cfg.architectures = ["CLIPModel"]
    return _save(folder, CLIPModel, cfg, 1, tok, {
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": image_size},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True})


def build_siglip(folder: Path, *, image_size: int = 30, patch_size: int = 6) -> Path:
    from transformers import SiglipConfig, SiglipModel

    tok = siglip_tokenizer()
    cfg = SiglipConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, projection_size=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=image_size, patch_size=patch_size))
    cfg.architectures = ["SiglipModel"]
    return _save(folder, SiglipModel, cfg, 2, tok, {
        "image_processor_type": "SiglipImageProcessor", "do_resize": True,
        "size": {"height": image_size, "width": image_size},
        "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True})


SIGLIP2_PATCH, SIGLIP2_MAX_PATCHES = 4, 24
"""The tiny SigLIP 2's patch size and its image processor's max_num_patches (its position table is 4 x 4)."""


def build_siglip2(folder: Path, *, padding_side: str = "right", max_num_patches: int = SIGLIP2_MAX_PATCHES) -> Path:
    """A tiny random Siglip2Model (NaFlex) folder: 4-pixel patches, a 4 x 4 position grid resized per image, and a
    Siglip2ImageProcessor making at most `max_num_patches` patches; texts padded to 64 tokens with `<pad>`."""
    from transformers import AutoTokenizer, Siglip2Config, Siglip2Model

    siglip_tokenizer(pad_token="<pad>", max_length=64, padding_side=padding_side).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "siglip2"}))  # replaced by the model's below
    tok = AutoTokenizer.from_pretrained(folder)  # in a siglip2 folder a Siglip2Tokenizer, which adds <bos>, <mask>
    cfg = Siglip2Config(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, projection_size=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_patches=16, patch_size=SIGLIP2_PATCH))
    cfg.architectures = ["Siglip2Model"]
    return _save(folder, Siglip2Model, cfg, 3, None, {
        "image_processor_type": "Siglip2ImageProcessor", "do_resize": True, "patch_size": SIGLIP2_PATCH,
        "max_num_patches": max_num_patches, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True})


def saved_as_processor(folder: Path, out: Path) -> Path:
    """`folder` saved again the way transformers 5 saves a model with its processor: the model's files, then
    `AutoProcessor.save_pretrained`, which writes the image processor's settings nested in processor_config.json
    (under "image_processor") and no preprocessor_config.json."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    out.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file() and f.name != "preprocessor_config.json":
            (out / f.name).write_bytes(f.read_bytes())
    processor.save_pretrained(out)
    assert not (out / "preprocessor_config.json").exists(), "this transformers saves processors as release 4 did"
    assert "image_processor" in json.loads((out / "processor_config.json").read_text())
    return out


# -- images --------------------------------------------------------------------------------------------------------

def gradient(width: int, height: int, seed: int = 0) -> np.ndarray:
    """[height, width, 3] uint8: smooth gradients plus noise, so resizing has something to get wrong."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


def image_of_mode(mode: str, width: int, height: int, seed: int = 0):
    """A PIL image of `mode` (RGB, RGBA, L, LA, P, P with transparency, CMYK, I;16, 1, YCbCr) and this size."""
    from PIL import Image

    rgb = Image.fromarray(gradient(width, height, seed))
    if mode == "RGBA":
        alpha = Image.fromarray(gradient(width, height, seed + 1)[..., 0])
        out = rgb.copy()
        out.putalpha(alpha)
        return out
    if mode == "LA":
        out = rgb.convert("L").convert("LA")
        out.putalpha(Image.fromarray(gradient(width, height, seed + 1)[..., 1]))
        return out
    if mode == "P+transparency":
        out = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        out.info["transparency"] = 3
        return out
    if mode == "I;16":
        values = gradient(width, height, seed)[..., 0].astype("<u2") * 2  # half of it over 255 (Pillow clips those)
        return Image.fromarray(values)
    if mode == "P":
        return rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    return rgb.convert(mode)


def encoded(image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def exif_rotated_jpeg(width: int, height: int):
    """(JPEG bytes of a width x height picture whose EXIF orientation says "rotate 90° clockwise to view", the
    picture as viewed: height x width, what transformers' `load_image` gives)."""
    from PIL import Image, ImageOps

    exif = Image.Exif()
    exif[0x0112] = 6
    data = encoded(image_of_mode("RGB", width, height), "JPEG", exif=exif.tobytes())
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert upright.size == (height, width)
    return data, upright


def scene(kind: int, size: int = 37):
    """Three easily told apart pictures for the search example: a red square, a blue disc, green stripes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size + 5), "white")
    draw = ImageDraw.Draw(image)
    if kind == 0:
        draw.rectangle([8, 8, size - 8, size - 4], fill="red")
    elif kind == 1:
        image.paste("black", (0, 0, size, size + 5))
        draw.ellipse([6, 8, size - 6, size - 2], fill="blue")
    else:
        for x in range(0, size, 6):
            draw.rectangle([x, 0, x + 2, size + 5], fill="green")
    return image
