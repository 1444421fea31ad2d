"""The server under random and concurrent input: a hypothesis fuzz (every request answered 200 or
400 with a message, never 500, never a hang) and 64 concurrent clients on loopback sharing a few
documents in varying orders (every answer as when asked alone; no pins or pool pages leak).

Differential (the in-process engine is the only oracle): test_64_concurrent_clients_on_cold_documents
(the HF check of chunked answers through this server: tests/server/test_answers.py)."""

from __future__ import annotations

import asyncio
import os
import random

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import chunk_cases as cc
from tests.helpers import server_utils
from vllm_ascend_chunk.core.geometry import PAGE_SIZE
from vllm_ascend_chunk.core.paging import pages_for
from vllm_ascend_chunk.frontend.parser import ChunkParser, ChunkPromptError

FIXED = cc.chunked(cc.SYS, [cc.document(1200 + i, 40) for i in range(3)], "Which ferry is fixed?")


def answer(client, prompt: str, max_tokens: int = 4):
    return client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).choices[0]


def valid(prompt: str, max_tokens: int, chat: bool) -> bool:
    """What the server must accept: chat always has a question (the template's footer); a
    completion must not be empty nor end in an empty question."""
    if max_tokens < 1 or not (chat or prompt):
        return False
    if chat:
        return True
    try:
        ChunkParser().split(prompt)
    except ChunkPromptError:
        return False
    return True


CHARS = st.one_of(st.sampled_from(list("# \t\n\u2028\u3000\u00a0ab.?")), st.characters(codec="utf-8"))
PARTS = st.text(CHARS, max_size=24)
DELIMITERS = st.sampled_from(["# #", " # # ", "\n# #\t", "\u3000# #\u00a0", "# #\u2028", "##", "#  #"])
PROMPTS = st.tuples(st.lists(st.tuples(PARTS, DELIMITERS), max_size=8), PARTS).map(
    lambda p: "".join(part + delim for part, delim in p[0]) + p[1]
)


@pytest.fixture(scope="module")
def fixed_answer(client):
    return answer(client, FIXED).token_ids


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(prompt=PROMPTS, max_tokens=st.integers(0, 6), chat=st.booleans())
def test_fuzz_every_request_gets_a_200_or_a_400(client, raw_tok, fixed_answer, prompt, max_tokens, chat):
    try:
        if chat:
            client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
            )
        else:
            choice = answer(client, prompt, max_tokens)
            assert choice.prompt_token_ids == cc.expected_structure(raw_tok, prompt).token_ids
    except openai.BadRequestError as err:
        assert err.status_code == 400 and err.message
        assert not valid(prompt, max_tokens, chat), err.message
    else:
        assert valid(prompt, max_tokens, chat)


def test_fixed_prompt_answers_the_same_after_the_fuzz(client, fixed_answer):
    """Runs after the fuzz (file order): it left nothing behind that changes answers."""
    assert answer(client, FIXED).token_ids == fixed_answer


def workload(seed: int) -> tuple[str, list[str], list[str]]:
    """A SYSTEM, 6 new documents, 16 prompts (14 chunked in varying orders, 2 ordinary)."""
    system = f"You are load test {seed}'s assistant."
    docs = [cc.document(seed + i, 40) for i in range(6)]
    rng = random.Random(seed)
    prompts = [
        cc.chunked(system, rng.sample(docs, rng.randint(1, 4)), f"Load question {i % 3}?") for i in range(14)
    ]
    return system, docs, prompts + ["An ordinary load test prompt.", "Another ordinary # # one."]


def pool_pages(raw_tok, system: str, docs: list[str]) -> float:
    """The fraction of the pool the entries of `system` and `docs` take (pages of `PAGE_SIZE` tokens)."""
    lens = [len(raw_tok.encode(system).ids)] + [
        len(raw_tok.encode(d, add_special_tokens=False).ids) for d in docs
    ]
    num_pages = int(float(os.environ["VLLM_CHUNK_CACHE_SIZE_GB"]) * 2**30) // (1024 * PAGE_SIZE)
    return sum(pages_for(n, PAGE_SIZE) for n in lens) / num_pages


