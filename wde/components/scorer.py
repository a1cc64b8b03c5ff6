"""Scorers: how a workflow scores a query against documents, for every scoring entry point (`Engine.score` and
`Engine.rerank`; /rerank, /v1/rerank, Cohere's /v2/rerank, Infinity, TEI and Elastic rerank; /score and /v1/score; TEI
/similarity).

A scorer either scores each (query, document) pair in one pass of the model (`pairs`: a cross-encoder reads its pair's
`output`), or embeds the query and the documents on their own and compares them (`score`: cosine, dot product or minus a
distance of dense or sparse vectors, MaxSim of multi-vector ones). It names the output it reads and what each side is
run with (`side_params`: the output, and for a late-interaction model the per-request option `task`), so a caller needs
nothing else to know about the model. It is built after the pooler, reads only the pooler's public attributes
(`outputs`, and for `maxsim` `similarity_fn_name`), and keeps no reference to any component: its state is plain
settings, so it travels with `EngineInfo` to a split engine's API servers and scores there.

`scoring_plan` turns pairs into the inputs to run (each distinct query and document once for an embedding scorer) and
their outputs back into one score per pair; the engine and the server both score through it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from wde.components.base import BuildContext, Component, Params
from wde.components.params import MaxSimScorerParams
from wde.errors import ModelLoadError, RequestError
from wde.request import PoolingParams

Side = Literal["pair", "query", "document"]
"""What an input of a scoring call is: a (query, document) pair for a pair scorer, else one side."""

Outputs = Mapping[str, Any]
"""One input's outputs (`RequestOutput.outputs`): output name → numpy value."""


class Scorer(Component):
    """Base of the `scorer` kind. A subclass sets `output` (the pooler output it reads, None: it does not score)
    and `pairs`, and implements `pair_scores` (a pair scorer) or `score` (an embedding scorer).

    Building checks that the workflow's pooler produces `output`: a scorer that does not fit its pooler fails the
    build, naming both."""

    kind = "scorer"
    output: str | None = None
    """The pooler output the scores come from ('score', 'dense', 'sparse', 'colbert'); None: this workflow does not
    score."""
    pairs: bool = False
    """True: each (query, document) pair is one input of the model (a cross-encoder); False: the query and each
    document are embedded on their own (`query` and `document` sides) and compared by `score`."""
    side_options: Mapping[str, Mapping[str, str]] = {}
    """Per side, the per-request options (`PoolingParams.options`) it runs with, e.g. {"query": {"task": "query"}}."""

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        produced = tuple(ctx.pooler.outputs)
        if self.output is not None and self.output not in produced:
            raise ModelLoadError(f"scorer {self.name!r} scores output {self.output!r}, which pooler"
                                 f" {ctx.pooler.name!r} does not produce (it produces {list(produced)}); name a"
                                 " scorer that fits (cross_encoder: 'score', cosine: 'dense', maxsim: 'colbert',"
                                 " dot / euclidean / manhattan: 'dense' or 'sparse', none; auto picks by the"
                                 " pooler's outputs and the folder)")

    @property
    def scoring(self) -> str:
        """The name of the scorer that scores (`auto` answers with the one it picked)."""
        return self.name

    def side_params(self, side: Side, params: PoolingParams) -> PoolingParams:
        """`params` (the caller's truncation, activation...) as inputs of side `side` run: asking for `output`
        only, with the side's options. Refuses (`RequestError`) a side this scorer does not run, or
        `activation` where the scores have none (an embedding scorer's: raw and not raw are the same)."""
        if self.output is None:
            raise RequestError(f"scorer {self.name!r} does not score: this workflow scores no pairs", "workflow")
        if (side == "pair") != self.pairs:
            raise RequestError(f"scorer {self.name!r} runs no {side!r} inputs", "workflow")
        if params.activation and not self.pairs:
            raise RequestError(f"activation applies to a cross-encoder's logits; scorer {self.name!r} compares"
                               " embeddings, whose scores have no activation", "activation")
        options = {**(params.options or {}), **self.side_options.get(side, {})}
        return replace(params, outputs=(self.output,), activation=params.activation if self.pairs else None,
                       options=options or None)

    def pair_scores(self, outputs: Sequence[Outputs]) -> np.ndarray:
        """float32 [len(outputs)]: each pair's score, its `output` (a pair scorer)."""
        name = str(self.output)
        return np.array([np.asarray(o[name], dtype=np.float32).reshape(-1)[0] for o in outputs], dtype=np.float32)

    def score(self, query: Outputs, documents: Sequence[Outputs]) -> np.ndarray:
        """float32 [len(documents)]: the query's score against each document, from their `output` (an embedding
        scorer)."""
        raise NotImplementedError(f"scorer {self.name!r} scores pairs in one pass (pair_scores), not embeddings")


