"""Rotary encoders (NomicBERT, GTE-multilingual, EuroBERT) and the public rotary building block match
transformers on tiny random weights (fp32 CPU, max abs diff <= 1e-4).

Models are built with `save_pretrained` from random configs (norms and biases randomized too, so a mis-loaded one
shows); tokenizers are trained on the fly. References run transformers on one right-padded batch of texts of
varied lengths; WDE packs the same texts (several sequences per batch), and a text alone gives what it gives in a
batch. Folders saved by sentence-transformers itself check the whole pipeline and the pick by architecture.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import tiny_decoders
from tests.tiny_models import bert_tokenizer, varied_texts, xlmr_tokenizer
from wde import Engine
from wde.errors import ModelLoadError

TOL = 1e-4
TEXTS = varied_texts(24, seed=11)
TOKENS = ["pooler.params.pooling=all", "pooler.params.normalize=false"]
"""Overrides that make any of these workflows return each token's last hidden state."""


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random norm weights and biases: the default init (ones, zeros) would hide one that is not loaded. q and k
    are scaled up so attention is peaked and the rotary layout and mask show plainly in the states."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
            elif "norm" in name.lower() and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def _save(model: torch.nn.Module, tok, out: Path) -> Path:  # noqa: ANN001
    tok.model_max_length = 512
    _randomize(model).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def llama3_style_tokenizer():
    """A byte-level BPE framing every input as EuroBERT's does: <|begin_of_text|> ... <|end_of_text|>."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|mask|>"]
    tk = tiny_decoders._trained_bpe(specials)
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|end_of_text|>",
        pair="<|begin_of_text|> $A <|end_of_text|> $B:1 <|end_of_text|>:1",
        special_tokens=[("<|begin_of_text|>", 0), ("<|end_of_text|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                   pad_token="<|end_of_text|>", mask_token="<|mask|>", model_max_length=512)


def build_nomic(out: Path) -> Path:
    """NomicBertModel: 2 layers, hidden 64, 4 heads, SwiGLU 96, two token types, RoPE theta 1000 (its default)."""
    from transformers import NomicBertConfig, NomicBertModel

    torch.manual_seed(1)
    tok = bert_tokenizer()
    cfg = NomicBertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=96, max_position_embeddings=512, type_vocab_size=2)
    return _save(NomicBertModel(cfg), tok, out)


def build_gte(out: Path, **config) -> Path:
    """GteModel: 2 layers, hidden 64, 4 heads, gated GELU 96, one token type, RoPE theta 160000 (its default)."""
    from transformers import GteConfig, GteModel

    torch.manual_seed(2)
    tok = xlmr_tokenizer()
    values = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96, max_position_embeddings=512, type_vocab_size=1, pad_token_id=1)
    return _save(GteModel(GteConfig(**{**values, **config})), tok, out)


def build_gte_variant(out: Path) -> Path:
    """GTE without token type embeddings (gte-base-en-v1.5's `type_vocab_size: 0`) and with linear RoPE scaling."""
    return build_gte(out, type_vocab_size=0,
                     rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})


def build_eurobert(out: Path) -> Path:
    """EuroBertModel: 2 layers, hidden 64, 4 query heads over 2 key/value heads, every bias on, theta 250000."""
    from transformers import EuroBertConfig, EuroBertModel

    torch.manual_seed(3)
    tok = llama3_style_tokenizer()
    cfg = EuroBertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512,
                         attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 250000.0},
                         bos_token_id=0, eos_token_id=1, pad_token_id=1, mask_token_id=2)
    return _save(EuroBertModel(cfg), tok, out)


@dataclass(frozen=True)
class Family:
    build: Callable[[Path], Path]
    workflow: str
    model: str
    st_pooling: str | None = None
    """The Pooling mode of the sentence-transformers folder built from it (None: no ST-folder test)."""


FAMILIES = {
    "nomic_bert": Family(build_nomic, "nomic_bert", "nomic_bert", "mean"),
    "gte_multilingual": Family(build_gte, "gte_multilingual", "gte", "cls"),
    "gte_no_token_types_linear_rope": Family(build_gte_variant, "gte_multilingual", "gte"),
    "eurobert": Family(build_eurobert, "eurobert", "eurobert", "mean"),
}


