"""Recovery modes: compute part of the document region with the question, to move answers toward
full attention at a tunable cost (`docs/design/design.md`, Recovery).

`last`: the last document of a request is computed with its question instead of loaded. It
attends to SYS, to every earlier document and causally to itself; the question follows it. This
is exactly the request served with the last document counted as part of the question, so the
mode rewrites the spans before the keys are made and nothing downstream changes: the scheduler
loads SYS + C_1..C_{n-1} and the request's own prefill computes C_n + Q. The last document's
entry is neither read nor written by such a request. `last:K`: the same for the last K
documents (all of them when a request has fewer: an ordinary causal prompt after SYS).

`qattn:R[/M]`: the spans stay; the request's `ChunkCacheInfo` carries the fraction and the runs,
and the scheduler recomputes the selected tokens in place (`scheduler/selection.py`).
`cover:TAU[/RMAX[/RMIN]]`: the same, the windows chosen by the attention they cover, or every
document recomputed (the guard). A one-token question cannot be scored: such a request is served
with every document after the first joined to the question (`last:K`, K = n - 1), which is full
attention of the plain prompt.

The mode is the server's `VLLM_CHUNK_CACHE_RECOVERY`, or per request `chunk_cache_recovery` in
`vllm_xargs` (OpenAI server) or `SamplingParams.extra_args` (offline).
"""

from __future__ import annotations

import msgspec

from vllm_ascend_chunk.config.recovery_modes import RECOVERY_ACCEPTED, Recovery, recovery_of
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

RECOVERY_KEY = "chunk_cache_recovery"
"""Name of the per-request choice in `vllm_xargs` and `SamplingParams.extra_args`."""


def requested_recovery(params: object, default: Recovery) -> Recovery:
    """The recovery mode of a request: its `chunk_cache_recovery`, else `default` (the engine's
    `VLLM_CHUNK_CACHE_RECOVERY`)."""
    extra = getattr(params, "extra_args", None)
    if not extra or RECOVERY_KEY not in extra:
        return default
    value = extra[RECOVERY_KEY]
    mode = recovery_of(value) if isinstance(value, str) else None
    if mode is None:
        raise ChunkPromptError(f"'{RECOVERY_KEY}' must be {RECOVERY_ACCEPTED}; got {value!r}")
    return mode


def joined_docs(mode: Recovery, spans: ChunkSpans) -> int:
    """How many of the last documents join the question: `last:K`'s K, or for `cover` with a
    question that cannot be scored (one token) every document after the first."""
    if mode.cover and spans.question_len < 2:
        return max(spans.num_chunks - 1, 0)
    return mode.docs


def apply(spans: ChunkSpans, recovery_docs: int) -> ChunkSpans:
    """The spans the request is served with when its last `recovery_docs` documents join the
    question."""
    recovery_docs = min(recovery_docs, spans.num_chunks)
    if recovery_docs == 0:
        return spans
    return msgspec.structs.replace(
        spans,
        chunk_lens=spans.chunk_lens[:-recovery_docs],
        question_len=sum(spans.chunk_lens[-recovery_docs:]) + spans.question_len,
    )