class CrossEncoderScorer(Scorer):
    """A cross-encoder / reranker: each (query, document) pair runs through the model as one input and its 'score'
    output is the score (the pooler's activation, sigmoid by default; `activation=False` gives the raw logit)."""

    name = "cross_encoder"
    output = "score"
    pairs = True


class CosineScorer(Scorer):
    """A dense embedder: the cosine similarity of the query's and each document's 'dense' vector (both sides
    embedded with `normalize=True`, then their dot product)."""

    name = "cosine"
    output = "dense"

    def side_params(self, side: Side, params: PoolingParams) -> PoolingParams:
        return replace(super().side_params(side, params), normalize=True)

    def score(self, query: Outputs, documents: Sequence[Outputs]) -> np.ndarray:
        if not documents:
            return np.zeros(0, dtype=np.float32)
        matrix = np.stack([np.asarray(d["dense"], dtype=np.float32) for d in documents])
        return matrix @ np.asarray(query["dense"], dtype=np.float32)


SIMILARITIES: tuple[str, ...] = ("cosine", "dot", "euclidean", "manhattan")
"""The `similarity_fn_name` values of a sentence-transformers dense or sparse folder that WDE scores with (`auto`
picks the scorer of that name; cosine is the default where a folder names none, dot for a SparseEncoder)."""


def _vectors(output: str, query: Outputs, documents: Sequence[Outputs]) -> tuple[np.ndarray, np.ndarray]:
    """The query's vector [dim] and the documents' [len(documents), dim] as float32. A sparse output ({key: weight}
    per input) becomes dense vectors over the keys any of them has, so each similarity is the sparse one exactly
    (keys none of them has add 0 to a dot product and to either distance)."""
    if output != "sparse":
        return (np.asarray(query[output], dtype=np.float32),
                np.stack([np.asarray(d[output], dtype=np.float32) for d in documents]))
    rows = [query[output], *(d[output] for d in documents)]
    column = {key: i for i, key in enumerate(dict.fromkeys(k for row in rows for k in row))}
    dense = np.zeros((len(rows), len(column)), dtype=np.float32)
    for r, row in enumerate(rows):
        if row:
            dense[r, [column[k] for k in row]] = list(row.values())
    return dense[0], dense[1:]


class VectorScorer(Scorer):
    """Base of the scorers that compare one vector per side as embedded, unnormalized (a folder's own Normalize
    module still applies): the 'dense' vectors, or where the pooler has none its 'sparse' weights
    ({token: weight}), as sentence-transformers' `similarity` / `SparseEncoder.similarity` compare what `encode`
    gives. A subclass implements `compare`."""

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        produced = tuple(ctx.pooler.outputs)
        self.output = "sparse" if "dense" not in produced and "sparse" in produced else "dense"
        super().__init__(params, ctx)

    def score(self, query: Outputs, documents: Sequence[Outputs]) -> np.ndarray:
        if not documents:
            return np.zeros(0, dtype=np.float32)
        q, docs = _vectors(str(self.output), query, documents)
        return self.compare(q, docs).astype(np.float32)

    def compare(self, query: np.ndarray, documents: np.ndarray) -> np.ndarray:
        """[len(documents)]: the query vector [dim] against each row of `documents` [n, dim]."""
        raise NotImplementedError


class DotScorer(VectorScorer):
    """The dot product of the query's and each document's vector, for models trained with it
    (`similarity_fn_name: "dot"`: sentence-transformers' `dot_score`) and SPLADE's sparse weights (the sum over the
    tokens both have of the product of their weights, as `SparseEncoder.similarity` scores by default)."""

    name = "dot"

    def compare(self, query: np.ndarray, documents: np.ndarray) -> np.ndarray:
        return documents @ query