class Reference:
    """transformers' model and tokenizer for a folder, and the last hidden states of each text (memoized)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._memo: dict[str, np.ndarray] = {}

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def hidden(self, texts: list[str]) -> list[np.ndarray]:
        todo = sorted({t for t in texts if t not in self._memo})
        if todo:
            enc = self.tokenizer(todo, padding=True, return_tensors="pt")
            names = {"input_ids", "attention_mask", "token_type_ids"} & set(enc)
            with torch.inference_mode():
                states = self.model(**{k: enc[k] for k in names}).last_hidden_state.numpy()
            for t, mask, h in zip(todo, enc["attention_mask"], states):
                self._memo[t] = h[:int(mask.sum())]
        return [self._memo[t] for t in texts]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: fam.build(tmp_path_factory.mktemp(name) / "model") for name, fam in FAMILIES.items()}


@pytest.fixture(scope="module")
def refs(folders: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(path) for name, path in folders.items()}


def _max_diff(outs: list[np.ndarray], refs: list[np.ndarray]) -> float:
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape, (o.shape, r.shape)
    return max(float(np.abs(o - r).max()) for o, r in zip(outs, refs))


def _token_states(engine: Engine, texts: list[str]) -> tuple[list[np.ndarray], list[list[int]]]:
    outs = engine.encode(texts)
    return [o.outputs["token_embeddings"] for o in outs], [o.prompt_token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_states_match_transformers(family: str, folders: dict[str, Path], refs: dict[str, Reference]) -> None:
    """Every token's last hidden state, packed batches through each CPU attention backend; a text alone equals
    itself in a batch."""
    fam, ref = FAMILIES[family], refs[family]
    expected = ref.hidden(TEXTS)
    diffs = {}
    for attention in ("auto", "torch_sdpa", "cpu_varlen"):
        with Engine.from_workflow(fam.workflow, folders[family], overrides=[*TOKENS, f"attention.name={attention}"],
                                  scheduler={"params": {"max_num_requests": 8}}) as engine:
            assert engine.components["model"].name == fam.model
            assert engine.components["model"].causal is False
            states, ids = _token_states(engine, TEXTS)
            alone = [_token_states(engine, [t])[0][0] for t in TEXTS[:3]]
        assert ids == [ref.ids(t) for t in TEXTS]
        diffs[attention] = _max_diff(states, expected)
        assert _max_diff(alone, states[:3]) <= 1e-5
    print(f"{family}: max abs diff vs transformers {diffs}")
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("family", [f for f, fam in FAMILIES.items() if fam.st_pooling])
def test_sentence_transformers_folder(family: str, folders: dict[str, Path],
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """A folder saved by sentence-transformers (Transformer → Pooling → Normalize) picks its workflow from
    `architectures` and gives `SentenceTransformer(folder).encode`'s vectors."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer import modules as models  # sentence-transformers >= 6
    except ImportError:
        from sentence_transformers import models

    fam = FAMILIES[family]
    transformer = models.Transformer(str(folders[family]))
    st = SentenceTransformer(modules=[transformer, models.Pooling(64, fam.st_pooling), models.Normalize()],
                             device="cpu")
    out = tmp_path_factory.mktemp(f"st-{family}") / "model"
    st.save(str(out))
    expected = SentenceTransformer(str(out), device="cpu").encode(TEXTS, batch_size=8, convert_to_numpy=True)
    with Engine.from_workflow(None, out) as engine:
        assert engine.workflow.name == fam.workflow
        got = engine.embed(TEXTS)
    diff = float(np.abs(got - expected).max())
    print(f"{family}: ST folder max abs diff {diff:.2e}")
    assert got.shape == expected.shape and diff <= TOL


# --- original (remote-code) checkpoint layouts -------------------------------------------------------------------

def _copy(src: Path, dst: Path, rename: Callable[[dict], dict], config: Callable[[dict], dict] | None = None) -> Path:
    shutil.copytree(src, dst)
    save_file(rename(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(cfg), indent=2))
    return dst


def nomic_original_weights(w: dict) -> dict:
    """transformers' NomicBERT names → the original ones (transformers' conversion mapping, reversed)."""
    out = {}
    for name, t in w.items():
        if ".self_attn.q_proj." in name:
            base = name.replace(".self_attn.q_proj.", ".attn.Wqkv.")
            t = torch.cat([w[name], w[name.replace("q_proj", "k_proj")], w[name.replace("q_proj", "v_proj")]])
            name = base
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        for a, b in (("self_attn.o_proj", "attn.out_proj"), ("mlp.up_proj", "mlp.fc11"), ("mlp.gate_proj", "mlp.fc12"),
                     ("mlp.down_proj", "mlp.fc2"), ("post_attention_layernorm", "norm1"),
                     ("post_mlp_layernorm", "norm2"), ("embeddings.LayerNorm", "emb_ln")):
            name = name.replace(a, b)
        if name.startswith("layers."):
            name = "encoder." + name
        out[name] = t.contiguous()
    return out


