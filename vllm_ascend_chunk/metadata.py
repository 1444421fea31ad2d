"""Chunk metadata carried by a request from the frontend into the engine core.

Only lengths and hashes travel: the token ids are already on the request
(`SYS + C_1 + ... + C_n + Q`), so spans are derived from the lengths.
"""

from __future__ import annotations

import msgspec


class ChunkCacheInfo(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """Chunk structure of one request: appended as the last field of `EngineCoreRequest`."""

    sys_len: int
    """Number of SYSTEM tokens (BOS included when the request adds special tokens)."""
    chunk_lens: list[int]
    """Token count of each chunk, in prompt order."""
    sys_hash: bytes = b""
    """Position-free content key of the SYSTEM tokens (see `hashing`)."""
    chunk_hashes: list[bytes] = []
    """Position-free content key of each chunk, computed as SYS + C_i."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_lens)

    @property
    def question_start(self) -> int:
        """Token index where the question begins."""
        return self.sys_len + sum(self.chunk_lens)

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Token offsets `[start, end)` of chunk `i` within the request."""
        start = self.sys_len + sum(self.chunk_lens[:i])
        return start, start + self.chunk_lens[i]
