"""What a chunked request carries from the frontend into the engine core: its spans and its
info (`ChunkCacheInfo`, the `chunk_cache` field of `EngineCoreRequest` and `Request`).

Only lengths and keys travel: the token ids are already on the request
(`SYS + C_1 + ... + C_n + Q`), so every span is derived from the lengths.
"""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger("vllm.chunk_cache")


class ChunkSpans(msgspec.Struct, array_like=True, frozen=True):
    """Token lengths of the parts of one chunked prompt `SYS + C_1 + ... + C_n + Q`.

    Built and validated in the frontend (`frontend.tokenize.make_spans`); the user's
    `chunk_spans` dict of a token-id prompt becomes one of these.
    """

    sys_len: int
    """Number of SYSTEM tokens (BOS included when the request adds special tokens)."""
    chunk_lens: list[int]
    """Token count of each chunk, in prompt order."""
    question_len: int
    """Number of QUESTION tokens (the rest of the prompt)."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_lens)

    @property
    def num_tokens(self) -> int:
        return self.sys_len + sum(self.chunk_lens) + self.question_len

    @property
    def question_start(self) -> int:
        """Token index where the question begins."""
        return self.sys_len + sum(self.chunk_lens)

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Token offsets `[start, end)` of chunk `i` within the request."""
        start = self.sys_len + sum(self.chunk_lens[:i])
        return start, start + self.chunk_lens[i]


class ChunkCacheInfo(ChunkSpans, array_like=True, frozen=True):
    """The spans of one request with their content keys: the `chunk_cache` field of
    `EngineCoreRequest` and `Request` (built once, by `frontend.keys.chunk_cache_info`)."""

    sys_hash: bytes
    """Position-free content key of the SYSTEM tokens."""
    chunk_hashes: list[bytes]
    """Position-free content key of each chunk, as computed after SYS (`SYS + C_i`)."""
    fraction: float = 0.0
    """`qattn:R` recovery: the fraction R of the document tokens recomputed in place (0: none)."""
    runs: int = 0
    """... in at most this many runs (`qattn:R/M`)."""
    recovered: int = 0
    """`last:K` recovery: how many documents joined the question (`frontend.recovery.apply`)."""
    cover: float = 0.0
    """`cover:TAU` recovery: the fraction TAU of the question's attention over the documents the
    recomputed windows must cover (`fraction` is the ceiling RMAX; 0: not this mode)."""
    floor: float = 0.0
    """... recomputing at least this fraction of the document tokens (RMIN)."""

    @property
    def recovers(self) -> bool:
        """Whether a recovery mode computes part of the document region with the question."""
        return bool(self.fraction or self.recovered or self.cover)


def servable(info: ChunkCacheInfo | None, sampling_params) -> ChunkCacheInfo | None:
    """The chunk structure the engine core serves a request with (patch `vllm.v1.request`).

    Prompt logprobs need every prompt row computed, and loaded chunks never are: a chunked
    request that asks for them (the frontend refuses it; this guards other ways into the engine
    core) is served as an ordinary prompt instead of leaving rows uninitialised.
    """
    if info is None or getattr(sampling_params, "prompt_logprobs", None) is None:
        return info
    logger.warning("A chunked request asks for prompt logprobs: served as an ordinary prompt")
    return None
