"""CPU streams (wde/components/cpu_streams.py): a batch split into pieces of whole sequences, run at once on
separate threads, gives the same outputs as the whole batch, for every output kind; the process's thread count is
restored; small batches are not split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests import faults
from tests.batches import packed_batch
from tests.tiny_models import varied_texts
from wde import Engine, PoolingParams
from wde.components.cpu_streams import CpuStreams, auto_streams
from wde.components.model_input_builder import ModelInput
from wde.components.pooler import Pooled
from wde.errors import WorkflowError
from wde.request import PoolingParams as RequestPoolingParams

TEXTS = varied_texts(120, seed=5)
SPLIT_ALWAYS = ["runner.params.cpu_streams=2", "runner.params.cpu_stream_min_tokens=1",
                "runner.params.cpu_stream_max_mean_tokens=100000"]
WHOLE = ["runner.params.cpu_streams=1"]


def packed(lens: list[int], types: bool = False) -> ModelInput:
    total = sum(lens)
    return packed_batch(lens, torch.arange(100, 100 + total), torch.arange(total) % 2 if types else None,
                        [RequestPoolingParams(dimensions=i) for i in lens])


@pytest.mark.parametrize("lens,parts", [([5, 3, 8, 2, 7, 1, 9], 2), ([5, 3, 8, 2, 7, 1, 9], 3), ([10, 1, 1, 1], 2),
                                        ([1, 1, 1, 50], 2), ([4, 4], 5), ([7], 4), ([3, 9, 2, 6], 4)])
def test_split_gives_whole_sequences_in_order_as_views(lens: list[int], parts: int) -> None:
    batch = packed(lens, types=True)
    pieces = batch.split(parts)
    assert len(pieces) == min(parts, len(lens))
    assert [n for p in pieces for n in p.seq_lens] == lens
    assert torch.equal(torch.cat([p.input_ids for p in pieces]), batch.input_ids)
    assert torch.equal(torch.cat([p.positions for p in pieces]), batch.positions)
    assert torch.equal(torch.cat([p.token_type_ids for p in pieces]), batch.token_type_ids)
    assert [pp for p in pieces for pp in p.pooling_params] == batch.pooling_params
    for p in pieces:
        assert p.num_seqs >= 1 and p.max_seqlen == max(p.seq_lens)
        assert p.cu_seqlens.tolist() == [0, *np.cumsum(p.seq_lens).tolist()]
        for t, whole in ((p.input_ids, batch.input_ids), (p.positions, batch.positions)):  # views, not copies
            assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_split_balances_tokens() -> None:
    lens = [int(x) for x in np.random.default_rng(0).integers(5, 60, size=200)]
    for parts in (2, 3, 4):
        sizes = [p.num_tokens for p in packed(lens).split(parts)]
        assert max(sizes) - min(sizes) <= 2 * max(lens), sizes


def test_pooled_cat_joins_rows_and_shifts_ragged_bounds() -> None:
    a = Pooled({"dense": torch.ones(2, 3)}, {"sparse": (torch.arange(5.0), [0, 2, 5])})
    b = Pooled({"dense": torch.zeros(1, 3)}, {"sparse": (torch.arange(4.0), [0, 4])})
    joined = Pooled.cat([a, b])
    assert joined.rows["dense"].tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3]
    flat, bounds = joined.ragged["sparse"]
    assert bounds == [0, 2, 5, 9] and flat.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert Pooled.cat([a]) is a


def test_pieces_cut_to_different_dimensions_join_and_keep_each_width(minilm_path: Path, minilm_engine: Engine,
                                                                     split_calls: list[int]) -> None:
    """One piece whose requests all ask for `dimensions=128` is cut to 128 wide, the other stays 384: joining them
    used to fail the batch (retried in halves until the pieces no longer mixed; found by benchmarks/soak.py)."""
    texts = [f"{'word ' * 100}{i}" for i in range(8)]
    split_calls.clear()
    with Engine.from_workflow("bert", minilm_path, overrides=SPLIT_ALWAYS) as engine:
        ids = [engine.add_request(t, RequestPoolingParams(dimensions=128 if i < 4 else None))
               for i, t in enumerate(texts)]
        done: dict[str, object] = {}
        while len(done) < len(ids):
            done.update((o.request_id, o) for o in engine.step())
    assert split_calls == [2]  # one batch, in two pieces: nothing failed and was retried
    outs = [done[i] for i in ids]
    assert all(o.ok for o in outs)  # type: ignore[attr-defined]
    got_short = np.stack([o.outputs["dense"] for o in outs[:4]])  # type: ignore[attr-defined]
    got_full = np.stack([o.outputs["dense"] for o in outs[4:]])  # type: ignore[attr-defined]
    assert got_short.shape == (4, 128) and got_full.shape == (4, 384)
    assert np.abs(got_short - minilm_engine.embed(texts[:4], dimensions=128)).max() <= 1e-5
    assert np.abs(got_full - minilm_engine.embed(texts[4:])).max() <= 1e-5


def test_streams_restore_the_process_thread_count_and_keep_order() -> None:
    before = torch.get_num_threads()
    streams = CpuStreams(2, threads=2)
    try:
        seen = streams.map(lambda x: (x, torch.get_num_threads()), list(range(6)))
        assert [x for x, _ in seen] == list(range(6))
        assert all(n == 1 for _, n in seen)  # each piece ran on its share of 2 threads
        assert torch.get_num_threads() == before
        with pytest.raises(ZeroDivisionError):
            streams.map(lambda x: 1 / x, [1, 0])
        assert torch.get_num_threads() == before  # restored on failure too
    finally:
        streams.close()
    assert auto_streams(1) == 1 and auto_streams(2) == 2 and auto_streams(64) == 4


def test_streams_restore_a_count_changed_after_they_were_built() -> None:
    before = torch.get_num_threads()
    streams = CpuStreams(2, threads=2)
    try:
        torch.set_num_threads(1)
        streams.map(lambda x: x, [1, 2])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        streams.close()


@pytest.fixture(scope="module")
def split_calls(monkeypatch_module: pytest.MonkeyPatch) -> list[int]:
    """How many pieces each split batch had (records every `CpuStreams.map` call in this module)."""
    calls: list[int] = []
    original = CpuStreams.map

    def spy(self: CpuStreams, fn, items):
        calls.append(len(items))
        return original(self, fn, items)

    monkeypatch_module.setattr(CpuStreams, "map", spy)
    return calls


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def embed_both(workflow: str, path: Path, split_calls: list[int], **kw) -> tuple[np.ndarray, np.ndarray]:
    with Engine.from_workflow(workflow, path, overrides=WHOLE, **kw) as engine:
        whole = engine.embed(TEXTS, truncate=True)
    split_calls.clear()
    with Engine.from_workflow(workflow, path, overrides=SPLIT_ALWAYS, **kw) as engine:
        split = engine.embed(TEXTS, truncate=True)
    assert split_calls and all(n == 2 for n in split_calls)
    return whole, split


@pytest.mark.parametrize("executor", ["sync", "thread"])
def test_split_batches_give_the_same_vectors(tiny_bert: Path, split_calls: list[int], executor: str) -> None:
    whole, split = embed_both("bert", tiny_bert, split_calls, executor={"name": executor, "params": {}},
                              pooler={"params": {"pooling": "mean", "normalize": True}})
    assert np.abs(whole - split).max() <= 1e-5


def test_split_batches_match_on_the_real_minilm(minilm_path: Path, split_calls: list[int]) -> None:
    whole, split = embed_both("bert", minilm_path, split_calls)
    assert np.abs(whole - split).max() <= 1e-5


def test_split_batches_give_the_same_bge_m3_outputs(split_calls: list[int], tmp_path: Path) -> None:
    from tests import tiny_heads
    from tests.tiny_models import xlmr_tokenizer

    path = tiny_heads.build_bge_m3(tmp_path, tokenizer=xlmr_tokenizer())
    want = PoolingParams(truncate=True, outputs=("dense", "sparse", "colbert"))
    results = []
    for overrides in (WHOLE, SPLIT_ALWAYS):
        split_calls.clear()
        with Engine.from_workflow("bge_m3", path, overrides=overrides) as engine:
            results.append(engine.encode(TEXTS[:40], want))
        assert bool(split_calls) == (overrides is SPLIT_ALWAYS)
    for a, b in zip(*results):
        assert np.abs(a.outputs["dense"] - b.outputs["dense"]).max() <= 1e-5
        assert a.outputs["sparse"].keys() == b.outputs["sparse"].keys()
        assert max(abs(a.outputs["sparse"][k] - b.outputs["sparse"][k]) for k in a.outputs["sparse"]) <= 1e-5
        assert a.outputs["colbert"].shape == b.outputs["colbert"].shape
        assert np.abs(a.outputs["colbert"] - b.outputs["colbert"]).max() <= 1e-5


def test_split_pairs_keep_their_segment_ids(minilm_path: Path, split_calls: list[int], tmp_path: Path) -> None:
    """A cross-encoder's pairs carry token type ids; each piece gets its own slice of them."""
    from tests.tiny_heads import build_minilm_classifier

    path = build_minilm_classifier(minilm_path, tmp_path, num_labels=1)
    pairs = [(TEXTS[i], TEXTS[i + 1]) for i in range(0, 60, 2)]
    scores = []
    for overrides in (WHOLE, SPLIT_ALWAYS):
        split_calls.clear()
        with Engine.from_workflow("cross_encoder", path, overrides=overrides) as engine:
            scores.append(np.array(engine.score(pairs, truncate=True)))
        assert bool(split_calls) == (overrides is SPLIT_ALWAYS)
    assert np.abs(scores[0] - scores[1]).max() <= 1e-5


