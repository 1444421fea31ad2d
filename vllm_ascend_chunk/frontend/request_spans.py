"""Explicit chunk structure of a token-id prompt sent to the OpenAI server.

Offline, a client that tokenizes itself sends `{"prompt_token_ids": SYS + C_1 + ... + C_n + Q,
"chunk_spans": {"sys_len": ..., "chunk_lens": [...]}}` (`frontend.tokenize`). On
`/v1/completions` the same structure comes in `vllm_xargs`:

    {"prompt": SYS + C_1 + ... + C_n + Q,
     "vllm_xargs": {"chunk_spans": {"sys_len": len(SYS), "chunk_lens": [len(C_1), ...]}}}

and travels as the opt-out does (`frontend.opt_out`): the request's `build_tok_params` (patch
`...completion.protocol`) puts it on `TokenizeParams.chunk_spans` (patch `vllm.renderers.params`),
and the renderer (`tokenize.take_spans`, patch `vllm.renderers.base`) gives it to the token-id
prompt, where it is checked and served exactly as an offline prompt's `chunk_spans`: same
checks, same messages, truncation refused the same way.

vLLM 0.23 types `/v1/completions`' `vllm_xargs` values as scalars (string, integer, float), so
the spans are accepted as a JSON object (turned into its JSON text before pydantic validates the
request, `as_xargs_text`) or as that JSON text itself; every other `vllm_xargs` key keeps vLLM's
type. Spans are for one token-id prompt: a text prompt, a batch of several prompts, prompt
embeddings or chat messages with `chunk_spans` are refused (HTTP 400). With `"chunk_cache":
false` the spans are dropped, as offline: the prompt is served as an ordinary one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vllm_ascend_chunk.frontend import opt_out
from vllm_ascend_chunk.frontend.parser import ChunkPromptError
from vllm_ascend_chunk.frontend.tokenize import SPANS_KEY


def as_xargs_text(data: Any) -> Any:
    """Before pydantic validates a request: a `chunk_spans` JSON object (or array) in its
    `vllm_xargs` becomes its JSON text, which vLLM's scalar-valued `vllm_xargs` accepts."""
    if not isinstance(data, Mapping):
        return data
    xargs = data.get("vllm_xargs")
    if not isinstance(xargs, Mapping) or not isinstance(xargs.get(SPANS_KEY), Mapping | list):
        return data
    return {**data, "vllm_xargs": {**xargs, SPANS_KEY: json.dumps(xargs[SPANS_KEY])}}


def _decoded(value: object) -> object:
    """The spans a `vllm_xargs` value stands for: the object its JSON text encodes, else the
    value itself (which the renderer then refuses with the usage message)."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return value if decoded is None else decoded
    return value


def _not_one_token_prompt(prompt: object, prompt_embeds: object) -> str | None:
    """What a request carries instead of exactly one token-id prompt, or None."""
    if prompt_embeds is not None:
        return "prompt_embeds"
    if isinstance(prompt, str):
        return "a text prompt"
    if not isinstance(prompt, list) or not prompt:
        return "no token-id prompt"
    if all(isinstance(t, int) for t in prompt):
        return None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        return _not_one_token_prompt(prompt[0], None)
    if all(isinstance(p, str) for p in prompt):
        return "a text prompt" if len(prompt) == 1 else f"a batch of {len(prompt)} text prompts"
    if all(isinstance(p, list) for p in prompt):
        return f"a batch of {len(prompt)} prompts (spans are per prompt: send one request each)"
    return "chat messages (send the token ids to /v1/completions)"


def from_xargs(
    xargs: Mapping[str, Any] | None, prompt: object, prompt_embeds: object = None
) -> object | None:
    """The `chunk_spans` a request's `TokenizeParams` carry to the renderer, or None (absent, or
    dropped by `"chunk_cache": false`).

    Refuses (`ChunkPromptError`, HTTP 400) spans on anything but exactly one token-id prompt
    (`[ids...]` or `[[ids...]]`). Their shape and lengths are checked by the renderer against
    the prompt's ids, as an offline prompt's `chunk_spans` are.
    """
    if not xargs or SPANS_KEY not in xargs or not opt_out.from_extra(xargs):
        return None
    if (other := _not_one_token_prompt(prompt, prompt_embeds)) is not None:
        raise ChunkPromptError(
            f"'{SPANS_KEY}' in vllm_xargs needs exactly one token-id prompt (\"prompt\": [ids...]); "
            f"this request has {other}"
        )
    return _decoded(xargs[SPANS_KEY])