def nomic_original_config(cfg: dict) -> dict:
    """The remote-code config keys nomic-embed-text-v1.5 ships (n_embd, rotary_emb_base, ...)."""
    return {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
            "n_embd": cfg["hidden_size"], "n_head": cfg["num_attention_heads"], "n_inner": cfg["intermediate_size"],
            "n_layer": cfg["num_hidden_layers"], "n_positions": 8192, "layer_norm_epsilon": cfg["layer_norm_eps"],
            "rotary_emb_base": cfg["rope_parameters"]["rope_theta"], "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "prenorm": False, "use_rms_norm": False,
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False,
            "type_vocab_size": cfg["type_vocab_size"], "vocab_size": cfg["vocab_size"], "pad_token_id": 0}


def gte_original_weights(w: dict) -> dict:
    """transformers' GTE names → the original `new.`-prefixed ones (qkv_proj, up_gate_proj: up rows first)."""
    out = {}
    for name, t in w.items():
        if ".self_attn.q_proj." in name:
            t = torch.cat([w[name], w[name.replace("q_proj", "k_proj")], w[name.replace("q_proj", "v_proj")]])
            name = name.replace(".self_attn.q_proj.", ".attention.qkv_proj.")
        elif ".mlp.up_proj." in name:
            t = torch.cat([w[name], w[name.replace("up_proj", "gate_proj")]])
            name = name.replace(".mlp.up_proj.", ".mlp.up_gate_proj.")
        elif any(f".{p}." in name for p in ("self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")):
            continue
        for a, b in (("self_attn.o_proj", "attention.o_proj"), ("post_attention_layernorm", "attn_ln"),
                     ("post_mlp_layernorm", "mlp_ln")):
            name = name.replace(a, b)
        if name.startswith("layers."):
            name = "encoder.layer." + name[len("layers."):]
        out["new." + name] = t.contiguous()
    return out


@pytest.mark.parametrize(("family", "rename", "config"), [
    ("nomic_bert", nomic_original_weights, None),
    ("nomic_bert", nomic_original_weights, nomic_original_config),
    ("gte_multilingual", gte_original_weights, None),
], ids=["nomic-original-weights", "nomic-original-weights-and-config", "gte-original-weights"])
def test_original_checkpoint_layouts(family: str, rename: Callable, config: Callable | None, folders: dict[str, Path],
                                     refs: dict[str, Reference], tmp_path: Path) -> None:
    """The hub folders' remote-code names load (fused Wqkv / qkv_proj whole, fc11/fc12 and up_gate_proj into the
    gated MLP), the original config keys are read, and transformers itself reads the renamed weights the same."""
    path = _copy(folders[family], tmp_path / "model", rename, config)
    expected = refs[family].hidden(TEXTS)
    if config is None:  # transformers reads these names through its own conversion mapping
        assert _max_diff(Reference(path).hidden(TEXTS), expected) <= 1e-6
    with Engine.from_workflow(None, path, overrides=TOKENS) as engine:
        assert engine.workflow.name == FAMILIES[family].workflow
        states, _ = _token_states(engine, TEXTS)
    assert _max_diff(states, expected) <= TOL


