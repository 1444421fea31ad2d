"""`ChunkCacheWorker.shift_positions`: the overlap layout's RoPE shift, per request, in place."""

import numpy as np
import torch

from vllm_ascend_chunk.worker.chunk_worker import ChunkCacheWorker


def test_each_request_s_tokens_are_lowered_by_its_shift():
    positions = torch.arange(10) + 20
    starts = np.array([0, 4, 6, 10])  # a: 4 tokens, b: 2 (no shift: an ordinary request), c: 4
    ChunkCacheWorker.shift_positions({"a": 3, "c": 1, "gone": 7}, ["a", "b", "c"], starts, positions)
    assert positions.tolist() == [17, 18, 19, 20, 24, 25, 25, 26, 27, 28]


def test_nothing_to_shift_leaves_the_positions():
    positions = torch.arange(4)
    ChunkCacheWorker.shift_positions({}, ["a"], np.array([0, 4]), positions)
    assert positions.tolist() == [0, 1, 2, 3]
