"""ChunkCacheAsyncScheduler without a model, driven as vLLM's engine core drives it with async
scheduling: step N+1 is scheduled before the output of step N arrives (vLLM's CPU platform turns
async scheduling off, so an engine never runs this scheduler here). One scripted scenario, then
random sequences checked step by step against a simulated chunk pool."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.coordinator_checks import check_bookkeeping, check_drained
from vllm_ascend_chunk.config.settings import get_config
from vllm_ascend_chunk.core.paging import slot_of
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.scheduler.prefills import CHUNK_PREFILL_ID_PREFIX

BLOCK = 16


def vllm_config(
    models_dir: Path, num_gpu_blocks: int = 64, policy: str = "fcfs", pipeline_parallel_size: int = 1
):
    """The tiny Llama's engine config, no model loaded: 64-token steps, at most 8 requests."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(str(models_dir / "tiny-llama"), dtype="float32", max_model_len=1024, seed=0)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        scheduler_config=SchedulerConfig(
            max_model_len=1024,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            is_encoder_decoder=False,
            policy=policy,
        ),
    )
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    return config


def make_scheduler(config, scheduler_cls=None):
    """A real `ChunkCacheAsyncScheduler` (or `scheduler_cls`) over one full-attention KV cache
    group of `num_gpu_blocks` blocks (the chunk pool is the one `config`'s settings record)."""
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_ascend_chunk.vllm_adapter.scheduler import ChunkCacheAsyncScheduler

    init_none_hash(get_hash_fn_by_name("sha256"))  # what the engine core does at start-up
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=config.cache_config.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)],
    )
    return (scheduler_cls or ChunkCacheAsyncScheduler)(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


@pytest.fixture
def scheduler(models_dir: Path):
    return make_scheduler(vllm_config(models_dir))


def chunked_request(scheduler, rid: str, sys_len: int, chunk_lens: list[int], question_len: int):
    spans = ChunkSpans(sys_len=sys_len, chunk_lens=chunk_lens, question_len=question_len)
    ids = [(7 * i) % 1000 + 1 for i in range(spans.num_tokens)]
    return make_request(scheduler, rid, ids, spans)


def make_request(
    scheduler,
    rid: str,
    ids: list[int],
    spans: ChunkSpans | None = None,
    max_tokens: int = 3,
    priority: int = 0,
):
    """An engine-core `Request`; with `spans` a chunk-path one, its keys made as the frontend
    makes them."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_ascend_chunk.frontend.keys import hash_fn, with_keys

    hasher = hash_fn(get_config().hash_algorithm)
    info = None if spans is None else with_keys(spans, ids, ("tiny", "float32"), hasher)
    return Request(
        request_id=rid,
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        pooling_params=None,
        arrival_time=time.time(),
        chunk_cache=info,
        priority=priority,
        block_hasher=scheduler._prefill_block_hasher,
    )


def synthetic_output(scheduler_output, scheduler, token: int = 11):
    """What the model runner would return: `token` for every request whose prompt is done (a
    `qattn` run computed as a row of its own, which the scheduler does not know, never is)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    done = {r for r in ids if r in scheduler.requests and not scheduler.requests[r].is_prefill_chunk}
    sampled = [[token] if r in done else [] for r in ids]
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )


def test_chunk_prefill_preempted_before_its_output_keeps_its_entries(scheduler, caplog):
    """The last piece of a chunk prefill is scheduled (its forward runs), the prefill is
    preempted before its sampled token arrives, then the token finishes it: its K/V are complete
    and its entries must become resident, not be discarded and computed again."""
    coordinator = scheduler.connector.coordinator
    user = chunked_request(scheduler, "user", sys_len=5, chunk_lens=[40, 30], question_len=4)
    scheduler.add_request(user)
    in_flight: deque = deque()
    last_piece, preempted, finished = [], [], []
    for _ in range(40):
        out = scheduler.schedule()
        in_flight.append((out, synthetic_output(out, scheduler)))
        for request in last_piece:  # preempted by this schedule(), as when blocks run out
            scheduler.running.remove(request)
            scheduler._preempt_request(request, time.monotonic())
            preempted.append(request.request_id)
        last_piece = [
            scheduler.requests[r]
            for r in out.num_scheduled_tokens
            if r in coordinator.prefills and not scheduler.requests[r].is_prefill_chunk
        ]
        if len(in_flight) == 2 or not out.num_scheduled_tokens:  # the output of one step back
            for eco in scheduler.update_from_output(*in_flight.popleft()).values():
                finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        if "user" in finished:
            break
    stats = coordinator.manager.stats
    assert finished == ["user"] and len(preempted) == 2
    assert stats.chunk_prefills == 2, "the preempted prefills' chunks were computed again"
    assert all(e.resident for e in coordinator.manager.entries.values())
    assert coordinator.manager.pinned_entries == 0 and not coordinator.users and not coordinator.prefills
    assert "ended early" not in caplog.text


