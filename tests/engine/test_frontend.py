"""Chunked prompts become `SYS + C_1 + ... + C_n + Q` token ids plus chunk metadata, on every
offline path; ordinary prompts are untouched. Expected ids come from the raw `tokenizers` file."""

from __future__ import annotations

import re

import pytest

from vllm_ascend_chunk.core.request_info import ChunkCacheInfo, ChunkSpans
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

SYS = "You are a careful assistant."
DOCS = [
    "The tea house opens at seven.",
    "Ferries leave hourly, except Sundays. 日本語 😀",
    "A third document about naïve cafés.",
]
QUESTION = "When does the ferry leave?"


def chunked(sys: str, docs: list[str], q: str) -> str:
    return " # # ".join([sys, *docs, q])


def expected_ids(raw_tok, sys: str, docs: list[str], q: str, bos: bool = True):
    parts = [raw_tok.encode(sys, add_special_tokens=bos).ids]
    parts += [raw_tok.encode(t, add_special_tokens=False).ids for t in [*docs, q]]
    return [t for p in parts for t in p], [len(p) for p in parts]


def greedy(max_tokens: int = 4):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_generate_string_and_text_prompt(tiny_llama_llm, raw_tok, scheduled_requests):
    ids, lens = expected_ids(raw_tok, SYS, DOCS, QUESTION)
    outs = tiny_llama_llm.generate(
        [chunked(SYS, DOCS, QUESTION), {"prompt": chunked(SYS, DOCS, QUESTION)}], greedy()
    )
    for out in outs:
        assert out.prompt_token_ids == ids
    for req in scheduled_requests:
        info = req.chunk_cache
        assert (info.sys_len, info.chunk_lens, info.question_len) == (lens[0], lens[1:-1], lens[-1])
        assert len(info.chunk_hashes) == 3 and all(len(h) == 32 for h in [info.sys_hash, *info.chunk_hashes])
        assert info.num_tokens == len(req.prompt_token_ids)


def test_hashes_are_position_free_and_keyed(tiny_llama_llm, scheduled_requests):
    a, b, c = DOCS
    prompts = [
        {"prompt": chunked(SYS, [a, b, c], QUESTION)},
        {"prompt": chunked(SYS, [c, a], "Another question entirely?")},  # reordered, other request
        {"prompt": chunked(SYS, [a, b], QUESTION), "cache_salt": "tenant-1"},  # other salt
        {"prompt": chunked("Another system prompt.", [a], QUESTION)},  # other SYS
    ]
    tiny_llama_llm.generate(prompts, greedy(1))
    base, reordered, salted, other_sys = (r.chunk_cache for r in scheduled_requests)
    key = dict(zip(["a", "b", "c"], base.chunk_hashes, strict=True))
    assert len(set(base.chunk_hashes)) == 3
    assert reordered.sys_hash == base.sys_hash
    assert reordered.chunk_hashes == [key["c"], key["a"]]
    assert salted.sys_hash != base.sys_hash and not set(salted.chunk_hashes) & set(base.chunk_hashes)
    assert other_sys.sys_hash != base.sys_hash and other_sys.chunk_hashes[0] != key["a"]


def test_chat_parses_the_rendered_template(tiny_llama_llm, models_dir, raw_tok):
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": SYS},
        {"role": "user", "content": chunked("Context:", DOCS, QUESTION)},
    ]
    rendered = AutoTokenizer.from_pretrained(models_dir / "tiny-llama").apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    parts = re.split(r"\s*# #\s*", rendered)
    want = [t for p in parts for t in raw_tok.encode(p, add_special_tokens=False).ids]
    out = tiny_llama_llm.chat(messages, greedy())[0]
    assert out.prompt_token_ids == want
    assert out.prompt_token_ids[0] == raw_tok.token_to_id("<s>")  # BOS from the template, once
    assert out.prompt_token_ids.count(raw_tok.token_to_id("<s>")) == 1


@pytest.mark.parametrize(
    "prompt", ["An ordinary prompt.", "Only one # # delimiter here.", "unicode 日本語 😀 and\ttabs\n"]
)
def test_ordinary_prompts_are_untouched(tiny_llama_llm, raw_tok, scheduled_requests, prompt):
    out = tiny_llama_llm.generate([prompt], greedy(1))[0]
    assert out.prompt_token_ids == raw_tok.encode(prompt).ids
    assert scheduled_requests[0].chunk_cache is None


def test_without_special_tokens_no_bos(tiny_llama_llm, raw_tok):
    out = tiny_llama_llm.generate(
        [chunked(SYS, DOCS, QUESTION)], greedy(1), tokenization_kwargs={"add_special_tokens": False}
    )[0]
    assert out.prompt_token_ids == expected_ids(raw_tok, SYS, DOCS, QUESTION, bos=False)[0]


