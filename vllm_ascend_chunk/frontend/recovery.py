"""Recovery modes: compute part of the document region with the question, to move answers toward
full attention at a tunable cost (`docs/design.md`, Recovery).

`last`: the last document of a request is computed with its question instead of loaded. It
attends to SYS, to every earlier document and causally to itself; the question follows it. This
is exactly the request served with the last document counted as part of the question, so the
mode rewrites the spans before the keys are made and nothing downstream changes: the scheduler
loads SYS + C_1..C_{n-1} and the request's own prefill computes C_n + Q. The last document's
entry is neither read nor written by such a request.

The mode is the server's `VLLM_CHUNK_CACHE_RECOVERY`, or per request `chunk_cache_recovery` in
`vllm_xargs` (OpenAI server) or `SamplingParams.extra_args` (offline).
"""

from __future__ import annotations

import msgspec

from vllm_ascend_chunk.config import RECOVERY_MODES, get_config
from vllm_ascend_chunk.frontend.parser import ChunkPromptError
from vllm_ascend_chunk.metadata import ChunkSpans

KEY = "chunk_cache_recovery"
"""Name of the per-request choice in `vllm_xargs` and `SamplingParams.extra_args`."""


def requested(params: object) -> str:
    """The recovery mode of a request: its `chunk_cache_recovery`, else the server's."""
    extra = getattr(params, "extra_args", None)
    if not extra or KEY not in extra:
        return get_config().recovery
    value = extra[KEY]
    if not isinstance(value, str) or value.strip().lower() not in RECOVERY_MODES:
        raise ChunkPromptError(f"'{KEY}' must be one of {', '.join(RECOVERY_MODES)}; got {value!r}")
    return value.strip().lower()


def apply(spans: ChunkSpans, mode: str) -> ChunkSpans:
    """The spans the request is served with under `mode`."""
    if mode == "none" or not spans.chunk_lens:
        return spans
    *loaded, last = spans.chunk_lens
    return msgspec.structs.replace(spans, chunk_lens=loaded, question_len=last + spans.question_len)
