"""ChunkCacheScheduler without a model, driven as vLLM's engine core drives it with pipeline
parallelism: `EngineCore.step_with_batch_queue` keeps up to `pipeline_parallel_size` batches in
flight, so a request can be preempted (by KV pressure or a cache reset) while its last token is
still being computed, and that token then finishes it while it waits. One scripted scenario
(a reset with a last token in flight), then random sequences at batch-queue depths 2 and 3,
checked step by step as the async-scheduler test checks them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import strategies as st

from tests.unit.test_async_scheduler import (
    DOCS,
    NUM_GPU_BLOCKS,
    POOL_PAGES,
    SYSTEMS,
    TOKEN,
    AsyncRun,
    arrive,
    make_scheduler,
    random_runs,
    synthetic_output,
    vllm_config,
)


def pp_config(models_dir: Path, stages: int, num_gpu_blocks: int = NUM_GPU_BLOCKS, policy: str = "fcfs"):
    config = vllm_config(models_dir, num_gpu_blocks, policy, pipeline_parallel_size=stages)
    assert config.max_concurrent_batches == stages and not config.scheduler_config.async_scheduling
    return config


def pp_scheduler(config):
    from vllm_ascend_chunk.vllm_adapter.scheduler import ChunkCacheScheduler

    return make_scheduler(config, ChunkCacheScheduler)


class BatchQueueRun(AsyncRun):
    """`AsyncRun` with vLLM's synchronous scheduler behind a batch queue of `depth` batches, as
    `EngineCore.step_with_batch_queue` runs it: schedule while the queue has room and requests
    remain; otherwise wait for the oldest batch and apply its output."""

    def __init__(self, scheduler, depth: int) -> None:
        super().__init__(scheduler)
        self.depth = depth

    def step(self) -> None:
        scheduler = self.scheduler
        if scheduler.has_requests():
            out = scheduler.schedule()
            self._count_preemptions(out)
            self._check_loads(out)
            self._record_saves(out)
            self.in_flight.append((out, synthetic_output(out, scheduler, TOKEN)))
        if self.in_flight and (len(self.in_flight) == self.depth or not scheduler.has_requests()):
            self._apply(*self.in_flight.popleft())
        self.check_queues()
        self.counts["steps"] += 1

    def check_queues(self) -> None:
        """vLLM's queues hold live requests only, each in one queue, and the coordinator's
        bookkeeping holds."""
        from tests.helpers.coordinator_checks import check_bookkeeping

        scheduler = self.scheduler
        queued = [*scheduler.waiting, *scheduler.skipped_waiting, *scheduler.running]
        ids = [r.request_id for r in queued]
        assert len(ids) == len(set(ids)), f"a request in two queues: {sorted(ids)}"
        for request in queued:
            assert not request.is_finished(), f"{request.request_id} queued as {request.status}"
            assert scheduler.requests.get(request.request_id) is request
        check_bookkeeping(self.coord, self.coord.prefills)

    def last_token_in_flight(self, rid: str) -> bool:
        """Whether a batch in flight samples `rid`'s last token."""
        request = self.scheduler.requests.get(rid)
        if request is None or request.num_output_tokens != self.max_tokens[rid] - 1:
            return False
        scheduled = any(rid in out.num_scheduled_tokens for out, _ in self.in_flight)
        return scheduled and not request.is_prefill_chunk


@pytest.mark.parametrize("layout", ["overlap", "sequential"])
def test_reset_with_a_last_token_in_flight(models_dir: Path, monkeypatch, layout: str):
    """PP=2: `reset_prefix_cache(reset_running_requests=True)` (e.g. after a weight update)
    preempts a chunk-path request whose last token is in flight; it waits for its documents again
    (the reset dropped them), and the token then finishes it: it must leave every queue, and the
    engine keep serving."""
    from vllm_ascend_chunk.config.settings import get_config

    monkeypatch.setenv("VLLM_CHUNK_CACHE_LAYOUT", layout)
    get_config.cache_clear()
    run = BatchQueueRun(pp_scheduler(pp_config(models_dir, 2, num_gpu_blocks=64)), depth=2)
    sys, docs = SYSTEMS[1], [DOCS[4], DOCS[3]]
    run.add("user", [*sys, *docs[0], *docs[1], 1500, 1501, 1502], 3, 0, sys, docs)
    for _ in range(40):
        run.step()
        if run.last_token_in_flight("user"):
            break
    assert run.last_token_in_flight("user")
    run.reset(running=True)
    run.drain()
    assert run.finished == {"user"} and run.tokens["user"] == [TOKEN] * 3
    get_config.cache_clear()


@pytest.fixture(params=[(2, "overlap", "fcfs"), (3, "sequential", "priority")], ids=str)
def pp_pool(request, monkeypatch, models_dir: Path):
    """(stages, engine config) with a pool of POOL_PAGES pages, per layout and policy."""
    from vllm_ascend_chunk.config.engine_settings import pool_geometry
    from vllm_ascend_chunk.config.pool_size import pool_shape
    from vllm_ascend_chunk.config.settings import get_config

    stages, layout, policy = request.param
    page_bytes = pool_shape(pp_config(models_dir, stages, policy=policy)).page_bytes
    monkeypatch.setenv("VLLM_CHUNK_CACHE_SIZE_GB", str((POOL_PAGES + 0.5) * page_bytes / 2**30))
    monkeypatch.delenv("VLLM_CHUNK_CACHE_LRU_THRESHOLD", raising=False)
    monkeypatch.setenv("VLLM_CHUNK_CACHE_LAYOUT", layout)
    get_config.cache_clear()  # before the engine config records its settings
    config = pp_config(models_dir, stages, policy=policy)
    assert pool_geometry(config).num_pages == POOL_PAGES
    yield stages, config
    get_config.cache_clear()


def play(run: BatchQueueRun, data, num_steps: int) -> None:
    """`num_steps` steps with random arrivals, aborts and resets (often while a last token is in
    flight) between them."""
    for step in range(num_steps):
        for n in range(data.draw(st.integers(0, 2), label="arrivals")):
            arrive(run, data, f"r{step}-{n}")
        alive = run.alive()
        if alive and data.draw(st.integers(0, 15), label="abort?") == 7:
            run.abort(data.draw(st.sampled_from(alive), label="aborted"))
        last_in_flight = any(run.last_token_in_flight(r) for r in alive)
        if data.draw(st.integers(0, 8 if last_in_flight else 40), label="reset?") == 4:
            run.counts["resets_with_last_token_in_flight"] += last_in_flight
            run.reset(running=data.draw(st.booleans(), label="reset running"))
        run.step()


def test_random_batch_queue_sequences(pp_pool):
    """Random arrivals (shared documents, ordinary requests mixed in), aborts and resets, a KV
    cache small enough for vLLM to preempt and a pool small enough to evict, with `stages`
    batches in flight: after every step vLLM's queues hold live requests only and the
    coordinator's bookkeeping holds, every load reads rows a prefill of the same document wrote,
    and at the end every request got its tokens (or its abort) and nothing is pinned."""
    stages, config = pp_pool
    totals = random_runs(lambda: BatchQueueRun(pp_scheduler(config), depth=stages), play, max_examples=15)
    for what in ("load_steps", "hits", "evictions", "preemptions", "aborts", "resets", "reset_preemptions"):
        assert totals[what] > 0, f"no {what} in {dict(totals)}"
    assert totals["resets_with_last_token_in_flight"] > 0, dict(totals)
