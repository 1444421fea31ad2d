"""The chunk path end to end on a real patched engine (in-process, tiny Llama), against the
independent HF reference of the contract (explicit 4D mask + position ids)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import chunk_cases as cc

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_model(models_dir: Path):
    return cc.hf_reference.load(models_dir / "tiny-llama")


@pytest.fixture(scope="module")
def coordinator(tiny_llama_llm):
    return tiny_llama_llm.llm_engine.engine_core.engine_core.scheduler.connector.coordinator


def generate(llm, prompts, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def check(llm, model, raw_tok, prompts, max_tokens=MAX_TOKENS):
    outs = generate(llm, prompts, max_tokens)
    for prompt, out in zip(prompts, outs, strict=True):
        cc.assert_output_matches(out, model, raw_tok, prompt, prompt[:60])
    return outs


DOCS = [cc.document(i, 40) for i in range(8)]
CASES = {
    "one chunk": cc.chunked(cc.SYS, DOCS[:1], "What does it say?"),
    "three chunks, unicode": cc.chunked(cc.SYS, [DOCS[1], cc.UNICODE_DOC, DOCS[2]], "Which one is French?"),
    "eight tiny chunks": cc.chunked(
        cc.SYS, ["a b", "cd", "e", "42", "ünï", "x y z", "?", "ok"], "Sum it up."
    ),
    "empty system": cc.chunked("", DOCS[3:5], "Why?"),
    "same chunk twice": cc.chunked(cc.SYS, [DOCS[5], DOCS[6], DOCS[5]], "Repeat?"),
    "no chunk left": "Only a system prompt # # # # and a question?",
}


def test_reference_distinguishes_chunk_semantics(hf_model, raw_tok):
    """Guard: on these prompts the contract's answer differs from plain causal attention."""
    prompt = CASES["three chunks, unicode"]
    exp, chunk_ref = cc.reference(hf_model, raw_tok, prompt, MAX_TOKENS)
    causal = cc.hf_reference.greedy(hf_model, exp.token_ids, MAX_TOKENS)
    assert chunk_ref.logprobs != causal.logprobs


def test_cold_then_warm_then_reordered(tiny_llama_llm, hf_model, raw_tok, coordinator):
    prompts = list(CASES.values())
    stats = coordinator.manager.stats
    before = (stats.hits, stats.misses)
    cold = check(tiny_llama_llm, hf_model, raw_tok, prompts)
    occurrences = sum(len(cc.expected_structure(raw_tok, p).chunk_lens) for p in prompts)
    assert stats.hits + stats.misses - sum(before) == occurrences

    hits = stats.hits
    warm = check(tiny_llama_llm, hf_model, raw_tok, prompts)
    assert stats.hits - hits == occurrences, "every chunk is resident the second time"
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]

    reordered = [
        cc.chunked(cc.SYS, [DOCS[2], cc.UNICODE_DOC, DOCS[1]], "Which one is French?"),
        cc.chunked(cc.SYS, [DOCS[6], DOCS[5]], "Repeat?"),
    ]
    hits, misses = stats.hits, stats.misses
    check(tiny_llama_llm, hf_model, raw_tok, reordered)
    assert (stats.hits - hits, stats.misses - misses) == (5, 0), "reordered documents all hit"


def test_long_chunks_span_several_steps(tiny_llama_llm, hf_model, raw_tok):
    long_docs = [cc.document(100, 1500), cc.document(101, 1200)]
    prompt = cc.chunked(cc.SYS, long_docs, "What is the second document about?")
    assert max(cc.expected_structure(raw_tok, prompt).chunk_lens) > 1000
    check(tiny_llama_llm, hf_model, raw_tok, [prompt], max_tokens=4)
    check(
        tiny_llama_llm,
        hf_model,
        raw_tok,
        [cc.chunked(cc.SYS, long_docs[::-1], "And the first?")],
        max_tokens=4,
    )


def test_mixed_batch_with_ordinary_prompts(tiny_llama_llm, hf_model, raw_tok):
    prompts = [
        CASES["one chunk"],
        "An ordinary prompt about ferries and tea houses.",
        cc.chunked(cc.SYS, [DOCS[7], DOCS[0]], "New mix?"),
        "Another ordinary one # # here.",
    ]
    check(tiny_llama_llm, hf_model, raw_tok, prompts)