def test_token_id_prompt_with_explicit_spans(tiny_llama_llm, raw_tok, scheduled_requests):
    ids, lens = expected_ids(raw_tok, SYS, DOCS, QUESTION)
    prompt = {"prompt_token_ids": ids, "chunk_spans": {"sys_len": lens[0], "chunk_lens": lens[1:-1]}}
    text_out = tiny_llama_llm.generate([chunked(SYS, DOCS, QUESTION)], greedy(1))[0]
    ids_out = tiny_llama_llm.generate([prompt], greedy(1))[0]
    assert ids_out.prompt_token_ids == ids
    from_text, from_ids = (r.chunk_cache for r in scheduled_requests)
    assert from_ids == from_text
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids


@pytest.mark.parametrize(
    "spans, match",
    [
        ({"sys_len": 2, "chunk_lens": [0, 3]}, "chunk_lens"),
        ({"sys_len": -1, "chunk_lens": [3]}, "sys_len"),
        ({"sys_len": 2, "chunk_lens": [100]}, "question of the chunked prompt has no tokens"),
        ({"sys_len": 2}, "chunk_lens"),
        ([2, 3], "chunk_lens"),
        ({"sys_len": 2, "chunk_lens": [3, -1]}, "chunk_lens"),
        ({"sys_len": 2, "chunk_lens": [18]}, "question of the chunked prompt has no tokens"),
        ({"sys_len": 10**20, "chunk_lens": [1]}, "question of the chunked prompt has no tokens"),
        ({"sys_len": "2", "chunk_lens": [3]}, "sys_len"),
        ({"sys_len": 2.0, "chunk_lens": [3]}, "sys_len"),
        ({"sys_len": True, "chunk_lens": [3]}, "sys_len"),
        ({"sys_len": 2, "chunk_lens": "3"}, "chunk_lens"),
        ({"sys_len": 2, "chunk_lens": [3.0]}, "chunk_lens"),
        ({"sys_len": 2, "chunk_lens": [3], "question_len": 15}, "chunk_lens"),
        # `ChunkSpans` objects are checked like dicts: against the ids, then as spans.
        (ChunkSpans(sys_len=5, chunk_lens=[5], question_len=3), "13 tokens but 20 remain"),
        (ChunkSpans(sys_len=-5, chunk_lens=[15], question_len=10), "sys_len"),
        (ChunkSpans(sys_len=5, chunk_lens=[15], question_len=0), "question of the chunked prompt has no"),
    ],
)
def test_token_id_prompt_with_bad_spans_is_refused(tiny_llama_llm, spans, match):
    with pytest.raises(ChunkPromptError, match=match):
        tiny_llama_llm.generate([{"prompt_token_ids": list(range(10, 30)), "chunk_spans": spans}], greedy(1))
    assert tiny_llama_llm.generate(["still serving"], greedy(1))[0].outputs[0].token_ids


def test_empty_question_and_truncation_are_clear_errors(tiny_llama_llm):
    with pytest.raises(ChunkPromptError, match="empty question"):
        tiny_llama_llm.generate([chunked(SYS, DOCS, "")], greedy(1))
    with pytest.raises(ChunkPromptError, match="truncate_prompt_tokens=10"):
        tiny_llama_llm.generate(
            [chunked(SYS, DOCS, QUESTION)], greedy(1), tokenization_kwargs={"truncate_prompt_tokens": 10}
        )


def test_truncating_a_token_id_prompt_with_spans_is_refused(tiny_llama_llm, raw_tok):
    """The spans of a token-id prompt describe the ids as sent: truncation that keeps their sum
    of lengths below the remaining length still cuts SYS and shifts every chunk, so it is refused
    (before, the spans were laid over the truncated ids)."""
    ids, lens = expected_ids(raw_tok, SYS, DOCS, QUESTION)

    def prompt():  # vLLM truncates a prompt dict in place: one per request
        return {"prompt_token_ids": list(ids), "chunk_spans": {"sys_len": 2, "chunk_lens": lens[1:2]}}

    cut = {"truncate_prompt_tokens": len(ids) - 1}
    refused = f"{len(ids)} tokens but {len(ids) - 1} remain after truncate_prompt_tokens"
    with pytest.raises(ChunkPromptError, match=refused):
        tiny_llama_llm.generate([prompt()], greedy(1), tokenization_kwargs=cut)
    uncut = {"truncate_prompt_tokens": len(ids)}  # nothing cut: served
    assert tiny_llama_llm.generate([prompt()], greedy(1), tokenization_kwargs=uncut)[0].outputs[0].token_ids


