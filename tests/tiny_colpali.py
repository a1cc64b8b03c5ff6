"""Tiny random ColPali (`ColPaliForRetrieval`: SigLIP vision tower + Gemma) and ColQwen2 (`ColQwen2ForRetrieval`:
Qwen2-VL) folders, each saved with its processor (`ColPaliProcessor` / `ColQwen2Processor.save_pretrained`) and a
tokenizer trained here, so WDE and transformers read the same files. No weights are committed: each folder is built
in a second or two."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.tiny_models import corpus

QUERIES = ["what is the revenue of the company", "a chart of water use per day", "who wrote the first page",
           "berlin paris"]


def _bpe(specials: list[str], vocab_size: int = 500) -> Tokenizer:
    """A byte-level BPE trained on the tiny corpus, its special tokens first."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus() + QUERIES * 5 + ["Describe the image.", "Question: ", "Query: "] * 20,
                           trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def paligemma_tokenizer():
    """Gemma's special tokens (<pad> 0, <eos> 1, <bos> 2, <unk> 3) and, as Gemma's tokenizer, <bos> added in front of
    every text (the processor turns that off: its prompts hold <bos> themselves); the processor adds <image> and the
    1,152 <locNNNN> / <segNNN> tokens when it is built."""
    from tokenizers import processors
    from transformers import GemmaTokenizerFast

    tk = _bpe(["<pad>", "<eos>", "<bos>", "<unk>"])
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return GemmaTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                              unk_token="<unk>", padding_side="right", model_max_length=256, add_bos_token=True)


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]


def qwen2_tokenizer(padding_side: str = "right"):
    """Qwen2-VL's special tokens (<|endoftext|> is also the pad token, as Qwen2's)."""
    from transformers import PreTrainedTokenizerFast

    tk = _bpe(QWEN_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side=padding_side, model_max_length=512,
                                   extra_special_tokens={"image_token": "<|image_pad|>",
                                                         "vision_start_token": "<|vision_start|>",
                                                         "vision_end_token": "<|vision_end|>"})


def _jitter(model: torch.nn.Module, seed: int) -> None:
    """Random norms and biases too (a default init leaves norms at 1 and biases at 0, which would hide one that is
    skipped)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def build_colpali(folder: Path, *, image_size: int = 28, patch_size: int = 14, embedding_dim: int = 24) -> Path:
    """A ColPali folder: SigLIP vision tower (image_size / patch_size squared image tokens), a 2-layer Gemma, a
    projection to `embedding_dim`; its processor (SigLIP image processor at `image_size`, `image_seq_length` set)."""
    from transformers import (ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, GemmaConfig, PaliGemmaConfig,
                              SiglipImageProcessor, SiglipVisionConfig)

    folder.mkdir(parents=True, exist_ok=True)
    tok = paligemma_tokenizer()
    seq = (image_size // patch_size) ** 2
    image_processor = SiglipImageProcessor(size={"height": image_size, "width": image_size}, resample=3,
                                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor.image_seq_length = seq
    processor = ColPaliProcessor(image_processor=image_processor, tokenizer=tok)
    vocab = len(processor.tokenizer)
    image_id = processor.image_token_id
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=image_size, patch_size=patch_size)
    text = GemmaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vlm = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=image_id,
                          vocab_size=vocab, projection_dim=32, hidden_size=32)
    cfg = ColPaliConfig(vlm_config=vlm.to_dict(), embedding_dim=embedding_dim)
    torch.manual_seed(0)
    model = ColPaliForRetrieval(cfg).eval()
    _jitter(model, 1)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    # as the hub's PaliGemma tokenizers are saved: <bos> in front of every text by default (the processor turns it
    # off when it loads; WDE tokenizes its prompts without special tokens)
    processor.tokenizer.add_bos_token = True
    processor.tokenizer.save_pretrained(folder)
    return folder


def build_colqwen2(folder: Path, *, min_pixels: int = 28 * 28, max_pixels: int = 28 * 28 * 16,
                   embedding_dim: int = 24) -> Path:
    """A ColQwen2 folder: a 2-layer Qwen2-VL vision tower (patch 14, 2x2 merge) and text model, a projection to
    `embedding_dim`; its processor (Qwen2-VL image processor with `min_pixels` / `max_pixels`)."""
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    tok = qwen2_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    processor = ColQwen2Processor(image_processor=image_processor, tokenizer=tok)
    vocab = len(tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    vlm = Qwen2VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    cfg = ColQwen2Config(vlm_config=vlm.to_dict(), embedding_dim=embedding_dim)
    torch.manual_seed(0)
    model = ColQwen2ForRetrieval(cfg).eval()
    _jitter(model, 2)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def page_image(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A random RGB "page" of this size, encoded."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()
