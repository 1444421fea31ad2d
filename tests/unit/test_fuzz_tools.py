"""The pure parts of the long fuzz with tiers (`tools/fuzz/soak.py`): the recovery mode drawn per
case, the phases, the fault plan, the counter relations and the RSS trend. The run itself, at a
tiny scale: `tests/store/test_fuzz_soak.py`."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

from harness.store_faults import FAULTS, Fault, fault_plan
from tools.fuzz.audit import counter_relations, probe_requests, rss_trend
from tools.fuzz.cases import RECOVERY_MODES, Case, FuzzSettings, make_cases
from tools.fuzz.client import sse_lines
from tools.fuzz.report import server_error_kind
from tools.fuzz.soak import Phase, parse_faults, phases
from vllm_ascend_chunk.metrics import ChunkCacheMetrics

SETTINGS = FuzzSettings(seed=3, requests=200)


def test_every_case_draws_a_recovery_mode_that_changes_nothing_else():
    cases = make_cases(SETTINGS)
    assert {c.recovery for c in cases} == set(RECOVERY_MODES)
    assert [c.body for c in make_cases(SETTINGS)] == [c.body for c in cases], "a function of (seed, i)"
    plain = make_cases(replace(SETTINGS, recovery=("default",)))
    assert all("vllm_xargs" not in c.body for c in plain)
    assert [{k: v for k, v in c.body.items() if k != "vllm_xargs"} for c in cases] == [c.body for c in plain]
    assert all(
        c.body["vllm_xargs"] == {"chunk_cache_recovery": c.recovery} for c in cases if c.recovery != "default"
    )


def test_a_phase_sends_the_cases_after_the_last_one():
    assert phases(10_000, 0.2) == [Phase("A", 1, 0, 8000), Phase("B", 2, 8000, 2000)]
    assert phases(60, 0) == [Phase("A", 1, 0, 60)]
    later = make_cases(replace(SETTINGS, first=150, requests=50))
    assert [c.body for c in later] == [c.body for c in make_cases(SETTINGS)[150:]]


def test_the_fault_plan_is_in_order_of_requests():
    plan = fault_plan(1000, parse_faults("slow=0.65,master=0.2,parts=0.5,pause=0.35"))
    assert plan == [Fault(200, "master"), Fault(350, "pause"), Fault(500, "parts"), Fault(650, "slow")]
    assert {f.kind for f in plan} == set(FAULTS) and parse_faults("none") == {}
    with pytest.raises(ValueError, match="unknown faults"):
        fault_plan(10, {"flood": 0.5})


def test_probes_count_the_documents_a_mode_looks_up():
    assert [n for _, _, n in probe_requests(0)] == [3, 2, 0, 3, 1, 0, 3]


def test_counter_relations():
    counters = {name: 0 for name in ChunkCacheMetrics.__dataclass_fields__}
    ok = ChunkCacheMetrics(**{**counters, "remote_reads": 10, "remote_read_failures": 4, "remote_hits": 5})
    assert all(counter_relations(ok).values())
    bad = replace(ok, remote_hits=7, inflight_joins=1, remote_rejected=1)
    assert [k for k, v in counter_relations(bad).items() if not v] == [
        "remote_hits <= remote_reads - remote_read_failures",
        "inflight_joins <= misses",
        "remote_rejected == 0",
    ]


def test_rss_trend_is_the_slope_over_the_last_half():
    mib = 2**20
    flat = [(t, n, 1000 * mib + (n % 3) * mib // 10, 0) for t, n in enumerate(range(0, 1000, 10))]
    assert rss_trend(flat, 1000, 1.0).flat
    growing = [(t, n, 1000 * mib + n * mib // 50, 0) for t, n in enumerate(range(0, 1000, 10))]
    trend = rss_trend(growing, 1000, 1.0)  # 20 MiB per 1,000 requests on ~1,015 MiB: ~2 %
    assert not trend.flat and 1.9 < trend.slope_pct_per_1000 < 2.1
    assert rss_trend(growing[:50], 1000, 1.0).slope_pct_per_1000 is None, "nothing in the last half"


def test_event_stream_lines_split_at_lf_cr_lf_and_cr_only():
    body = 'data: {"text": "a\u2028b\u0085c"}\r\n\r\ndata: [DONE]\rtail'.encode()

    async def lines() -> list[str]:
        return [line async for line in sse_lines(httpx.Response(200, content=body))]

    assert asyncio.run(lines()) == ['data: {"text": "a\u2028b\u0085c"}', "", "data: [DONE]", "tail"]


def test_a_5xx_is_a_known_vllm_failure_only_where_its_options_hit_one():
    def kind(**body) -> str:
        return server_error_kind(Case(index=0, endpoint="/v1/completions", body=body))[0]

    assert kind(response_format={"type": "json_object"}, ignore_eos=True) == "vllm-known"
    assert kind(response_format={"type": "json_object"}, min_tokens=4) == "vllm-known"
    assert kind(use_beam_search=True, echo=True, logprobs=0) == "vllm-known"
    assert kind(response_format={"type": "json_object"}) == "5xx"
    assert kind(use_beam_search=True, echo=True) == "5xx"
    assert kind(ignore_eos=True, echo=True, logprobs=2) == "5xx"
