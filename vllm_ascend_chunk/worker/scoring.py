"""The workers' half of the `qattn` recovery mode (`scheduler/selection.py`): per document token,
the attention weight a question piece's queries give it at one layer, summed over this worker's
heads and the piece's queries.

vLLM's attention backends return no weights, so the scorer recomputes them at that one layer,
in plain torch (the same on CPU, CUDA and NPU): it wraps that layer's attention `impl.forward`,
which vLLM calls eagerly (outside compiled graphs, which split at attention); after the forward
has written the piece's keys, it takes the piece's queries (post-RoPE, the rows of the request in
the batch) and the request's keys from the paged cache (`KVReader`), and takes a causal softmax
per head and query over every key up to the query, as the attention did, in blocks of keys so that
its memory does not grow with the prompt. A forward replayed from
a full CUDA graph runs no Python: its pieces are reported unscored (None), and the scheduler
serves those requests without recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_ascend_chunk.core.step import ScoreSpec
    from vllm_ascend_chunk.ops.base import KVReader

logger = logging.getLogger("vllm.chunk_cache")

QUERY_ROWS = 256
"""Queries scored at a time."""
BLOCK_ELEMENTS = 2**24
"""The most floats (64 MiB) the logits of a block of queries over a block of keys, or that block of
keys in float32, take: the scoring's memory does not grow with the prompt's length."""

KeyBlocks = Callable[[int, int], torch.Tensor]
"""`keys(lo, hi)`: the keys of tokens `lo..hi-1`, [hi - lo, H_kv, D]."""


def score_layer_index(vllm_config) -> int:
    """The layer whose attention scores the question (`qattn`): the middle one."""
    return vllm_config.model_config.hf_text_config.num_hidden_layers // 2


def _grouped(q: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """Queries [c, H, D] times `scale` as [H_kv, G * c, D] (float), each KV head's G query heads
    together."""
    c, heads, dim = q.shape
    grouped = (q.float() * scale).view(c, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)
    return grouped.reshape(kv_heads, -1, dim)


def _logits(grouped: torch.Tensor, keys: torch.Tensor, lo: int, positions: torch.Tensor) -> torch.Tensor:
    """[H, c, k] scaled logits of the `_grouped` queries at `positions` [c] over `keys` [k, H_kv, D]
    of tokens `lo..lo+k-1`, a key after its query masked out (-inf)."""
    logits = torch.matmul(grouped, keys.float().permute(1, 2, 0))  # [H_kv, G * c, k]
    logits = logits.view(-1, positions.shape[0], keys.shape[0])
    if lo + keys.shape[0] - 1 > positions[0]:  # some key comes after some query
        index = lo + torch.arange(keys.shape[0], device=keys.device)
        logits.masked_fill_(index[None, None, :] > positions[None, :, None], float("-inf"))
    return logits


def key_block(heads: int, rows: int, kv_heads: int, dim: int) -> int:
    """Keys scored at a time for `rows` queries of `heads` heads over keys of `kv_heads` x `dim`:
    as many as BLOCK_ELEMENTS allows (all of a prompt of a few thousand tokens: one pass)."""
    return max(256, min(BLOCK_ELEMENTS // (heads * rows), BLOCK_ELEMENTS // (kv_heads * dim)))


def region_weights(
    query: torch.Tensor,
    keys: KeyBlocks,
    piece_start: int,
    region: tuple[int, int],
    scale: float,
    block: int | None = None,
) -> torch.Tensor:
    """Per region token, the softmax weight summed over heads and queries.

    `query` [n, H, D]: the queries of tokens `piece_start..piece_start+n-1`; `keys(lo, hi)`: keys
    of the tokens before and among them (a query attends to the keys up to itself). Keys are taken
    `block` at a time (default `key_block`): where one block holds them all, one softmax; else, per
    block of queries, a first pass over the key blocks keeps each softmax's running maximum and
    normaliser, and a second computes the region's weights."""
    heads = query.shape[1]
    kv_heads, dim = keys(0, 1).shape[1:]
    total = torch.zeros(region[1] - region[0], dtype=torch.float32, device=query.device)
    for start in range(0, query.shape[0], QUERY_ROWS):
        q = query[start : start + QUERY_ROWS]
        size = block or key_block(heads, q.shape[0], kv_heads, dim)
        positions = piece_start + start + torch.arange(q.shape[0], device=query.device)
        end = piece_start + start + q.shape[0]  # keys after the last query are masked for every row
        grouped = _grouped(q, kv_heads, scale)
        if end <= size:
            weights = torch.softmax(_logits(grouped, keys(0, end), 0, positions), dim=-1)
            hi = min(region[1], end)
            total[: hi - region[0]] += weights[:, :, region[0] : hi].sum(dim=(0, 1))
            continue
        peak = torch.full((heads, q.shape[0]), float("-inf"), device=query.device)
        norm = torch.zeros((heads, q.shape[0]), device=query.device)
        for lo in range(0, end, size):  # block 0 holds key 0: every row's peak is finite after it
            logits = _logits(grouped, keys(lo, min(lo + size, end)), lo, positions)
            new_peak = torch.maximum(peak, logits.amax(dim=-1))
            norm = norm * torch.exp(peak - new_peak) + logits.sub_(new_peak[..., None]).exp_().sum(dim=-1)
            peak = new_peak
        for lo in range(region[0], min(region[1], end), size):
            hi = min(lo + size, region[1], end)
            logits = _logits(grouped, keys(lo, hi), lo, positions)
            weights = logits.sub_(peak[..., None]).exp_().div_(norm[..., None])
            total[lo - region[0] : hi - region[0]] += weights.sum(dim=(0, 1))
    return total


class QuestionScorer:
    """Scores the `ScoreSpec` pieces of a step at one attention layer of this worker."""

    def __init__(self, layer, reader: KVReader) -> None:
        self.reader = reader
        self.impl = layer.impl
        self._specs: dict[str, tuple[ScoreSpec, int, int]] = {}
        self._scores: dict[str, list[float] | None] = {}
        forward = self.impl.forward

        def scored_forward(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = forward(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if self._specs and attn_metadata is not None:
                self._score(query)
            return out

        self.impl.forward = scored_forward

    def plan(self, specs: dict[str, ScoreSpec], req_ids: list[str], query_starts) -> None:
        """This step's pieces and their rows in the batch (`query_starts[i]..[i+1]`: `req_ids[i]`)."""
        index = {rid: i for i, rid in enumerate(req_ids)}
        self._specs = {
            rid: (spec, int(query_starts[index[rid]]), int(query_starts[index[rid] + 1]))
            for rid, spec in specs.items()
            if rid in index
        }

    def _score(self, query: torch.Tensor) -> None:
        impl = self.impl
        query = query.view(query.shape[0], impl.num_heads, impl.head_size)
        for rid, (spec, start, end) in self._specs.items():
            slots = torch.tensor(spec.key_slots, dtype=torch.int64, device=query.device)

            def keys(lo: int, hi: int, slots: torch.Tensor = slots) -> torch.Tensor:
                return self.reader(slots[lo:hi])[0]

            weights = region_weights(query[start:end], keys, spec.piece_start, spec.region, impl.scale)
            self._scores[rid] = weights.tolist()
        self._specs = {}

    def take(self) -> dict[str, list[float] | None]:
        """The step's sums; a piece the forward did not reach (a graph replay) is None."""
        scores = {**dict.fromkeys(self._specs), **self._scores}
        if self._specs:
            logger.warning(
                "Chunk Cache: %d question piece(s) not scored (no eager forward)", len(self._specs)
            )
        self._specs, self._scores = {}, {}
        return scores
