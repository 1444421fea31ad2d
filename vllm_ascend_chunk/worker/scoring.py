"""The workers' half of the `qattn` recovery mode (`scheduler/selection.py`): per document token,
the attention weight a question piece's queries give it at one layer, summed over this worker's
heads and the piece's queries.

vLLM's attention backends return no weights, so the scorer recomputes them at that one layer,
in plain torch (the same on CPU, CUDA and NPU): it wraps that layer's attention `impl.forward`,
which vLLM calls eagerly (outside compiled graphs, which split at attention); after the forward
has written the piece's keys, it takes the piece's queries (post-RoPE, the rows of the request in
the batch) and the request's keys from the paged cache (`KVReader`), and takes a causal softmax
per head and query over every key up to the query, as the attention did. A forward replayed from
a full CUDA graph runs no Python: its pieces are reported unscored (None), and the scheduler
serves those requests without recompute.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_ascend_chunk.ops.base import KVReader
    from vllm_ascend_chunk.step import ScoreSpec

logger = logging.getLogger("vllm.chunk_cache")

QUERY_ROWS = 256
"""Queries scored at a time: the weights of a piece are [heads, rows, keys] floats."""


def score_layer_index(vllm_config) -> int:
    """The layer whose attention scores the question (`qattn`): the middle one."""
    return vllm_config.model_config.hf_text_config.num_hidden_layers // 2


def region_weights(
    query: torch.Tensor, keys: torch.Tensor, first: int, region: tuple[int, int], scale: float
) -> torch.Tensor:
    """Per region token, the softmax weight summed over heads and queries.

    `query` [n, H, D]: the queries of tokens `first..first+n-1`; `keys` [first + n, H_kv, D]: the
    keys of every token up to the last query (a query attends to the keys up to itself)."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, T, D]
    total = torch.zeros(region[1] - region[0], dtype=torch.float32, device=query.device)
    key_index = torch.arange(keys.shape[0], device=query.device)
    for start in range(0, query.shape[0], QUERY_ROWS):
        q = query[start : start + QUERY_ROWS].float().transpose(0, 1)  # [H, c, D]
        logits = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, c, T]
        position = first + start + torch.arange(q.shape[1], device=query.device)
        logits.masked_fill_(key_index[None, :] > position[:, None], float("-inf"))
        total += torch.softmax(logits, dim=-1)[:, :, region[0] : region[1]].sum(dim=(0, 1))
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
            keys, _ = self.reader(slots)
            weights = region_weights(query[start:end], keys, spec.first, spec.region, impl.scale)
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
