"""A Hugging Face config read under other attribute names, so the shared blocks (which read BERT's names:
`hidden_size`, `num_attention_heads`, `intermediate_size`, `hidden_act`, `layer_norm_eps`, ...) serve a family
whose config names them differently (DistilBERT's `dim`, `n_heads`, `hidden_dim`, `activation`)."""

from __future__ import annotations

from typing import Any


class ConfigView:
    """`cfg` with `names` set on top: `ConfigView(cfg, hidden_size=cfg.dim, layer_norm_eps=1e-12)` reads
    `hidden_size` and `layer_norm_eps` from the keywords and every other attribute from `cfg`."""

    def __init__(self, cfg: object, **names: Any) -> None:
        self._cfg = cfg
        self.__dict__.update(names)

    def __getattr__(self, name: str) -> Any:
        if name == "_cfg":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._cfg, name)