def test_qattn_passes_under_async_scheduling(scheduler):
    """A `qattn` request's passes when each step's output (the workers' scores included) arrives
    one step late: the scoring piece stops before the question's last token, the request is not
    scheduled until its scores are back, then computes its first chosen run as a piece of its own
    prefill and the second, in the same step, as a row of its own over the request's blocks, which
    the runner is told to drop at the next step; then its question again, and samples only at the
    end."""
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata
    from vllm_ascend_chunk.frontend.keys import hash_fn, with_keys
    from vllm_ascend_chunk.vllm_adapter.connector import chunk_step_metadata

    spans = ChunkSpans(sys_len=5, chunk_lens=[40, 30, 50], question_len=10)  # region 5..124, N = 135
    ids = [(7 * i) % 1000 + 1 for i in range(spans.num_tokens)]
    # 0.3 of 120 = 36 tokens in 2 runs: windows of 18 from C_2 (offset 40) on.
    hasher = hash_fn(get_config().hash_algorithm)
    info = with_keys(spans, ids, ("tiny", "float32"), hasher, fraction=0.3, runs=2)
    user = Request(
        request_id="q",
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=3, temperature=0.0),
        pooling_params=None,
        arrival_time=time.time(),
        chunk_cache=info,
        block_hasher=scheduler._prefill_block_hasher,
    )
    scheduler.add_request(user)
    scores = [0.0] * 120
    scores[60] = scores[100] = 1.0  # in windows 58-76 and 94-112
    pieces, batched, dropped, in_flight, finished = [], [], [], deque(), []
    for _ in range(60):
        out = scheduler.schedule()
        dropped += [r for r in out.finished_req_ids if r.startswith("q#")]
        if "q" in out.num_scheduled_tokens:
            first = next((n.num_computed_tokens for n in out.scheduled_new_reqs if n.req_id == "q"), None)
            cached = out.scheduled_cached_reqs
            if first is None:
                first = cached.num_computed_tokens[cached.req_ids.index("q")]
            pieces.append((first, out.num_scheduled_tokens["q"]))
        for new in out.scheduled_new_reqs:
            if new.req_id.startswith("q#"):
                assert new.block_ids == scheduler.kv_cache_manager.get_block_ids("q")
                assert new.prompt_token_ids == ids and new.sampling_params.max_tokens == 1
                shifts = chunk_step_metadata(out.kv_connector_metadata).position_shifts
                batched.append((len(pieces), new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
                assert shifts[new.req_id] == 0 and out.num_common_prefix_blocks == [0]
        output = synthetic_output(out, scheduler, TOKEN)
        specs = chunk_step_metadata(out.kv_connector_metadata).scores
        report = ChunkCacheWorkerMetadata(scores={rid: list(scores) for rid in specs})
        output.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=report)
        in_flight.append((out, output))
        if len(in_flight) == 2 or not out.num_scheduled_tokens:
            for eco in scheduler.update_from_output(*in_flight.popleft()).values():
                finished += [o for o in eco.outputs if o.finish_reason is not None]
        if finished:
            break
    assert pieces[:3] == [(125, 9), (63, 18), (125, 10)]
    assert batched == [(2, 99, 18)]  # in the step of the first run
    assert dropped == ["q#run99"] and "q#run99" not in scheduler.requests
    assert [p[1] for p in pieces[3:]] == [1, 1]  # then two decode steps
    assert [o.request_id for o in finished] == ["q"] and finished[0].new_token_ids == [TOKEN]
    assert scheduler.requests == {} or "q" not in scheduler.requests
    stats = scheduler.connector.coordinator.manager.stats
    assert (stats.selections, stats.selected_tokens) == (1, 36)


# -- random sequences ------------------------------------------------------------------------
SYSTEMS = [(), tuple(range(3, 8)), tuple(range(10, 22))]
"""SYS prompts (none, one page, two pages)."""
DOCS = [tuple(range(100 + 60 * d, 100 + 60 * d + n)) for d, n in enumerate([5, 12, 17, 30, 40, 9])]
"""The shared corpus: every document has its own token ids."""
NUM_GPU_BLOCKS = 12
"""Paged KV cache of 192 tokens for up to 8 requests of up to ~110: vLLM preempts."""
POOL_PAGES = 12
"""Chunk pool of 12 pages; one request may need 9 (SYS 12 + 40 + 30 + 17 tokens): entries are
evicted."""
TOKEN = 11
"""The token the synthetic model samples (not the tiny models' EOS)."""

Content = tuple
"""What a pool row or a KV slot holds: (SYS ids, document ids or None for SYS, token index)."""


@pytest.fixture(params=[("overlap", "fcfs"), ("sequential", "priority")], ids="-".join)
def small_pool(request, monkeypatch, models_dir: Path):
    """The engine config, with `VLLM_CHUNK_CACHE_SIZE_GB` set so that the pool has POOL_PAGES,
    in each chunk layout (and scheduling policy)."""
    from vllm_ascend_chunk.config.engine_settings import pool_geometry
    from vllm_ascend_chunk.config.pool_size import pool_shape

    layout, policy = request.param
    page_bytes = pool_shape(vllm_config(models_dir, NUM_GPU_BLOCKS, policy)).page_bytes
    monkeypatch.setenv("VLLM_CHUNK_CACHE_LAYOUT", layout)
    monkeypatch.setenv("VLLM_CHUNK_CACHE_SIZE_GB", str((POOL_PAGES + 0.5) * page_bytes / 2**30))
    monkeypatch.delenv("VLLM_CHUNK_CACHE_LRU_THRESHOLD", raising=False)
    get_config.cache_clear()  # before the engine config records its settings
    config = vllm_config(models_dir, NUM_GPU_BLOCKS, policy)
    assert pool_geometry(config).num_pages == POOL_PAGES
    yield config
    get_config.cache_clear()


def user_contents(sys: tuple, docs: list[tuple]) -> list[Content]:
    """What a chunk-path request's chunk region must hold: SYS, then each document after SYS."""
    return [(sys, None, i) for i in range(len(sys))] + [(sys, d, i) for d in docs for i in range(len(d))]


def user_deltas(sys: tuple, docs: list[tuple]) -> list[int]:
    """Sequential layout: RoPE delta of each loaded token (the documents before its own)."""
    return [0] * len(sys) + [sum(map(len, docs[:k])) for k, d in enumerate(docs) for _ in d]


def prefill_content(prompt: list[int], sys_len: int, position: int) -> Content:
    """What a chunk prefill `SYS + C` computes at `position`."""
    sys, doc = tuple(prompt[:sys_len]), tuple(prompt[sys_len:]) or None
    return (sys, None, position) if position < sys_len else (sys, doc, position - sys_len)


class AsyncRun:
    """Drives a `ChunkCacheAsyncScheduler` as vLLM's engine core does with async scheduling (the
    output of step N is applied after step N+1 is scheduled), with a simulated chunk pool, and
    checks the coordinator and the client outputs after every step."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.coord = scheduler, scheduler.connector.coordinator
        self.in_flight: deque = deque()
        self.pool: dict[int, Content] = {}
        self.contents: dict[str, list[Content]] = {}
        self.deltas: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.counts: Counter = Counter()

    # -- client actions ----------------------------------------------------------------------
    def add(
        self,
        rid: str,
        ids: list[int],
        max_tokens: int,
        priority: int,
        sys: tuple = (),
        docs: list[tuple] | None = None,
    ) -> None:
        spans = None
        if docs is not None:
            question = len(ids) - len(sys) - sum(map(len, docs))
            spans = ChunkSpans(sys_len=len(sys), chunk_lens=[len(d) for d in docs], question_len=question)
            self.contents[rid] = user_contents(sys, docs)
            self.deltas[rid] = user_deltas(sys, docs)
        self.scheduler.add_request(make_request(self.scheduler, rid, ids, spans, max_tokens, priority))
        self.max_tokens[rid], self.tokens[rid] = max_tokens, []

    def alive(self) -> list[str]:
        return sorted(r for r in self.max_tokens if r in self.scheduler.requests)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        self.aborted.add(rid)
        self.counts["aborts"] += 1

    def reset(self, running: bool) -> None:
        """A cache reset; with `running`, vLLM first preempts every running request."""
        self.counts["reset_preemptions"] += len(self.scheduler.running) if running else 0
        self.scheduler.reset_prefix_cache(reset_running_requests=running)
        self.counts["resets"] += 1

    # -- engine steps ------------------------------------------------------------------------
    def step(self) -> None:
        """One `EngineCore.step_with_batch_queue` (batch queue of 2), then the checks."""
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            self._count_preemptions(out)
            self._check_loads(out)
            self._record_saves(out)
            self.in_flight.append((out, synthetic_output(out, self.scheduler, TOKEN)))
        if self.in_flight and (
            len(self.in_flight) == 2
            or not self.in_flight[-1][0].num_scheduled_tokens
            or not self.scheduler.has_requests()
        ):
            self._apply(*self.in_flight.popleft())
        check_bookkeeping(self.coord, self.coord.prefills)
        self.counts["steps"] += 1

    def _count_preemptions(self, out) -> None:
        """Requests vLLM preempted in this `schedule()` because the KV cache ran out (a chunk
        prefill with a placeholder: after its last piece was dispatched, its token in flight)."""
        for rid in out.preempted_req_ids or ():
            prefill = rid.startswith(CHUNK_PREFILL_ID_PREFIX)
            self.counts["prefill_preemptions" if prefill else "preemptions"] += 1
            request = self.scheduler.requests.get(rid)
            self.counts["prefill_preemptions_in_flight"] += prefill and request.num_output_placeholders > 0

    def _slot_tokens(self, out) -> dict[int, tuple[str, int]]:
        """KV slot → (request, token) of the chunk regions of the scheduled chunk-path requests."""
        slots = {}
        for rid in out.num_scheduled_tokens:
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            for t in range(min(len(self.contents.get(rid, ())), len(block_ids) * BLOCK)):
                slots[slot_of(block_ids, BLOCK, t)] = (rid, t)
        return slots

    def _check_loads(self, out) -> None:
        """Every load reads a row a chunk prefill of the same document (after the same SYS) wrote."""
        meta = out.kv_connector_metadata
        if not meta.load_rows:
            return
        slots = self._slot_tokens(out)
        deltas = meta.load_deltas or [None] * len(meta.load_rows)
        for row, slot, delta in zip(meta.load_rows, meta.load_slots, deltas, strict=True):
            rid, t = slots[slot]
            assert self.pool.get(row) == self.contents[rid][t], f"row {row} loaded into {rid}[{t}]"
            assert delta in (None, self.deltas[rid][t]), f"RoPE delta of {rid}[{t}]"
        self.counts["sequential_load_steps"] += bool(meta.load_deltas)
        self.counts["load_steps"] += 1
        self.counts["loaded_rows"] += len(meta.load_rows)

    def _record_saves(self, out) -> None:
        """After the forward, each saved slot holds the token a chunk prefill computed there in
        this step: its content goes into the pool row."""
        computed = {}
        for jid, n in out.num_scheduled_tokens.items():
            if jid in self.coord.prefills:
                request = self.scheduler.requests[jid]
                block_ids = self.scheduler.kv_cache_manager.get_block_ids(jid)[0]
                sys_len = self.coord.prefills[jid].parent.chunk_cache.sys_len
                end = request.num_computed_tokens
                for p in range(end - n, end):
                    slot = slot_of(block_ids, BLOCK, p)
                    computed[slot] = prefill_content(request.prompt_token_ids, sys_len, p)
        meta = out.kv_connector_metadata
        for row, slot in zip(meta.save_rows, meta.save_slots, strict=True):
            assert slot in computed, f"slot {slot} saved, but no chunk prefill computed it this step"
            self.pool[row] = computed[slot]

    def _apply(self, out, model_output) -> None:
        for eco in self.scheduler.update_from_output(out, model_output).values():
            assert not any(r.startswith(CHUNK_PREFILL_ID_PREFIX) for r in eco.finished_requests or ())
            for output in eco.outputs:
                self._client_output(output)

    def _client_output(self, output) -> None:
        rid = output.request_id
        assert not rid.startswith(CHUNK_PREFILL_ID_PREFIX), "a chunk prefill's output reached a client"
        assert rid not in self.finished and rid not in self.aborted, f"{rid} output after its end"
        self.tokens[rid] += output.new_token_ids
        if output.finish_reason is not None:
            assert self.tokens[rid] == [TOKEN] * self.max_tokens[rid], rid
            self.finished.add(rid)

    def drain(self, max_steps: int = 400) -> None:
        """Run until every request ended; then nothing is pinned, pending or orphaned."""
        for _ in range(max_steps):
            if not self.scheduler.requests and not self.in_flight:
                break
            self.step()
            self.counts["drain_steps"] += 1
        assert not self.scheduler.requests, f"never finished: {sorted(self.scheduler.requests)}"
        assert not self.coord.users and not self.coord.prefills
        check_drained(self.coord)
        assert self.finished | self.aborted == self.max_tokens.keys()
        stats = self.coord.manager.stats
        self.counts.update(evictions=stats.evictions, inflight_joins=stats.inflight_joins, hits=stats.hits)


def play(run: AsyncRun, data, num_steps: int) -> None:
    """`num_steps` steps with random arrivals, aborts and resets between them."""
    for step in range(num_steps):
        for n in range(data.draw(st.integers(0, 2), label="arrivals")):
            arrive(run, data, f"r{step}-{n}")
        alive = run.alive()
        if alive and data.draw(st.integers(0, 15), label="abort?") == 7:
            run.abort(data.draw(st.sampled_from(alive), label="aborted"))
        if data.draw(st.integers(0, 40), label="reset?") == 20:
            run.reset(running=data.draw(st.booleans(), label="reset running"))
        run.step()


def arrive(run: AsyncRun, data, rid: str) -> None:
    """A chunk-path request (documents of the shared corpus, in any order) or an ordinary one."""
    max_tokens = data.draw(st.integers(1, 6), label="max_tokens")
    priority = data.draw(st.integers(0, 2), label="priority")  # used by the priority policy
    question = data.draw(st.lists(st.integers(1500, 1600), min_size=1, max_size=6), label="question")
    if data.draw(st.integers(0, 3), label="ordinary?") == 2:
        prompt = data.draw(st.lists(st.integers(1000, 1400), min_size=1, max_size=80), label="prompt")
        run.add(rid, prompt, max_tokens, priority)
        return
    sys = data.draw(st.sampled_from(SYSTEMS), label="sys")
    docs = data.draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=3, unique=True), label="docs")
    run.add(rid, [*sys, *[t for d in docs for t in d], *question], max_tokens, priority, sys, docs)


def random_runs(new_run: Callable[[], AsyncRun], player: Callable, max_examples: int) -> Counter:
    """`max_examples` derandomized hypothesis runs: each a fresh `new_run()` that `player` drives
    for 60 steps, then drained; the runs' counts summed (and `examples`, how many ran)."""
    totals: Counter = Counter()

    @settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def run_one(data) -> None:
        run = new_run()
        player(run, data, num_steps=60)
        run.drain()
        totals.update(run.counts)
        totals["examples"] += 1

    run_one()
    return totals


def test_random_async_sequences_keep_the_pool_consistent(small_pool):
    """Random arrivals (shared documents: cold, warm, reordered; ordinary requests mixed in),
    aborts and cache resets, with a KV cache small enough for vLLM to preempt and a pool small
    enough to evict, outputs applied one step behind: after every step the coordinator's
    bookkeeping holds and every load reads rows a prefill of the same document wrote; at the end
    every request got its tokens (or its abort) and the pool holds no pin and no pending entry."""
    from vllm_ascend_chunk.config.engine_settings import engine_settings

    totals = random_runs(lambda: AsyncRun(make_scheduler(small_pool)), play, max_examples=40)
    reached = (
        "load_steps",
        "hits",
        "inflight_joins",
        "evictions",
        "preemptions",
        "prefill_preemptions",
        "prefill_preemptions_in_flight",
        "aborts",
        "resets",
        "reset_preemptions",
    )
    for what in reached:
        assert totals[what] > 0, f"no {what} in {dict(totals)}"
    assert (totals["sequential_load_steps"] > 0) == (engine_settings(small_pool).layout == "sequential")