def test_legacy_engine_add_request_path(tiny_llama_llm, raw_tok, scheduled_requests):
    engine = tiny_llama_llm.llm_engine
    engine.add_request("legacy-1", chunked(SYS, DOCS, QUESTION), greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    ids, lens = expected_ids(raw_tok, SYS, DOCS, QUESTION)
    assert scheduled_requests[0].prompt_token_ids == ids
    assert isinstance(scheduled_requests[0].chunk_cache, ChunkCacheInfo)
    assert scheduled_requests[0].chunk_cache.chunk_lens == lens[1:-1]


def test_legacy_engine_add_request_token_prompt_keeps_its_spans(tiny_llama_llm, raw_tok, scheduled_requests):
    """`LLMEngine.add_request` with a token-id prompt and `chunk_spans`: checked and carried, not
    silently served as an ordinary prompt."""
    engine = tiny_llama_llm.llm_engine
    ids, lens = expected_ids(raw_tok, SYS, DOCS, QUESTION)
    spans = {"sys_len": lens[0], "chunk_lens": lens[1:-1]}
    engine.add_request("legacy-ids", {"prompt_token_ids": ids, "chunk_spans": spans}, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    assert scheduled_requests[0].prompt_token_ids == ids
    assert scheduled_requests[0].chunk_cache.chunk_lens == lens[1:-1]
    with pytest.raises(ChunkPromptError, match="question of the chunked prompt has no tokens"):
        engine.add_request(
            "legacy-bad",
            {"prompt_token_ids": ids, "chunk_spans": {"sys_len": len(ids), "chunk_lens": []}},
            greedy(1),
        )
    assert tiny_llama_llm.generate(["still serving"], greedy(1))[0].outputs[0].token_ids


def test_a_document_with_no_tokens_is_dropped():
    """Some tokenizers turn a text into no tokens: such a document gets no span (no pool entry)."""
    from types import SimpleNamespace

    from vllm_ascend_chunk.config.engine_settings import CONNECTOR, SETTINGS_KEY
    from vllm_ascend_chunk.config.settings import ChunkCacheConfig
    from vllm_ascend_chunk.frontend.tokenize import SPANS_KEY, tokenize_chunked

    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            return [] if text == "​" else [len(text)] * (2 if add_special_tokens else 1)

    prompt = {"prompt": "sys # # doc one # # ​ # # doc two # # question"}
    settings = {SETTINGS_KEY: ChunkCacheConfig.from_env({})}  # an engine's, as `configure` records them
    engine = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector=CONNECTOR, kv_connector_extra_config=settings)
    )
    out = tokenize_chunked(Tokenizer(), prompt, SimpleNamespace(add_special_tokens=True), engine)
    assert out["prompt_token_ids"] == [3, 3, 7, 7, 8]
    spans = out[SPANS_KEY]
    assert (spans.sys_len, spans.chunk_lens, spans.question_len) == (2, [1, 1], 1)
    with pytest.raises(ChunkPromptError, match="question of the chunked prompt has no tokens"):
        tokenize_chunked(
            Tokenizer(), {"prompt": "sys # # doc # # ​"}, SimpleNamespace(add_special_tokens=True), engine
        )


def test_prompt_logprobs_of_chunked_prompts_are_refused(tiny_llama_llm, raw_tok):
    """The documents' rows are loaded from the pool, never computed: no prompt logprobs for them.
    Refused in the frontend, for a text prompt and for token ids with explicit spans."""
    from vllm import SamplingParams

    ids, lens = expected_ids(raw_tok, SYS, DOCS, QUESTION)
    with_spans = {"prompt_token_ids": ids, "chunk_spans": {"sys_len": lens[0], "chunk_lens": lens[1:-1]}}
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for prompt in [chunked(SYS, DOCS, QUESTION), with_spans]:
        with pytest.raises(ChunkPromptError, match=r"`prompt_logprobs`.*chunk_cache"):
            tiny_llama_llm.generate([prompt], params, use_tqdm=False)
    assert tiny_llama_llm.generate(["still serving"], greedy(1))[0].outputs[0].token_ids


def test_engine_core_serves_prompt_logprobs_of_a_chunked_request_in_full(
    tiny_llama_llm, raw_tok, scheduled_requests
):
    """A chunked request with prompt logprobs that reaches the engine core by another way than the
    frontend is served as an ordinary prompt: every row computed, the engine keeps running."""
    from vllm import SamplingParams

    engine = tiny_llama_llm.llm_engine
    prompt = tiny_llama_llm._preprocess_cmpl_one(chunked(SYS, DOCS, "Which guard?"))
    request = engine.input_processor.process_inputs(
        "guard-1", prompt, greedy(1), engine.get_supported_tasks()
    )
    assert request.chunk_cache is not None
    request.sampling_params.prompt_logprobs = 1
    engine.add_request(request.request_id, request, request.sampling_params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert scheduled_requests[0].chunk_cache is None
    plain = tiny_llama_llm.generate(
        {"prompt_token_ids": request.prompt_token_ids},
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
    )[0]
    assert rounded(outputs[0].prompt_logprobs) == rounded(plain.prompt_logprobs)


def rounded(prompt_logprobs) -> list[dict[int, float] | None]:
    return [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in prompt_logprobs]
