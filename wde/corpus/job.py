"""What one `wde embed` run is: its inputs, fields, output and engine settings, as a pydantic model.

The job is what a resumed run must match (`fingerprint`), and what worker processes and Ray actors receive to
build their own engine, so it holds only plain values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INPUT_SUFFIXES = (".jsonl", ".parquet", ".txt")
OUTPUT_SUFFIXES = {".parquet": "a directory of part-NNNNNN.parquet shards (id + embedding columns)",
                   ".npy": "the float32 matrix only, rows in input order"}
OUTPUTS = ("dense", "sparse", "colbert")


class CorpusError(ValueError):
    """A bad input file, record or option: the message names the file and 1-based line, or the CLI flag."""


class EmbedJob(BaseModel):
    """One corpus embedding job (the `wde embed` options that decide what is written)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    inputs: tuple[str, ...] = Field(min_length=1, description="input files (.jsonl, .parquet, .txt)")
    output: str = Field(description="out.parquet (directory of shards) or out.npy")
    text_field: str | None = Field("text", description=(
        "jsonl key / parquet column holding the text; None with `image_field`: every record is an image"))
    image_field: str | None = Field(None, description=(
        "jsonl key / parquet column holding the image (a file path, a data: URI, or parquet bytes); with"
        " `text_field` too, each record has one or the other (a mixed corpus)"))
    id_field: str | None = Field(None, description="jsonl key / parquet column holding the id; default file:line")
    outputs: tuple[Literal["dense", "sparse", "colbert"], ...] = Field(("dense",), min_length=1)
    truncate: bool = False
    chunk: bool = Field(False, description=(
        "embed a text longer than the model in chunks averaged by token count (wde/chunking.py); dense only"))
    max_embed_len: int | None = Field(None, gt=0, description="with `chunk`: the most tokens one text may have")
    prompt_name: str | None = None
    options: dict[str, str] = Field(default_factory=dict, description=(
        "per-request options of the workflow (e.g. task=query for a late-interaction model), each record's"))
    skip_blank: bool = Field(False, description=".txt: skip blank lines instead of refusing them")
    shard_size: int = Field(4096, gt=0, description="records per output shard (the unit of resume)")
    max_line_bytes: int = Field(16 * 1024 * 1024, gt=0,
                                description=".jsonl/.txt: refuse a longer line (file:line) without reading it whole")
    workflow: str | None = None
    model: str | None = None
    overrides: tuple[str, ...] = ()
    trust_remote_code: bool = False

    @property
    def partial(self) -> Path:
        """Where the run writes until it is complete: `<output>.partial` (a directory of shards, for either
        format), renamed to `<output>` (or, for .npy, assembled into it) only at the end."""
        out = Path(self.output)
        return out.with_name(out.name + ".partial")

    @property
    def output_format(self) -> str:
        suffix = Path(self.output).suffix.lower()
        if suffix not in OUTPUT_SUFFIXES:
            supported = "; ".join(f"{s} ({what})" for s, what in OUTPUT_SUFFIXES.items())
            raise CorpusError(f"--output {self.output}: unsupported suffix {suffix or '(none)'!r};"
                              f" supported: {supported}")
        return suffix[1:]

    def check(self) -> None:
        """Refuse what cannot work before any model is loaded."""
        fmt = self.output_format
        if self.text_field is None and self.image_field is None:
            raise CorpusError("--text-field / --image-field: name the field that holds the text, the image, or both")
        if self.text_field is not None and self.text_field == self.image_field:
            raise CorpusError(f"--text-field and --image-field are both {self.text_field!r}: a field holds texts"
                              " or images, so name two fields for a mixed corpus")
        if fmt == "npy" and self.id_field is not None:
            raise CorpusError("--id-field: .npy output holds only the matrix (rows in input order), not ids;"
                              " write .parquet to keep ids")
        if fmt == "npy" and self.outputs != ("dense",):
            raise CorpusError(f"--outputs {','.join(self.outputs)}: .npy holds dense vectors only; write .parquet"
                              " for sparse / colbert")
        if len(set(self.outputs)) != len(self.outputs):
            raise CorpusError(f"--outputs {','.join(self.outputs)}: an output is named twice")
        for p in self.inputs:
            path = Path(p)
            if path.suffix.lower() not in INPUT_SUFFIXES:
                raise CorpusError(f"--input {p}: unsupported suffix {path.suffix or '(none)'!r};"
                                  f" supported: {', '.join(INPUT_SUFFIXES)}")
            if not path.is_file():
                raise CorpusError(f"--input {p}: no such file")

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the interrupted one for its finished shards to be reusable (not the
        line limit: raising it after a refused line does not change a finished shard)."""
        data = self.model_dump(mode="json", exclude={"output", "max_line_bytes"})
        data["inputs"] = [{"path": os.path.abspath(p), "size": os.stat(p).st_size, "mtime_ns": os.stat(p).st_mtime_ns}
                          for p in self.inputs]
        return data

    def check_workflow(self) -> None:
        """With `image_field`: refuse a workflow that embeds texts only, from its resolved components (the
        weights are not loaded), so the run fails at start with one line rather than at its first image."""
        if self.image_field is None:
            return
        from wde.engine import resolve

        workflow, _ = resolve(self.workflow, self.model, overrides=self.overrides,
                              trust_remote_code=self.trust_remote_code)
        component = workflow.components["input_processor"]
        if not takes_images(component.cls):
            raise CorpusError(f"--image-field {self.image_field}: workflow {workflow.name!r} embeds texts only (its"
                              f" input processor {component.name!r} takes no images); use an image-text workflow"
                              " such as clip or siglip (docs/images.md)")

    def build_engine(self, device: str | None = None):
        from wde.engine import Engine

        return Engine.from_workflow(self.workflow, self.model, overrides=self.overrides,
                                    trust_remote_code=self.trust_remote_code, device=device)


def takes_images(input_processor: Any) -> bool:
    """Whether an input processor (class or instance) admits images (`InputProcessor.takes_images`: its
    `image_prompt` and `preprocess` accept them, as `image_text_input`'s do)."""
    return bool(input_processor.takes_images)
