"""A server whose operator set the per-request limits low (`VLLM_CHUNK_CACHE_MAX_DOCS=4`,
`VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS=320`): a request over either is a 400 naming the setting, a
request within both (a document repeated counts once in the pool) is served as the HF reference,
and the server keeps serving on the same connection."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import chunk_cases as cc
from tests.helpers import server_utils
from vllm_ascend_chunk.core.paging import pages_for

MAX_TOKENS = 4
LIMITS = {"VLLM_CHUNK_CACHE_MAX_DOCS": "4", "VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS": "320"}
DOCS = [cc.document(1300 + i, 100) for i in range(3)]


def pool_rows(raw_tok, prompt: str) -> int:
    """The pool rows a prompt's SYS and distinct documents take (independent tokenization)."""
    exp = cc.expected_structure(raw_tok, prompt)
    _, *docs, _ = cc.DELIMITER.split(prompt)
    distinct = {doc: n for doc, n in zip(docs, exp.chunk_lens, strict=True)}
    return 16 * sum(pages_for(n, 16) for n in (exp.sys_len, *distinct.values()))


def test_requests_over_the_operators_limits_are_a_400_naming_the_setting(
    models_dir: Path, tmp_path: Path, raw_tok
):
    import openai

    too_many = cc.chunked(cc.SYS, ["one", "two", "three", "four", "five"], "Five?")
    too_large = cc.chunked(cc.SYS, DOCS, "Three long ones?")
    repeated = cc.chunked(cc.SYS, [DOCS[0], DOCS[1], DOCS[0], DOCS[1]], "Two, twice?")
    assert pool_rows(raw_tok, too_large) > 320 >= pool_rows(raw_tok, repeated)
    model, _ = cc.reference_tools(models_dir, "tiny-llama")
    with server_utils.vllm_server(models_dir / "tiny-llama", tmp_path / "serve.log", env=LIMITS) as url:
        client = server_utils.client(url)
        for prompt, match in [
            (too_many, "brings 5 documents; VLLM_CHUNK_CACHE_MAX_DOCS=4"),
            (too_large, r"VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS=320 allows one request"),
        ]:
            with pytest.raises(openai.BadRequestError, match=match):
                server_utils.greedy(client, prompt, MAX_TOKENS)
            choice = server_utils.greedy(client, repeated, MAX_TOKENS)
            ref = cc.reference(model, raw_tok, repeated, MAX_TOKENS)[1]
            cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, "within the limits")
