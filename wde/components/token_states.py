"""`sentence_tokens`: the name the `sentence` pooler had when only it gave per-token states on request.

The `sentence` pooler now gives every request that asks for "token_embeddings" (`PoolingParams.outputs`; TEI's
/embed_all) its tokens' final hidden states, so `--set pooler.name=sentence_tokens` is no longer needed; the name
stays an alias so existing workflows and command lines keep working.
"""

from __future__ import annotations

from wde.components.params import SentencePoolerParams
from wde.components.pooler import TOKENS, SentencePooler

__all__ = ["TOKENS", "SentenceTokensPooler"]


class SentenceTokensPooler(SentencePooler):
    """Exactly `sentence` (token states raw unless the request sets `normalize=True`)."""

    name = "sentence_tokens"
    Params = SentencePoolerParams
