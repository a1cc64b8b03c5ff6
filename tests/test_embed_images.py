"""`wde embed --image-field` (issue 28): corpora of images, and of texts and images mixed, with the clip workflow.

Every layout a corpus may have (jsonl paths relative and absolute, data: URIs, parquet bytes and path strings, .txt
one path a line, texts and images mixed) gives the vectors `Engine.embed` gives the same inputs; `--resume` and
`--workers` work as for texts; a bad image (missing, not an image, too large, truncated) or a URL stops the run
with one line naming FILE:LINE; a text-only workflow refuses `--image-field` before it loads; and a shard never
holds more image files in the engine than `ShardEmbedder.open_images`.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_corpus_embed import read, run
from tests.test_corpus_resume import interrupt_at
from tests.tiny_clip import encoded, image_of_mode
from wde import Engine

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

# (mode, width, height, format): odd sizes, modes and both PNG and JPEG, so decoding and resizing are exercised
IMAGES = [("RGB", 41, 29, "PNG"), ("RGBA", 23, 57, "PNG"), ("L", 30, 30, "JPEG"), ("RGB", 64, 48, "JPEG"),
          ("P", 37, 33, "PNG"), ("RGB", 90, 31, "JPEG")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with `imgs/0.png`, `imgs/1.png`, `imgs/2.jpg`, …: the images of `IMAGES`."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "imgs").mkdir()
    for i, (mode, width, height, fmt) in enumerate(IMAGES):
        (root / image_name(i)).write_bytes(encoded(image_of_mode(mode, width, height, seed=i), fmt))
    return root


def image_name(i: int) -> str:
    return f"imgs/{i}.{'png' if IMAGES[i][3] == 'PNG' else 'jpg'}"


def data_uri(path: Path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def args(clip_path: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", str(clip_path), "--input", str(src), "--output", str(out), *extra]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-6


# -- layouts: equal to Engine.embed ------------------------------------------------------------------------------------

def test_jsonl_relative_and_absolute_paths_and_data_uris(tmp_path: Path, clip_path: Path, clip: Engine,
                                                         corpus: Path) -> None:
    files = [corpus / image_name(i) for i in range(len(IMAGES))]
    rows = [{"id": "rel0", "image": image_name(0)},          # relative to the jsonl file's folder
            {"id": "abs1", "image": str(files[1])},
            {"id": "uri2", "image": data_uri(files[2])},
            {"id": "rel3", "image": f"./imgs/../{image_name(3)}"},
            {"id": "uri4", "image": data_uri(files[4])},
            {"id": 5, "image": str(files[5])}]
    src = write_jsonl(corpus / "paths.jsonl", rows)
    out = tmp_path / "out.parquet"
    result = run(*args(clip_path, src, out, "--image-field", "image", "--id-field", "id", "--shard-size", "4"))
    assert result.exit_code == 0, result.output
    assert f"wrote 6 x {clip.dense_size} embeddings to {out}" in result.output
    ids, got = read(out)
    assert ids == ["rel0", "abs1", "uri2", "rel3", "uri4", "5"]
    assert_close(got, clip.embed(files))
    # the same images as bare JSON strings, to .npy; and a .txt of one path a line
    bare = write_jsonl(corpus / "bare.jsonl", [image_name(i) for i in range(len(IMAGES))])
    npy = tmp_path / "bare.npy"
    assert run(*args(clip_path, bare, npy, "--image-field", "image")).exit_code == 0
    assert_close(np.load(npy), got)
    txt = corpus / "paths.txt"
    txt.write_text("".join(f"{image_name(i)}\n" for i in range(len(IMAGES))), encoding="utf-8")
    lines = tmp_path / "txt.parquet"
    assert run(*args(clip_path, txt, lines, "--image-field", "image")).exit_code == 0
    ids, from_txt = read(lines)
    assert ids == [f"paths.txt:{i + 1}" for i in range(len(IMAGES))]
    assert_close(from_txt, got)


def test_parquet_bytes_and_path_strings(tmp_path: Path, clip_path: Path, clip: Engine, corpus: Path) -> None:
    files = [corpus / image_name(i) for i in range(len(IMAGES))]
    blobs = corpus / "blobs.parquet"
    pq.write_table(pa.table({"doc": [f"d{i}" for i in range(len(files))],
                             "img": pa.array([f.read_bytes() for f in files], pa.binary())}), blobs)
    named = corpus / "named.parquet"
    pq.write_table(pa.table({"img": [image_name(i) for i in range(len(files))]}), named)
    want = clip.embed(files)
    out = tmp_path / "blobs.parquet"
    result = run(*args(clip_path, blobs, out, "--image-field", "img", "--id-field", "doc", "--shard-size", "4"))
    assert result.exit_code == 0, result.output
    ids, got = read(out)
    assert ids == [f"d{i}" for i in range(len(files))]
    assert_close(got, want)
    out = tmp_path / "named.parquet"
    assert run(*args(clip_path, named, out, "--image-field", "img")).exit_code == 0
    ids, got = read(out)
    assert ids == [f"named.parquet:{i + 1}" for i in range(len(files))]
    assert_close(got, want)
    numbers = corpus / "numbers.parquet"
    pq.write_table(pa.table({"img": [1, 2]}), numbers)
    refused = run(*args(clip_path, numbers, tmp_path / "n.parquet", "--image-field", "img"))
    assert refused.exit_code == 1 and "column 'img' (--image-field) is int64" in refused.output


def test_texts_and_images_mixed(tmp_path: Path, clip_path: Path, clip: Engine, corpus: Path) -> None:
    """Each record has a text or an image; a text that looks like a data: URI stays a text."""
    looks_like_an_image = "data:image/png;base64,notanimage"
    rows = [{"text": "a red square on white"}, {"image": image_name(0)}, {"text": looks_like_an_image},
            {"image": image_name(3), "text": None}, {"text": "green stripes", "image": None}]
    src = write_jsonl(corpus / "mixed.jsonl", rows)
    out = tmp_path / "mixed.parquet"
    result = run(*args(clip_path, src, out, "--text-field", "text", "--image-field", "image"))
    assert result.exit_code == 0, result.output
    _, got = read(out)
    want = clip.embed(["a red square on white", corpus / image_name(0), {"text": looks_like_an_image},
                       corpus / image_name(3), "green stripes"])
    assert_close(got, want)
    table = corpus / "mixed.parquet"
    pq.write_table(pa.table({"text": ["a red square on white", None],
                             "image": pa.array([None, (corpus / image_name(0)).read_bytes()], pa.binary())}), table)
    out = tmp_path / "mixed-pq.parquet"
    assert run(*args(clip_path, table, out, "--text-field", "text", "--image-field", "image")).exit_code == 0
    assert_close(read(out)[1], want[:2])
    for bad, line, why in ([{"text": "x", "image": image_name(0)}], 1, "has both 'text' (--text-field) and 'image'"), \
                          ([{"text": "x"}, {"caption": "y"}], 2, "has neither 'text' (--text-field) nor 'image'"), \
                          (["bare"], 1, "a bare JSON string is neither"):
        src = write_jsonl(corpus / "bad-mixed.jsonl", bad)
        refused = run(*args(clip_path, src, tmp_path / "bad.parquet", "--text-field", "text", "--image-field",
                            "image", "--overwrite"))
        assert refused.exit_code == 1 and f"{src}:{line}: {why}" in refused.output, refused.output


def test_image_only_records_need_the_image_field(tmp_path: Path, clip_path: Path, corpus: Path) -> None:
    src = write_jsonl(corpus / "captions.jsonl", [{"image": image_name(0)}, {"text": "a caption"}])
    refused = run(*args(clip_path, src, tmp_path / "o.parquet", "--image-field", "image"))
    assert refused.exit_code == 1 and f"{src}:2: no 'image' field (--image-field)" in refused.output
    same = run(*args(clip_path, src, tmp_path / "o.parquet", "--text-field", "image", "--image-field", "image"))
    assert same.exit_code == 1 and "--text-field and --image-field are both 'image'" in same.output


# -- resume and workers ------------------------------------------------------------------------------------------------

def test_resume_after_an_interruption_and_a_replaced_image(tmp_path: Path, clip_path: Path, corpus: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "images"
    (folder / "imgs").mkdir(parents=True)
    for i in range(len(IMAGES)):
        (folder / image_name(i)).write_bytes((corpus / image_name(i)).read_bytes())
    src = write_jsonl(folder / "c.jsonl", [{"image": image_name(i)} if i % 2 else {"text": f"caption {i}"}
                                           for i in range(len(IMAGES))])
    out = tmp_path / "out.parquet"
    cmd = args(clip_path, src, out, "--text-field", "text", "--image-field", "image", "--shard-size", "2")
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        first = run(*cmd)
    assert first.exit_code == 143 and "interrupted after 1 shard (2 rows); re-run with --resume" in first.output
    resumed = run(*cmd, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "wrote 6 x" in resumed.output and "1 shard(s) kept from an earlier run" in resumed.output
    clean = tmp_path / "clean.parquet"
    assert run(*args(clip_path, src, clean, "--text-field", "text", "--image-field", "image")).exit_code == 0
    assert read(out)[0] == read(clean)[0]
    assert_close(read(out)[1], read(clean)[1])

    # an image of a finished shard replaced by another: its path, size and time no longer match
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        assert run(*cmd, "--overwrite").exit_code == 143
    (folder / image_name(1)).write_bytes((corpus / image_name(3)).read_bytes())
    refused = run(*cmd, "--resume")
    assert refused.exit_code == 1, refused.output
    assert f"the input changed since shard 0 (part-000000.parquet) was embedded from it: {src}:2 differs" \
        in refused.output


def test_workers_embed_images_as_one_process_does(tmp_path: Path, clip_path: Path, clip: Engine,
                                                  corpus: Path) -> None:
    files = [corpus / image_name(i) for i in range(len(IMAGES))]
    blobs = tmp_path / "blobs.parquet"
    pq.write_table(pa.table({"img": pa.array([f.read_bytes() for f in files], pa.binary())}), blobs)
    out = tmp_path / "out.parquet"
    result = run(*args(clip_path, blobs, out, "--image-field", "img", "--shard-size", "2", "--workers", "2"))
    assert result.exit_code == 0, result.output
    assert_close(read(out)[1], clip.embed(files))


# -- refusals ----------------------------------------------------------------------------------------------------------

def test_bad_images_stop_the_run_naming_file_and_line(tmp_path: Path, clip_path: Path, corpus: Path) -> None:
    good = corpus / image_name(0)
    (corpus / "notes.png").write_text("not an image at all", encoding="utf-8")
    data = good.read_bytes()
    (corpus / "truncated.png").write_bytes(data[:len(data) * 2 // 3])  # the header is intact: fails when decoded
    cases = [("imgs/missing.png", "cannot read image file", str(corpus / "imgs/missing.png")),
             ("notes.png", "is not an image", str(corpus / "notes.png")),
             ("truncated.png", "is a truncated or corrupt PNG image", str(corpus / "truncated.png")),
             ("https://example.com/cat.png", "is a URL (https://example.com/cat.png); wde embed never fetches", None)]
    for name, why, file in cases:
        src = write_jsonl(corpus / "bad.jsonl", [{"image": image_name(0)}, {"image": image_name(1)}, {"image": name}])
        result = run(*args(clip_path, src, tmp_path / "bad.parquet", "--image-field", "image", "--overwrite"))
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {src}:3: "), result.output
        assert why in lines[0] and (file is None or file in lines[0]), result.output
        assert not (tmp_path / "bad.parquet").exists()
    src = write_jsonl(corpus / "big.jsonl", [{"image": image_name(0)}])
    result = run(*args(clip_path, src, tmp_path / "big.parquet", "--image-field", "image",
                       "--set", "input_processor.params.max_image_bytes=100"))
    assert result.exit_code == 1 and f"{src}:1: " in result.output, result.output
    assert "the image size limit is 100 bytes (input_processor.params.max_image_bytes)" in result.output


def test_a_text_only_workflow_refuses_image_field_before_loading(tmp_path: Path, tiny_bert: Path,
                                                                 corpus: Path) -> None:
    src = write_jsonl(corpus / "one.jsonl", [{"image": image_name(0)}])
    out = tmp_path / "out.parquet"
    result = run("-m", str(tiny_bert), "--input", str(src), "--output", str(out), "--image-field", "image")
    assert result.exit_code == 1
    assert result.output.strip() == ("Error: --image-field image: workflow 'bert' embeds texts only (its input"
                                     " processor 'text_input' takes no images); use an image-text workflow such as"
                                     " clip or siglip (docs/images.md)")
    assert not out.exists() and not (tmp_path / "out.parquet.partial").exists()


# -- memory: a bounded number of image files in the engine -------------------------------------------------------------

def test_a_shard_holds_at_most_open_images_in_the_engine(clip: Engine, corpus: Path) -> None:
    from wde.corpus import EmbedJob
    from wde.corpus.embedder import ShardEmbedder
    from wde.corpus.readers import read_txt

    txt = corpus / "many.txt"
    txt.write_text("".join(f"{image_name(i % len(IMAGES))}\n" for i in range(20)), encoding="utf-8")
    job = EmbedJob(inputs=(str(txt),), output="unused.parquet", text_field=None, image_field="image")
    embedder = ShardEmbedder(clip, job)
    embedder.open_images = 3
    admitted: list[str] = []
    finished: set[str] = set()
    add, step = clip.scheduler.add, clip.step
    peak = 0

    def counting_add(request):
        nonlocal peak
        admitted.append(request.request_id)
        peak = max(peak, len(set(admitted) - finished))
        return add(request)

    def counting_step():
        outs = step()
        finished.update(o.request_id for o in outs)
        return outs

    records = list(read_txt(str(txt), images=True))
    try:
        clip.scheduler.add, clip.step = counting_add, counting_step
        table = embedder.embed(records)
    finally:
        del clip.scheduler.add, clip.step
    assert len(admitted) == 20 and peak == 3
    col = table.column("embedding").combine_chunks()
    assert_close(col.values.to_numpy().reshape(20, -1), clip.embed([Path(r.image) for r in records]))