class EuclideanScorer(VectorScorer):
    """Minus the Euclidean distance between the query's and each document's vector (`similarity_fn_name:
    "euclidean"`, sentence-transformers' `euclidean_sim`); dense or sparse."""

    name = "euclidean"

    def compare(self, query: np.ndarray, documents: np.ndarray) -> np.ndarray:
        diff = documents.astype(np.float64) - query
        return -np.sqrt((diff * diff).sum(axis=1))


class ManhattanScorer(VectorScorer):
    """Minus the Manhattan (L1) distance between the query's and each document's vector (`similarity_fn_name:
    "manhattan"`, sentence-transformers' `manhattan_sim`); dense or sparse."""

    name = "manhattan"

    def compare(self, query: np.ndarray, documents: np.ndarray) -> np.ndarray:
        return -np.abs(documents.astype(np.float64) - query).sum(axis=1)


def folder_similarity(ctx: BuildContext, output: str) -> str:
    """The similarity a sentence-transformers folder says its `output` vectors are compared with
    (config_sentence_transformers.json `similarity_fn_name`): its default where it names none (cosine for dense
    vectors, dot for sparse ones, as sentence-transformers picks). One WDE does not score with is refused at build
    by name, never scored with another (sentence-transformers falls back to its default for a name it does not
    know)."""
    config = ctx.source.read_json("config_sentence_transformers.json") or {}
    name = config.get("similarity_fn_name") if isinstance(config, dict) else None
    if name is None:
        return "dot" if output == "sparse" else "cosine"
    known = SIMILARITIES if output == "dense" else tuple(s for s in SIMILARITIES if s != "cosine")
    if name not in known:
        raise ModelLoadError(f"{ctx.source.path / 'config_sentence_transformers.json'}: similarity_fn_name {name!r}"
                             f" is not a similarity WDE scores {output} vectors with (it scores {', '.join(known)});"
                             " to serve the model anyway, name its scorer: --set scorer.name=NAME (one of those,"
                             " or none)")
    return name


@runtime_checkable
class DeclaresSimilarity(Protocol):
    """A multi-vector pooler that says how its model's MaxSim adds up ('maxsim' or 'meanmaxsim'), as the
    `multi_vector` pooler does from the folder; `maxsim` with `similarity: auto` reads it."""

    similarity_fn_name: str


