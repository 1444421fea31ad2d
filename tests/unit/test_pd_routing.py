"""`ChunkCacheMultiConnector` on the decode instance of a P/D pair, without an engine: which
connector loads a chunk-path request (a `kv_consumer` child covering its chunk region, or the
chunk cache), and the fall-back when that child no longer covers it at scheduling time."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.unit.test_coordinator import (  # noqa: F401 (fixture)
    FakeBlocks,
    _default_config,
    coordinator,
    user_request,
)
from vllm_ascend_chunk.vllm_adapter.connector import ChunkCacheConnector, ChunkCacheMultiConnector


@dataclass
class Blocks(FakeBlocks):
    def new_empty(self) -> Blocks:
        return Blocks([])


@dataclass
class Consumer:
    """A `kv_consumer` child that holds the first `tokens` tokens of every prompt."""

    tokens: int
    allocated: list[int] = field(default_factory=list)

    def on_new_request(self, request) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return max(0, self.tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.allocated.append(num_external_tokens)


def decode_instance(consumer: Consumer) -> ChunkCacheMultiConnector:
    chunk = object.__new__(ChunkCacheConnector)
    chunk.coordinator = coordinator(16)
    multi = object.__new__(ChunkCacheMultiConnector)
    multi._connectors = [chunk, consumer]
    multi.chunk_connector = chunk
    multi._consumers = [1]
    multi._requests_to_connector = {}
    return multi


def test_a_consumer_covering_the_chunk_region_loads_the_request():
    req = user_request("r", [b"d0", b"d1"])
    consumer = Consumer(req.chunk_cache.question_start + 2)
    multi = decode_instance(consumer)
    multi.on_new_request(req)
    coord = multi.chunk_connector.coordinator
    assert coord.is_external(req) and coord.plan() == []
    assert multi.get_num_new_matched_tokens(req, 0) == (consumer.tokens, False)
    multi.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), consumer.tokens)
    assert consumer.allocated == [consumer.tokens] and coord.manager.pinned_entries == 0


def test_a_consumer_short_of_the_chunk_region_leaves_the_request_to_the_chunk_cache():
    req = user_request("r", [b"d0", b"d1"])
    consumer = Consumer(req.chunk_cache.question_start - 1)
    multi = decode_instance(consumer)
    multi.on_new_request(req)
    coord = multi.chunk_connector.coordinator
    assert not coord.is_external(req) and len(coord.plan()) == 2
    assert multi.get_num_new_matched_tokens(req, 0) == (None, False)  # its chunks are computed first


def test_a_consumer_that_no_longer_covers_the_region_hands_the_request_back():
    req = user_request("r", [b"d0", b"d1"])
    consumer = Consumer(req.chunk_cache.question_start)
    multi = decode_instance(consumer)
    multi.on_new_request(req)
    consumer.tokens = 4  # e.g. its copy of the prompt's KV went away
    assert multi.get_num_new_matched_tokens(req, 0) == (None, False)
    coord = multi.chunk_connector.coordinator
    assert not coord.is_external(req) and "r" not in multi._requests_to_connector
    assert len(coord.plan()) == 2
    assert coord.manager.stats.external_loads == 0, "counted as loaded elsewhere, served here"
