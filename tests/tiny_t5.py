"""Tiny random T5 encoders in sentence-transformers layout (T5 + Pooling + Dense + Normalize), built offline.

The tokenizer is a small Unigram model trained on the shared corpus and wrapped as a T5 fast tokenizer (`</s>`
appended, no BOS): parity is on the model, so any valid tokenizer with T5's template will do.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.tiny_models import corpus


def t5_tokenizer():
    from transformers import T5TokenizerFast

    tk = Tokenizer(models.Unigram())
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator(corpus(), trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    tk.decoder = decoders.Metaspace()
    return T5TokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0,
                           model_max_length=512)


def build_sentence_t5(out: Path, feed_forward_proj: str = "gated-gelu", seed: int = 0, bias_gain: float = 8.0) -> Path:
    """A sentence-T5-shaped folder: `d_kv * num_heads != d_model` and short bucket distances, so the head width,
    the logarithmic buckets and (scaled up by `bias_gain`) the relative bias all shape the result."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import T5Config, T5EncoderModel

    try:  # sentence-transformers >= 6 moved the module classes
        from sentence_transformers.sentence_transformer import modules as st_models
    except ImportError:
        from sentence_transformers import models as st_models

    torch.manual_seed(seed)
    tok = t5_tokenizer()
    cfg = T5Config(vocab_size=len(tok), d_model=64, d_kv=8, d_ff=128, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=16, relative_attention_max_distance=20,
                   feed_forward_proj=feed_forward_proj, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5EncoderModel(cfg).eval()
    with torch.no_grad():
        model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(bias_gain)
    hf = out / "hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[
        st_models.Transformer(str(hf)), st_models.Pooling(64, "mean"),
        st_models.Dense(64, 64, bias=False, activation_function=torch.nn.Identity()), st_models.Normalize()])
    st.save(str(out / "st"))
    return out / "st"
