"""Renderer hooks: per-part tokenization of chunked text, and span checks.

Called from vLLM's `BaseRenderer._tokenize_singleton_prompt[_async]` (patch
`vllm.renderers.base`). Contract (`docs/design/design.md`, Semantics): SYSTEM is tokenized as
vLLM tokenizes a whole prompt of that request (BOS with it when the request adds special
tokens); each chunk and the QUESTION with `add_special_tokens=False`; the delimiter text
produces no tokens.

A token-id prompt carries the structure explicitly:
`{"prompt_token_ids": SYS + C_1 + ... + C_n + Q, "chunk_spans": {"sys_len": len(SYS),
"chunk_lens": [len(C_1), ..., len(C_n)]}}`; the question is the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from vllm_ascend_chunk.config.engine_settings import engine_settings, is_active
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.frontend import opt_out
from vllm_ascend_chunk.frontend.parser import ChunkPromptError, ParsedPrompt, parser_for

SPANS_KEY = "chunk_spans"
"""Key of the chunk structure in vLLM's prompt dicts (`TokensPrompt`, engine inputs)."""


def chunking(vllm_config, params) -> bool:
    """Whether this engine runs the chunk cache and this request (`TokenizeParams`) did not opt out."""
    return is_active(vllm_config) and not opt_out.opted_out(params)


def _split_text(prompt: Mapping[str, Any], params, vllm_config) -> ParsedPrompt | None:
    if getattr(params, SPANS_KEY, None) is not None:  # spans sent with the request (`request_spans`)
        raise ChunkPromptError(f"'{SPANS_KEY}' needs a token-id prompt; this request has a text prompt")
    if not chunking(vllm_config, params) or prompt.get("multi_modal_data"):
        return None
    return parser_for(engine_settings(vllm_config).delimiter).split(prompt["prompt"])


def _pieces(parsed: ParsedPrompt, add_special_tokens: bool) -> list[tuple[str, bool]]:
    """(text, add_special_tokens) for SYS, every chunk, then the question."""
    rest = [(text, False) for text in (*parsed.chunks, parsed.question)]
    return [(parsed.system, add_special_tokens), *rest]


def _assemble(prompt: Mapping[str, Any], ids: list[list[int]]) -> dict[str, Any]:
    system, *chunks, _ = ids
    token_ids = [t for part in ids for t in part]
    # A document that tokenizes to nothing is dropped like an empty one (it adds no tokens).
    spans = make_spans(len(system), [len(c) for c in chunks if c], len(token_ids))
    return {**prompt, "prompt_token_ids": token_ids, SPANS_KEY: spans}


def tokenize_chunked(tokenizer, prompt: Mapping[str, Any], params, vllm_config) -> dict[str, Any] | None:
    """The `TokensPrompt` of a chunked text prompt, or None for an ordinary prompt."""
    parsed = _split_text(prompt, params, vllm_config)
    if parsed is None:
        return None
    pieces = _pieces(parsed, params.add_special_tokens)
    return _assemble(prompt, [tokenizer.encode(t, add_special_tokens=s) for t, s in pieces])


async def tokenize_chunked_async(
    async_tokenizer, prompt: Mapping[str, Any], params, vllm_config
) -> dict[str, Any] | None:
    """`tokenize_chunked` through vLLM's micro-batching async tokenizer."""
    parsed = _split_text(prompt, params, vllm_config)
    if parsed is None:
        return None
    encode: Callable[..., Awaitable[list[int]]] = async_tokenizer.encode
    pieces = _pieces(parsed, params.add_special_tokens)
    ids = await asyncio.gather(*(encode(t, add_special_tokens=s) for t, s in pieces))
    return _assemble(prompt, list(ids))


def take_spans(prompt: dict[str, Any], params, vllm_config) -> None:
    """Before vLLM's post-tokenization (truncation, padding): an explicit `chunk_spans` of a
    token-id prompt becomes `ChunkSpans` of the ids as sent, so that `check_spans` sees it cut.
    Spans sent with the request (`TokenizeParams.chunk_spans`, from `vllm_xargs` on the OpenAI
    server: `frontend.request_spans`) are the prompt's own from here on."""
    if SPANS_KEY not in prompt and (sent := getattr(params, SPANS_KEY, None)) is not None:
        prompt[SPANS_KEY] = sent
    given = prompt.get(SPANS_KEY)
    ids_only = "prompt_embeds" not in prompt and not prompt.get("multi_modal_data")
    if (
        isinstance(given, Mapping)
        and "prompt_token_ids" in prompt
        and ids_only
        and chunking(vllm_config, params)
    ):
        prompt[SPANS_KEY] = spans_from(given, len(prompt["prompt_token_ids"]))