class MaxSimScorer(Scorer):
    """Late interaction: queries run with option task=query, documents with task=document, and each query scores
    each document by MaxSim over their 'colbert' token vectors (`wde.components.multi_vector.maxsim`), summed or
    averaged over the query's tokens as `similarity` (or the pooler) says."""

    name = "maxsim"
    Params = MaxSimScorerParams
    output = "colbert"
    side_options = {"query": {"task": "query"}, "document": {"task": "document"}}

    def __init__(self, params: MaxSimScorerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        similarity = params.similarity
        if similarity == "auto":
            if not isinstance(ctx.pooler, DeclaresSimilarity):
                raise ModelLoadError(f"scorer 'maxsim' with similarity auto reads the pooler's similarity_fn_name,"
                                     f" which pooler {ctx.pooler.name!r} does not declare; set"
                                     " scorer.params.similarity to maxsim or meanmaxsim")
            similarity = ctx.pooler.similarity_fn_name
        if similarity not in ("maxsim", "meanmaxsim"):
            raise ModelLoadError(f"pooler {ctx.pooler.name!r} declares similarity_fn_name {similarity!r}; scorer"
                                 " 'maxsim' scores maxsim or meanmaxsim")
        self.similarity: Literal["maxsim", "meanmaxsim"] = similarity  # type: ignore[assignment]
        """'maxsim' or 'meanmaxsim', resolved at build."""

    def score(self, query: Outputs, documents: Sequence[Outputs]) -> np.ndarray:
        import torch

        from wde.components.multi_vector import maxsim

        docs = [torch.from_numpy(np.asarray(d["colbert"], dtype=np.float32)) for d in documents]
        q = torch.from_numpy(np.asarray(query["colbert"], dtype=np.float32))
        return maxsim(q, docs, self.similarity).numpy()


class NoScorer(Scorer):
    """A workflow that scores nothing (a classifier, sparse embeddings): every scoring entry point refuses it by
    name (the server's 424)."""

    name = "none"


class AutoScorer(Scorer):
    """The scorer the pooler's outputs and the folder call for, picked at build: `cross_encoder` for 'score';
    for 'dense' vectors the folder's `similarity_fn_name` (`cosine` where it names none, `dot`, `euclidean`,
    `manhattan`); `maxsim` for 'colbert'; for 'sparse' weights the folder's similarity (`dot` where it names none,
    as `SparseEncoder`); else `none`. A similarity WDE does not score with is refused at build, by name. For a
    workflow whose outputs depend on the model folder (a sequence classifier is a cross-encoder with one label, a
    classifier with more)."""

    name = "auto"

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        produced = tuple(ctx.pooler.outputs)
        by_name: dict[str, type[Scorer]] = {"cosine": CosineScorer, "dot": DotScorer, "euclidean": EuclideanScorer,
                                            "manhattan": ManhattanScorer}
        picked: type[Scorer] = NoScorer
        if "score" in produced:
            picked = CrossEncoderScorer
        elif "dense" in produced:
            picked = by_name[folder_similarity(ctx, "dense")]
        elif "colbert" in produced:
            picked = MaxSimScorer
        elif "sparse" in produced:
            picked = by_name[folder_similarity(ctx, "sparse")]
        self.picked: Scorer = picked(picked.Params(), ctx)
        """The scorer it stands for."""
        self.output, self.pairs, self.side_options = self.picked.output, self.picked.pairs, self.picked.side_options

    @property
    def scoring(self) -> str:
        return self.picked.name

    def side_params(self, side: Side, params: PoolingParams) -> PoolingParams:
        return self.picked.side_params(side, params)

    def pair_scores(self, outputs: Sequence[Outputs]) -> np.ndarray:
        return self.picked.pair_scores(outputs)

    def score(self, query: Outputs, documents: Sequence[Outputs]) -> np.ndarray:
        return self.picked.score(query, documents)


@dataclass(frozen=True)
class ScoringPlan:
    """The inputs a scoring call runs, in order, each with its params and its origin (pair index, and 0 for the
    query side or 1 for the document side, so errors name the caller's field); `scores` turns their outputs back
    into one float32 score per pair."""

    scorer: Scorer
    inputs: list[Any]
    params: list[PoolingParams]
    origins: list[tuple[int, int]]
    pair_inputs: list[tuple[int, int]]
    """Per pair, the index in `inputs` of its query and of its document (the same one for a pair scorer)."""

    def scores(self, outputs: Sequence[Outputs]) -> np.ndarray:
        if self.scorer.pairs:
            return self.scorer.pair_scores(outputs)
        scores = np.zeros(len(self.pair_inputs), dtype=np.float32)
        by_query: dict[int, list[int]] = {}
        for pair, (q, _) in enumerate(self.pair_inputs):
            by_query.setdefault(q, []).append(pair)
        for q, pairs in by_query.items():
            scores[pairs] = self.scorer.score(outputs[q], [outputs[self.pair_inputs[p][1]] for p in pairs])
        return scores


def scoring_plan(scorer: Scorer, pairs: Sequence[tuple[Any, Any]], params: PoolingParams) -> ScoringPlan:
    """What scoring `pairs` (query, document) with `scorer` runs: each pair once for a pair scorer; else each
    distinct query (with the query side's params) and each distinct document (the document side's) once, and a
    text on both sides once where the two sides run with the same params."""
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise RequestError(f"pairs[{i}] is not a (query, document) pair of two texts", "pairs")
    if scorer.pairs:
        side = scorer.side_params("pair", params)
        return ScoringPlan(scorer, [tuple(p) for p in pairs], [side] * len(pairs),
                           [(i, 1) for i in range(len(pairs))], [(i, i) for i in range(len(pairs))])
    sides = (scorer.side_params("query", params), scorer.side_params("document", params))
    shared = sides[0] == sides[1]  # a text on both sides runs once when both sides run alike (cosine)
    index: dict[tuple[int, Any], int] = {}
    inputs: list[Any] = []
    run_params: list[PoolingParams] = []
    origins: list[tuple[int, int]] = []
    pair_inputs = []
    for i, pair in enumerate(pairs):
        at = []
        for side, text in enumerate(pair):
            key = (0 if shared else side, text)
            if key not in index:
                index[key] = len(inputs)
                inputs.append(text)
                run_params.append(sides[side])
                origins.append((i, side))
            at.append(index[key])
        pair_inputs.append((at[0], at[1]))
    return ScoringPlan(scorer, inputs, run_params, origins, pair_inputs)