@pytest.mark.parametrize(("family", "config", "match"), [
    ("nomic_bert", {"rotary_emb_interleaved": True}, "rotary_emb_interleaved"),
    ("nomic_bert", {"rotary_emb_fraction": 0.5}, "rotary_emb_fraction"),
    ("nomic_bert", {"moe_every_n_layers": 2, "num_experts": 8}, "moe_every_n_layers"),
    ("gte_multilingual", {"rope_scaling": {"type": "ntk", "factor": 2.0}}, "rope_type 'ntk'"),
    ("gte_multilingual", {"logn_attention_scale": True}, "logn_attention_scale"),
    ("eurobert", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type 'dynamic'"),
])
def test_unimplemented_settings_are_refused_by_name(family: str, config: dict, match: str,
                                                    folders: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(folders[family], path)
    tiny_decoders.set_config(path, **config)
    with pytest.raises(ModelLoadError, match=match):
        Engine.from_workflow(FAMILIES[family].workflow, path)


def test_model_type_is_checked(folders: dict[str, Path]) -> None:
    """A NomicBERT folder in the gte model (biases it lacks) is refused, not half-loaded."""
    with pytest.raises(ModelLoadError, match="model_type"):
        Engine.from_workflow("nomic_bert", folders["nomic_bert"], overrides=["model.name=gte"])


def test_eurobert_masked_lm_checkpoint_serves_with_workflow(tmp_path: Path, refs: dict[str, Reference],
                                                          folders: dict[str, Path]) -> None:
    """EuroBertForMaskedLM (what the EuroBERT hub checkpoints declare): `model.` stripped, the LM head skipped;
    served with --workflow eurobert."""
    from transformers import AutoConfig, EuroBertForMaskedLM

    lm = EuroBertForMaskedLM(AutoConfig.from_pretrained(folders["eurobert"])).eval()
    lm.model.load_state_dict(refs["eurobert"].model.state_dict())
    lm.save_pretrained(tmp_path)
    refs["eurobert"].tokenizer.save_pretrained(tmp_path)
    with Engine.from_workflow("eurobert", tmp_path, overrides=TOKENS) as engine:
        states, _ = _token_states(engine, TEXTS[:6])
    assert _max_diff(states, refs["eurobert"].hidden(TEXTS[:6])) <= TOL


# --- the rotary building block -------------------------------------------------------------------------------------

def _packed(lens: list[int], heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), heads, head_dim, generator=g)
    positions = torch.cat([torch.arange(n) for n in lens])
    return x, positions


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_half_split_rotary_matches_gpt_neox(rotary_dim: int) -> None:
    """Half-split RoPE over packed sequences, whole heads and partial (GPT-NeoX's partial_rotary_factor)."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    from wde.api import RotaryEmbedding

    cfg = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": rotary_dim / 32})
    lens = [5, 17, 1, 40]
    x, positions = _packed(lens, 4, 32)
    rope = RotaryEmbedding(32, 5000.0, rotary_dim=rotary_dim)
    cos, sin = rope(positions, torch.float32)
    got = rope.apply(x, cos, sin)
    ref_rope = GPTNeoXRotaryEmbedding(cfg)
    for seq, start in zip(lens, np.cumsum([0, *lens[:-1]])):
        q = x[start:start + seq].transpose(0, 1)[None]  # [1, heads, seq, head_dim]
        rc, rs = ref_rope(q, torch.arange(seq)[None])
        expected, _ = apply_rotary_pos_emb(q, q, rc, rs)
        assert torch.allclose(got[start:start + seq], expected[0].transpose(0, 1), atol=1e-6)
    if rotary_dim < 32:
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("rotary_dim", [32, 8])
def test_interleaved_rotary_matches_gpt_j(rotary_dim: int) -> None:
    """Interleaved (GPT-J) RoPE over packed sequences, whole heads and GPT-J's partial `rotary_dim`."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    from wde.api import RotaryEmbedding, apply_rotary

    lens = [3, 29, 12]
    x, positions = _packed(lens, 2, 32, seed=1)
    rope = RotaryEmbedding(32, 10000.0, rotary_dim=rotary_dim, interleaved=True)
    cos, sin = rope(positions, torch.float32)
    got = rope.apply(x, cos, sin)
    assert torch.equal(got, apply_rotary(x, cos, sin, interleaved=True))
    sincos = create_sinusoidal_positions(64, rotary_dim)
    sin_ref, cos_ref = torch.split(sincos[positions], rotary_dim // 2, dim=-1)
    rot = apply_rotary_pos_emb(x[None, ..., :rotary_dim], sin_ref[None], cos_ref[None])[0]  # [1, tokens, heads, d]
    expected = torch.cat([rot, x[..., rotary_dim:]], dim=-1)
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, apply_rotary(x, *RotaryEmbedding(32, rotary_dim=rotary_dim)(positions,
                                                                                            torch.float32)))


def test_one_theta_per_instance_and_per_layer_type_config() -> None:
    """Per-layer theta is one instance per distinct theta; nested `rope_parameters` need a layer type."""
    from types import SimpleNamespace

    from wde.api import RotaryEmbedding

    cfg = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    local = RotaryEmbedding.from_config(cfg, 16, layer_type="sliding_attention")
    glob = RotaryEmbedding.from_config(cfg, 16, layer_type="full_attention")
    assert (local.theta, glob.theta) == (10000.0, 160000.0)
    positions = torch.arange(8)
    assert torch.equal(local(positions, torch.float32)[0], RotaryEmbedding(16, 10000.0)(positions, torch.float32)[0])
    assert not torch.allclose(local(positions, torch.float32)[1], glob(positions, torch.float32)[1])
    with pytest.raises(ModelLoadError, match="layer_type"):
        RotaryEmbedding.from_config(cfg, 16)
    with pytest.raises(ModelLoadError, match="rope_type 'longrope'"):
        RotaryEmbedding.from_config(SimpleNamespace(rope_parameters={"rope_type": "longrope"}), 16)
    with pytest.raises(ModelLoadError, match="rotary_dim"):
        RotaryEmbedding(16, rotary_dim=7)


def test_decoder_layers_keep_the_old_names() -> None:
    import wde.api
    from wde.components.models import decoder_layers, rotary

    assert decoder_layers.RotaryEmbedding is rotary.RotaryEmbedding is wde.api.RotaryEmbedding
    assert decoder_layers.apply_rotary is rotary.apply_rotary is wde.api.apply_rotary
