"""Per-request opt-out: `chunk_cache: false` serves a prompt that contains delimiters (pasted
code, markdown rules, earlier chat turns) as ordinary text.

The renderer tokenizes before any `SamplingParams` exist, so the choice travels in
`TokenizeParams.chunk_cache` (patch `vllm.renderers.params`), filled from `vllm_xargs` by the
completions and chat requests' `build_tok_params` (patches `...completion.protocol`,
`...chat_completion.protocol`) and offline from `SamplingParams.extra_args` through the
tokenization kwargs (patch `vllm.entrypoints.offline_utils`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_ascend_chunk.config.variables import bool_word
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

KEY = "chunk_cache"
"""Name of the opt-out in `vllm_xargs`, `SamplingParams.extra_args` and tokenization kwargs."""


def parse(value: object) -> bool:
    """A request's `chunk_cache` value: false/"false"/"0" opt out, true/"true"/"1" keep it on."""
    if (parsed := bool_word(str(value))) is None:
        raise ChunkPromptError(
            f"'{KEY}' must be false (serve the prompt as ordinary text, its '# #' "
            f"not a delimiter) or true; got {value!r}"
        )
    return parsed


def from_extra(extra: Mapping[str, Any] | None) -> bool:
    """The choice in `vllm_xargs` / `SamplingParams.extra_args` (absent: the chunk cache is used)."""
    return parse(extra[KEY]) if extra and KEY in extra else True


def take(kwargs: dict[str, Any], default: bool) -> bool:
    """The choice the tokenization kwargs carry, taken out of them (absent: `default`)."""
    return parse(kwargs.pop(KEY, default))


def tokenization_kwargs(kwargs: dict[str, Any] | None, params: object) -> dict[str, Any] | None:
    """Offline: the tokenization kwargs of one request, with the choice of its `extra_args`."""
    extra = getattr(params, "extra_args", None)
    if not extra or KEY not in extra:
        return kwargs
    return {**(kwargs or {}), KEY: from_extra(extra)}


def opted_out(tok_params: object) -> bool:
    """Whether the request behind these `TokenizeParams` opted out (its prompt is not chunked)."""
    return not getattr(tok_params, KEY, True)