def concurrent_clients(url: str, prompts: list[str], clients: int = 64) -> tuple[list[str], list[list[int]]]:
    """`clients` concurrent clients ask two prompts each, one after the other (odd clients
    stream); the prompts asked, in order, and the token ids answered."""
    jobs = [prompts[(7 * c + k) % len(prompts)] for c in range(clients) for k in range(2)]

    async def run() -> list[list[int]]:
        aclient = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="none", timeout=server_utils.TIMEOUT, max_retries=0
        )

        async def one_client(c: int) -> list[list[int]]:
            ids = []
            for p in jobs[2 * c : 2 * c + 2]:
                resp = await aclient.completions.create(
                    model="tiny-llama",
                    prompt=p,
                    max_tokens=4,
                    temperature=0,
                    stream=c % 2 == 1,
                    extra_body={"return_token_ids": True},
                )
                chunks = [chunk async for chunk in resp] if c % 2 else [resp]
                ids.append([t for chunk in chunks for t in chunk.choices[0].token_ids or []])
            return ids

        async with aclient:
            per_client = await asyncio.wait_for(asyncio.gather(*map(one_client, range(clients))), 240)
        return [ids for pair in per_client for ids in pair]

    return jobs, asyncio.run(run())


def test_64_concurrent_clients_on_cold_documents(tiny_llama_server, raw_tok, tiny_llama_llm):
    """All documents new: each is computed by one chunk prefill that the other requests join;
    answers equal the offline engine's, nothing stays pinned."""
    from vllm import SamplingParams

    url = tiny_llama_server
    system, docs, prompts = workload(1300)
    before = server_utils.metrics(url)
    jobs, got = concurrent_clients(url, prompts)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = tiny_llama_llm.generate(prompts, params, use_tqdm=False)
    offline = {p: list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)}
    assert got == [offline[p] for p in jobs]
    occurrences = sum(len(cc.expected_structure(raw_tok, p).chunk_lens) for p in jobs)
    after = server_utils.wait_metrics(
        url,
        lambda m: (
            m.pinned_entries == 0
            and m.hit_count + m.miss_count == before.hit_count + before.miss_count + occurrences
        ),
    )
    assert after.hit_count + after.miss_count - before.hit_count - before.miss_count == occurrences
    assert after.chunk_prefills - before.chunk_prefills == 6  # SYS rides along with the first
    assert (after.entries - before.entries, after.pinned_entries) == (7, 0)
    assert after.usage_ratio - before.usage_ratio == pytest.approx(pool_pages(raw_tok, system, docs))


def test_64_concurrent_clients_on_warm_documents(client, tiny_llama_server, raw_tok):
    """Answers equal those given alone before; every chunk hits; the pool's entries and usage are
    what the 7 new entries hold; nothing stays pinned."""
    url = tiny_llama_server
    system, docs, prompts = workload(1400)
    before = server_utils.metrics(url)
    alone = {p: answer(client, p).token_ids for p in prompts}
    warm = server_utils.wait_metrics(url, lambda m: m.entries == before.entries + 7)
    assert warm.entries - before.entries == 7  # SYS + 6 documents
    assert warm.usage_ratio - before.usage_ratio == pytest.approx(pool_pages(raw_tok, system, docs))

    jobs, got = concurrent_clients(url, prompts)
    assert got == [alone[p] for p in jobs]
    occurrences = sum(len(cc.expected_structure(raw_tok, p).chunk_lens) for p in jobs)
    after = server_utils.wait_metrics(url, lambda m: m.hit_count - warm.hit_count >= occurrences)
    assert (after.hit_count - warm.hit_count, after.miss_count - warm.miss_count) == (occurrences, 0)
    assert after.pinned_entries == 0 and after.evictions == warm.evictions
    assert (after.entries, after.usage_ratio) == (warm.entries, warm.usage_ratio)
