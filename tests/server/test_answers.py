"""The server answers as the offline engine does: `/v1/completions` and `/v1/chat/completions`,
streamed or not, seeded n>1, `cache_salt` and a concurrent mixed batch give the token ids that
`LLM.generate` / `LLM.chat` give for the same prompts (tiny Llama, float32); chunked completions,
streamed or not, and a chunked chat also answer as the independent HF reference.

Differential (the in-process engine is the only oracle): test_completions_equal_offline_answers,
test_chat_equals_offline_chat, test_seeded_sampling_with_n_choices_equals_offline (sampled: the HF
reference is greedy only), test_concurrent_mixed_batch_equals_offline; their HF check is
test_greedy_answers_equal_the_hf_reference."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import chunk_cases as cc
from tests.helpers import server_utils
from tests.server.test_errors import CONTROL_CHARACTERS, NO_SYSTEM_NO_DOCUMENTS

MAX_TOKENS = 6
DOCS = [cc.document(800 + i, 40) for i in range(5)] + [cc.UNICODE_DOC]
PROMPTS = [
    cc.chunked(cc.SYS, DOCS[:3], "Which ferry leaves first?"),
    cc.chunked(cc.SYS, [DOCS[2], DOCS[5], DOCS[0]], "Which ferry leaves first?"),
    cc.chunked("", DOCS[3:5], "No system prompt?"),
    "An ordinary prompt about ferries and tea houses.",
]


def offline(llm, prompts, **params) -> list[list[list[int]]]:
    """Token ids of every output of every prompt, from the in-process engine."""
    from vllm import SamplingParams

    params = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} | params)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(o.token_ids) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outs]


def served(client, prompt, stream: bool = False, extra_body: dict | None = None, **params) -> list[list[int]]:
    """Token ids of every choice of a `/v1/completions` request, by choice index."""
    resp = client.completions.create(
        **{
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": stream,
            "extra_body": {"ignore_eos": True, "return_token_ids": True, **(extra_body or {})},
        }
        | params
    )
    ids = defaultdict(list)
    for chunk in resp if stream else [resp]:
        for choice in chunk.choices:
            ids[choice.index] += choice.token_ids or []
    return [ids[i] for i in sorted(ids)]


MESSAGES = [
    {"role": "system", "content": cc.SYS},
    {"role": "user", "content": cc.chunked("Context:", DOCS[1:4], "Which ferry?")},
]


def served_chat(client, messages, stream: bool = False) -> tuple[list[int], list[int]]:
    """Prompt ids and token ids of a greedy `/v1/chat/completions` request."""
    resp = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(resp) if stream else [resp]
    tokens = [t for c in chunks for choice in c.choices for t in getattr(choice, "token_ids", None) or []]
    return chunks[0].prompt_token_ids, tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_offline_answers(client, tiny_llama_llm, stream):
    assert [served(client, p, stream) for p in PROMPTS] == offline(tiny_llama_llm, PROMPTS)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline_chat(client, tiny_llama_llm, stream):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = tiny_llama_llm.chat(MESSAGES, params, use_tqdm=False)[0]
    assert served_chat(client, MESSAGES, stream) == (want.prompt_token_ids, list(want.outputs[0].token_ids))


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_sampling_with_n_choices_equals_offline(client, tiny_llama_llm, stream):
    """n>1 needs sampling (greedy n>1 is refused by vLLM); a seed makes it reproducible: choice i
    samples with seed + i in both engines."""
    params = {"n": 3, "temperature": 1.5, "seed": 3}
    got = served(client, PROMPTS[1], stream, **params)
    assert got == offline(tiny_llama_llm, [PROMPTS[1]], **params)[0]
    assert len({tuple(ids) for ids in got}) > 1, "the choices differ: each has its own seed"


def test_cache_salt_gives_the_same_answer_under_separate_keys(client, tiny_llama_server):
    """A salted request never hits chunks cached without that salt, and answers the same."""
    url = tiny_llama_server
    prompt = cc.chunked(cc.SYS, [cc.document(850 + i, 30) for i in range(2)], "Salted?")

    def ask(salt: str | None) -> tuple[list[list[int]], int, int]:
        before = server_utils.metrics(url)
        ids = served(client, prompt, extra_body={"cache_salt": salt} if salt else None)
        after = server_utils.wait_metrics(
            url, lambda m: m.hit_count + m.miss_count >= before.hit_count + before.miss_count + 2
        )
        return ids, after.hit_count - before.hit_count, after.miss_count - before.miss_count

    plain, *counts = ask(None)
    assert counts == [0, 2]
    for salt, hits, misses in [("tenant-a", 0, 2), ("tenant-a", 2, 0), ("tenant-b", 0, 2), (None, 2, 0)]:
        assert ask(salt) == (plain, hits, misses), salt


def test_concurrent_mixed_batch_equals_offline(client, tiny_llama_llm):
    """Chunked prompts sharing documents and ordinary prompts, all in flight at once."""
    docs = [cc.document(870 + i, 50) for i in range(4)]
    prompts = [cc.chunked(cc.SYS, [docs[i], docs[(i + 1) % 4]], f"Mixed {i}?") for i in range(4)]
    prompts += [f"Ordinary prompt number {i} about " + cc.document(880 + i, 20) for i in range(4)]
    prompts = prompts[::2] + prompts[1::2]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: served(client, p), prompts, timeout=2 * server_utils.TIMEOUT))
    assert got == offline(tiny_llama_llm, prompts)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_answers_equal_the_hf_reference(client, raw_tok, models_dir, stream):
    """The chunked completions (one with a `cache_salt`) and the chunked chat of the differential
    tests above, and the served odd prompts of test_errors.py, against the HF reference of the
    chunk semantics (`harness/hf_reference.py`) instead of the engine."""
    from transformers import AutoTokenizer

    model = cc.hf_reference.load(models_dir / "tiny-llama")
    for prompt in [*PROMPTS[:3], CONTROL_CHARACTERS, NO_SYSTEM_NO_DOCUMENTS]:
        ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS)[1]
        assert served(client, prompt, stream) == [ref.tokens], prompt[:40]
    salted = served(client, PROMPTS[0], stream, extra_body={"cache_salt": f"hf-{stream}"})
    assert salted == [cc.reference(model, raw_tok, PROMPTS[0], MAX_TOKENS)[1].tokens]
    rendered = AutoTokenizer.from_pretrained(models_dir / "tiny-llama").apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    exp = cc.expected_structure(raw_tok, rendered, add_special_tokens=False)
    ref = cc.hf_reference.greedy(
        model, exp.token_ids, MAX_TOKENS, exp.sys_len, exp.chunk_lens, layout=cc.DEFAULT_LAYOUT
    )
    assert len(exp.chunk_lens) == 3
    assert served_chat(client, MESSAGES, stream) == (exp.token_ids, ref.tokens)