def test_small_batches_run_whole(tiny_bert: Path, split_calls: list[int]) -> None:
    split_calls.clear()
    with Engine.from_workflow("bert", tiny_bert, overrides=["runner.params.cpu_streams=2",
                                                           "runner.params.cpu_stream_max_mean_tokens=100000"],
                              pooler={"params": {"pooling": "mean"}}) as engine:
        engine.embed(["a short text", "another one"])  # far under 2 x 256 tokens
        assert not split_calls
        engine.embed(TEXTS, truncate=True)  # batches of thousands of tokens
        assert split_calls


def test_batches_of_long_sequences_run_whole(tiny_bert: Path, split_calls: list[int]) -> None:
    """Sequences averaging `cpu_stream_max_mean_tokens` (default 64) or more run as one piece on every thread; a
    batch of short ones is split."""
    with Engine.from_workflow("bert", tiny_bert, overrides=["runner.params.cpu_streams=2",
                                                           "runner.params.cpu_stream_min_tokens=1"],
                              pooler={"params": {"pooling": "mean"}}) as engine:
        split_calls.clear()
        engine.embed([" ".join(["word"] * 100)] * 8)  # ~100 tokens each
        assert not split_calls
        engine.embed(["a short text number %d" % i for i in range(8)])  # ~8 tokens each
        assert split_calls == [2]


def test_a_failure_in_one_piece_costs_only_its_request(minilm_path: Path, minilm_engine: Engine) -> None:
    faults.register()
    texts = TEXTS[:30] + ["a poison apple"] + TEXTS[30:60]
    with Engine.from_workflow(None, minilm_path, overrides=[*SPLIT_ALWAYS, "model.name=fault_bert"]) as engine:
        outs = engine.encode(texts, PoolingParams(truncate=True), raise_on_error=False)
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert failed == [30]
    good = np.stack([o.outputs["dense"] for i, o in enumerate(outs) if i != 30])
    ref = minilm_engine.embed([t for i, t in enumerate(texts) if i != 30], truncate=True)
    assert np.abs(good - ref).max() <= 1e-5


def test_streams_are_refused_below_one(tiny_bert: Path) -> None:
    with pytest.raises(WorkflowError, match="cpu_streams"):
        Engine.from_workflow("bert", tiny_bert, overrides=["runner.params.cpu_streams=0"])