def test_chunk_blocks_never_serve_ordinary_requests(tiny_llama_llm, hf_model, raw_tok):
    """The same token ids without chunk spans are an ordinary prompt: plain causal semantics,
    even though a chunk-path request with those exact tokens filled the prefix cache first."""
    prompt = cc.chunked(cc.SYS, [DOCS[1], DOCS[2], DOCS[3]], "Plain or chunked?")
    exp = cc.expected_structure(raw_tok, prompt)
    generate(tiny_llama_llm, [prompt])
    out = generate(tiny_llama_llm, [{"prompt_token_ids": exp.token_ids}])[0]
    causal = cc.hf_reference.greedy(hf_model, exp.token_ids, MAX_TOKENS)
    assert list(out.outputs[0].token_ids) == causal.tokens


def test_no_cache_salt_reaches_chunk_blocks(tiny_llama_llm, hf_model, raw_tok):
    """A salt spelling the chunk namespace as the old string marker did gets no chunk-path block."""
    prompt = cc.chunked(cc.SYS, [DOCS[4], DOCS[6]], "Salted or chunked?")
    exp = cc.expected_structure(raw_tok, prompt)
    generate(tiny_llama_llm, [prompt])
    salt = f"chunk-cache:{cc.DEFAULT_LAYOUT}:{exp.sys_len}:{','.join(map(str, exp.chunk_lens))}"
    out = generate(tiny_llama_llm, [{"prompt_token_ids": exp.token_ids, "cache_salt": salt}])[0]
    assert out.num_cached_tokens == 0
    assert (
        list(out.outputs[0].token_ids) == cc.hf_reference.greedy(hf_model, exp.token_ids, MAX_TOKENS).tokens
    )


def test_prefix_caching_still_hits_for_ordinary_prompts(tiny_llama_llm):
    prompt = "An ordinary prompt. " + cc.document(7, 400)
    first, second = (generate(tiny_llama_llm, [prompt])[0] for _ in range(2))
    assert second.num_cached_tokens >= 256 and first.outputs[0].token_ids == second.outputs[0].token_ids


def test_aborts_leave_no_pins(tiny_llama_llm, coordinator):
    from vllm import SamplingParams

    engine = tiny_llama_llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=32, temperature=0.0)
    ids = []
    for i in range(6):
        ids.append(f"abort-me-{i}")
        docs = [cc.document(200 + i, 300), cc.document(300 + i % 2, 200), DOCS[i]]
        engine.add_request(ids[-1], cc.chunked(cc.SYS, docs, f"Question {i}?"), params)
    engine.step()
    engine.step()
    engine.abort_request(ids[::2])
    while scheduler.has_unfinished_requests():
        engine.step()
    manager = coordinator.manager
    assert manager.pinned_entries == 0
    assert not coordinator.users and not coordinator.prefills
    assert all(e.resident for e in manager.entries.values())
    assert manager.used_pages == sum(len(e.pages) for e in manager.entries.values())


def test_reset_drops_the_pool_even_with_chunk_prefills_in_flight(
    tiny_llama_llm, hf_model, raw_tok, coordinator
):
    """`reset_prefix_cache` (e.g. after a weight update) drops the pool: documents are computed
    again. A reset while the chunk prefills of an aborted request still run must not hand their
    pages to new entries: the answers after it still equal the reference."""
    from vllm import SamplingParams

    engine, manager = tiny_llama_llm.llm_engine, coordinator.manager
    warm = cc.chunked(cc.SYS, DOCS[:2], "Before the reset?")
    check(tiny_llama_llm, hf_model, raw_tok, [warm])
    engine.add_request(
        "orphan",
        cc.chunked(cc.SYS, [cc.document(400, 900), cc.document(401, 700)], "Never answered?"),
        SamplingParams(max_tokens=4),
    )
    engine.step()  # its chunk prefills are running
    engine.abort_request(["orphan"])
    assert coordinator.prefills
    tiny_llama_llm.reset_prefix_cache()  # False: vLLM's prefix cache keeps the orphans' blocks
    assert manager.entries == {} and manager.used_pages > 0  # the orphans' pages stay taken
    prefills, hits = manager.stats.chunk_prefills, manager.stats.hits
    after = [
        cc.chunked(cc.SYS, DOCS[:2], "After the reset?"),
        cc.chunked(cc.SYS, [cc.document(402, 600), DOCS[3]], "And a new one?"),
    ]
    check(tiny_llama_llm, hf_model, raw_tok, after)
    assert manager.stats.hits == hits, "nothing from before the reset is loaded"
    assert manager.stats.chunk_prefills - prefills == 4  # every chunk again (SYS with the first)
    assert not coordinator.prefills and manager.pinned_entries == 0
    assert manager.used_pages == sum(len(e.pages) for e in manager.entries.values())


