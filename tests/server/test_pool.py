"""A server with a 32-page (512-token) chunk pool: a chunk set that can never fit is a 400 naming
VLLM_CHUNK_CACHE_SIZE_GB; requests that fit alone but not together wait for each other's pins and
evict each other, and all answer as the offline engine does.

Differential (the in-process engine is the only oracle): test_requests_that_only_fit_one_at_a_time;
its HF check is test_answers_from_a_pool_that_evicts_equal_the_hf_reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from tests.helpers import server_utils

PAGES = 32
POOL_GB = PAGES * 16 * 1024 / 2**30  # tiny Llama: 1 KiB of K/V per token, 16 tokens a page


@pytest.fixture(scope="module")
def small_pool_server(models_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("small-pool") / "vllm-serve.log"
    with server_utils.vllm_server(
        models_dir / "tiny-llama", log, env={"VLLM_CHUNK_CACHE_SIZE_GB": str(POOL_GB)}
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(small_pool_server):
    return server_utils.client(small_pool_server)


def greedy_ids(client, prompt: str) -> list[int]:
    resp = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return resp.choices[0].token_ids


def offline_ids(llm, prompts: list[str]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "docs",
    [
        [cc.document(1000 + i, 100) for i in range(5)],
        [f"d{i}" for i in range(PAGES)],  # few tokens, but every document takes a page of its own
    ],
    ids=["long documents", "many tiny documents"],
)
def test_a_chunk_set_larger_than_the_pool_is_a_400(client, docs):
    import openai

    with pytest.raises(openai.BadRequestError, match=f"VLLM_CHUNK_CACHE_SIZE_GB={POOL_GB:g} holds 512"):
        greedy_ids(client, cc.chunked(cc.SYS, docs, "Too many?"))
    assert greedy_ids(client, cc.chunked(cc.SYS, docs[:2], "Two fit?"))


def test_a_streamed_chunk_set_larger_than_the_pool_is_an_error_event(client):
    """The pool check runs as the request enters the engine, after a stream's 200 has been sent:
    the refusal is the stream's error event (code 400), as vLLM does for its own such checks."""
    import openai

    prompt = cc.chunked(cc.SYS, [cc.document(1000 + i, 100) for i in range(5)], "Streamed?")
    with pytest.raises(openai.APIError, match="VLLM_CHUNK_CACHE_SIZE_GB") as err:
        list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, stream=True))
    assert err.value.body["code"] == 400
    assert greedy_ids(client, cc.chunked(cc.SYS, ["one", "two"], "Still serving?"))


def test_requests_that_only_fit_one_at_a_time(small_pool_server, client, tiny_llama_llm):
    """Six concurrent requests of ~24 pages each: the pool holds one at a time, so they are
    planned one after another and evict each other; none hangs, pins or leaks."""
    docs = [cc.document(1100 + i, 100) for i in range(18)]
    prompts = [cc.chunked(cc.SYS, docs[3 * i : 3 * i + 3], f"Set {i}?") for i in range(6)]
    before = server_utils.metrics(small_pool_server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: greedy_ids(client, p), prompts, timeout=2 * server_utils.TIMEOUT))
    assert got == offline_ids(tiny_llama_llm, prompts)
    after = server_utils.wait_metrics(
        small_pool_server, lambda m: m.miss_count - before.miss_count == 18 and m.pinned_entries == 0
    )
    assert after.miss_count - before.miss_count == 18 and after.evictions > before.evictions
    assert after.pinned_entries == 0 and after.usage_ratio <= 0.9


def test_answers_from_a_pool_that_evicts_equal_the_hf_reference(small_pool_server, client, models_dir):
    """Two requests whose documents (~24 pages each) do not fit together, in turn A, B, A: each
    answer, cold or with its documents evicted and computed again, is the HF reference."""
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    docs = [cc.document(1300 + i, 100) for i in range(6)]
    a, b = (cc.chunked(cc.SYS, docs[i : i + 3], f"Set {i}?") for i in (0, 3))
    before = server_utils.metrics(small_pool_server)
    for prompt in (a, b, a):
        assert greedy_ids(client, prompt) == cc.reference(model, raw_tok, prompt, 4)[1].tokens, prompt[:40]
    seen = before.hit_count + before.miss_count + 9  # 3 documents a request
    after = server_utils.wait_metrics(small_pool_server, lambda m: m.hit_count + m.miss_count == seen)
    assert after.evictions > before.evictions
    assert after.miss_count - before.miss_count > 6, "A's second time computes what B evicted"