def check_spans(prompt: dict[str, Any], params, vllm_config) -> dict[str, Any]:
    """After vLLM's post-tokenization: the prompt's spans as validated `ChunkSpans`.

    Refuses truncation or padding that cut into (or shifted) the chunks of a tokenized text
    prompt, and validates an explicit `chunk_spans` of a token-id prompt against its ids.
    Spans are dropped where the engine does not run the chunk cache or the request opted out.
    """
    given = prompt.get(SPANS_KEY)
    if given is None:
        return prompt
    if not chunking(vllm_config, params):
        prompt.pop(SPANS_KEY)
        return prompt
    if "prompt_token_ids" not in prompt or "prompt_embeds" in prompt or prompt.get("multi_modal_data"):
        raise ChunkPromptError(
            f"'{SPANS_KEY}' needs a plain token-id prompt (no prompt_embeds, no multi-modal data)"
        )
    n = len(prompt["prompt_token_ids"])
    if isinstance(given, ChunkSpans) and given.num_tokens != n:
        what = []
        if params.truncate_prompt_tokens is not None:
            what.append(f"truncate_prompt_tokens={params.truncate_prompt_tokens}")
        if params.pad_prompt_tokens is not None:
            what.append(f"pad_prompt_tokens={params.pad_prompt_tokens}")
        raise ChunkPromptError(
            f"The chunked prompt has {given.num_tokens} tokens but {n} remain after "
            f"{' and '.join(what) or 'post-processing'}; truncation and padding would cut into "
            "its documents. Shorten the documents or raise the limit."
        )
    prompt[SPANS_KEY] = spans_from(given, n)
    return prompt


SPANS_USAGE = (
    "'chunk_spans' must be {'sys_len': int >= 0, 'chunk_lens': [int >= 1, ...]} with "
    "sys_len + sum(chunk_lens) < len(prompt_token_ids)"
)


def spans_from(given: object, num_tokens: int) -> ChunkSpans:
    """The `ChunkSpans` of a prompt's `chunk_spans` value: a user's dict, or spans already made."""
    if isinstance(given, ChunkSpans):
        return make_spans(given.sys_len, given.chunk_lens, num_tokens, explicit=True)
    if not isinstance(given, Mapping) or set(given) != {"sys_len", "chunk_lens"}:
        raise ChunkPromptError(f"{SPANS_USAGE} = {num_tokens}; got {given!r}")
    return make_spans(given["sys_len"], given["chunk_lens"], num_tokens, explicit=True)


def make_spans(sys_len: object, chunk_lens: object, num_tokens: int, *, explicit: bool = False) -> ChunkSpans:
    """The one constructor of `ChunkSpans`: SYS of `sys_len` tokens, the chunks, and a question
    of at least one token (the rest of `num_tokens`); anything else is a `ChunkPromptError`.
    `explicit`: the lengths are a client's `chunk_spans`, which the message then names."""
    ints = isinstance(chunk_lens, list) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in [sys_len, *chunk_lens]
    )
    if not ints or sys_len < 0 or any(n < 1 for n in chunk_lens):
        raise ChunkPromptError(
            f"{SPANS_USAGE} = {num_tokens}; got sys_len={sys_len!r}, chunk_lens={chunk_lens!r}"
        )
    question_len = num_tokens - sys_len - sum(chunk_lens)
    if question_len < 1:  # the scheduler needs a token to compute after the loaded chunks
        hint = f" ('{SPANS_KEY}' needs sys_len + sum(chunk_lens) < len(prompt_token_ids))" if explicit else ""
        raise ChunkPromptError(
            f"The question of the chunked prompt has no tokens: SYSTEM and documents take "
            f"{num_tokens - question_len} of its {num_tokens} tokens. Put at least one token "
            f"after the last document{hint}."
        )
    return ChunkSpans(sys_len=sys_len, chunk_lens=list(chunk_lens), question_len=question_len)


def carry_spans(prompt: Mapping[str, Any], engine_input: dict[str, Any]) -> None:
    """Copy the spans from the tokenized prompt into vLLM's engine input dict."""
    if (spans := prompt.get(SPANS_KEY)) is not None:
        engine_input[SPANS_KEY] = spans


def carry_token_spans(
    prompt: Mapping[str, Any],
    engine_input: dict[str, Any],
    renderer,
    tokenization_kwargs: dict[str, Any] | None,
) -> None:
    """Legacy `InputPreprocessor` path of a token-id prompt: its explicit spans, taken from the
    ids as sent and checked against the ids that remain after truncation (as the renderer path
    does), into the engine input."""
    if SPANS_KEY not in prompt:
        return
    params = renderer.default_cmpl_tok_params.with_kwargs(**(tokenization_kwargs or {}))
    sent = dict(prompt)
    take_spans(sent, params, renderer.config)
    final = {**sent, "prompt_token_ids": engine_input["prompt_token_ids"]}
    carry_spans(check_spans(final, params, renderer.config), engine_input)