def _full_graph_dispatcher(vllm_config):
    """vLLM's cudagraph dispatcher for this engine as CUDA runs it by default (FULL_AND_PIECEWISE)."""
    import copy

    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    config = copy.copy(vllm_config)
    compilation = config.compilation_config = copy.deepcopy(vllm_config.compilation_config)
    compilation.mode = CompilationMode.VLLM_COMPILE
    compilation.splitting_ops = list(compilation._attention_ops)
    compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = [1, 2, 4, 8], 8
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, uniform_decode_query_len=1)
    return dispatcher


def test_a_chunk_prefill_step_replayed_from_a_full_graph_fills_its_entry(tiny_llama_llm, hf_model, raw_tok):
    """The last piece of a chunk prefill is one token, scheduled with a one-token decode: vLLM's
    dispatcher sends that step to a full CUDA graph, whose replay runs no Python inside the
    attention op. The pool is filled from the paged cache after the step (nothing of ours runs in
    the op), so requests that load the entry answer exactly as the reference."""
    import inspect

    from vllm import SamplingParams
    from vllm.model_executor.layers.attention import attention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "chunk" not in inspect.getsource(attention.unified_attention_with_output)
    engine = tiny_llama_llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    budget = scheduler.max_num_scheduled_tokens
    doc = _text_of_length(raw_tok, budget - len(raw_tok.encode(cc.SYS).ids))  # SYS + doc = budget
    prompts = [cc.chunked(cc.SYS, [doc], q) for q in ("What is it about?", "Again?")]

    steps, schedule = [], scheduler.schedule
    scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    try:
        engine.add_request(
            "decoding",
            "An ordinary prompt that keeps decoding",
            SamplingParams(max_tokens=12, ignore_eos=True),
        )
        engine.step()  # its prefill; from now on it decodes one token per step
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
        engine.add_request("chunked", prompts[0], params)  # its prefill: budget - 1 tokens, then 1
        outputs = {}
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step() if o.finished}
    finally:
        scheduler.schedule = schedule
    dispatcher = _full_graph_dispatcher(engine.vllm_config)
    saved = [s for s in steps if s.kv_connector_metadata.save_rows]
    modes = []
    for step in saved:
        counts = list(step.num_scheduled_tokens.values())
        uniform = GPUModelRunner._is_uniform_decode(max(counts), 1, sum(counts), len(counts))
        modes.append(dispatcher.dispatch(sum(counts), uniform_decode=uniform)[0].name)
    assert modes[-1] == "FULL", f"chunk prefill steps dispatched as {modes}"

    warm = generate(tiny_llama_llm, prompts[1:])  # loads the entry again
    for prompt, out in zip(prompts, [outputs["chunked"], *warm], strict=True):
        exp, ref = cc.reference(hf_model, raw_tok, prompt, MAX_TOKENS)
        assert out.prompt_token_ids == exp.token_ids and exp.chunk_lens == [budget - exp.sys_len]
        gen = out.outputs[0]
        logprobs = [s[t].logprob for s, t in zip(gen.logprobs, gen.token_ids, strict=True)]
        cc.assert_matches(gen.token_ids, logprobs, ref, "a chunk loaded after a full-graph step")


def _text_of_length(raw_tok, num_tokens: int) -> str:
    """A document of exactly `num_tokens` tokens (whole words, then one-token fillers)."""

    def length(text: str) -> int:
        return len(raw_tok.encode(text, add_special_tokens=False).ids)

    text = ""
    for word in " ".join(cc.document(500 + i, 40) for i in range(40)).split():
        if length(f"{text} {word}".strip()) > num_tokens:
            break
        text = f"{text} {word}".strip()
    while length(text) < num_tokens:
        text += " a"
    assert length(text) == num_tokens
    return text
