"""The patch series' one entry point into the package: every name a patch in `patches/` calls.

Each hook names the function it stands for, imported when the hook is first called: vLLM's
modules import this one at their top, long before the package's frontend, engine config or
worker may be imported (they import vLLM themselves). `ChunkCacheInfo` is the exception, a type
that vLLM's request structs declare as a field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from vllm_ascend_chunk.core.request_info import ChunkCacheInfo as ChunkCacheInfo
from vllm_ascend_chunk.core.request_info import servable as servable


def _hook(path: str) -> Callable[..., Any]:
    """A function that calls `path` ("package.module.name"), imported at its first call."""
    module, _, name = path.rpartition(".")
    target: Callable[..., Any] | None = None

    def hook(*args: Any, **kwargs: Any) -> Any:
        nonlocal target
        if target is None:
            target = getattr(importlib.import_module(module), name)
        return target(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"`{path}`"
    return hook


_PACKAGE = "vllm_ascend_chunk"
# The frontend (patches vllm.inputs.preprocess, vllm.renderers.*, vllm.entrypoints.*,
# vllm.v1.engine.input_processor).
tokenize_chunked = _hook(f"{_PACKAGE}.frontend.tokenize.tokenize_chunked")
tokenize_chunked_async = _hook(f"{_PACKAGE}.frontend.tokenize.tokenize_chunked_async")
take_spans = _hook(f"{_PACKAGE}.frontend.tokenize.take_spans")
check_spans = _hook(f"{_PACKAGE}.frontend.tokenize.check_spans")
carry_spans = _hook(f"{_PACKAGE}.frontend.tokenize.carry_spans")
carry_token_spans = _hook(f"{_PACKAGE}.frontend.tokenize.carry_token_spans")
spans_from_xargs = _hook(f"{_PACKAGE}.frontend.request_spans.from_xargs")
spans_as_xargs_text = _hook(f"{_PACKAGE}.frontend.request_spans.as_xargs_text")
opt_out_from_extra = _hook(f"{_PACKAGE}.frontend.opt_out.from_extra")
opt_out_tokenization_kwargs = _hook(f"{_PACKAGE}.frontend.opt_out.tokenization_kwargs")
take_opt_out = _hook(f"{_PACKAGE}.frontend.opt_out.take")
chunk_cache_info = _hook(f"{_PACKAGE}.frontend.keys.chunk_cache_info")
# The engine's configuration and its pool (patches vllm.config.vllm, vllm.v1.engine.core*).
configure = _hook(f"{_PACKAGE}.config.engine.configure")
carve_out_pool = _hook(f"{_PACKAGE}.config.engine.carve_out_pool")
apply_ready_response = _hook(f"{_PACKAGE}.config.engine.apply_ready_response")
recorded_pages = _hook(f"{_PACKAGE}.config.engine_settings.recorded_pages")
# The scheduler (patches vllm.v1.core.kv_cache_utils, vllm.v1.core.sched.scheduler).
block_hash_keys = _hook(f"{_PACKAGE}.scheduler.block_keys.block_hash_keys")
# The model runner (patches vllm.v1.worker.gpu_model_runner, vllm_ascend.worker.model_runner_v1).
prepare_step = _hook(f"{_PACKAGE}.vllm_adapter.runner_hooks.prepare_step")
bind_model = _hook(f"{_PACKAGE}.vllm_adapter.runner_hooks.bind_model")


def cap_new_tokens(scheduler, request, num_new_tokens: int, num_computed_tokens: int) -> int:
    """`Scheduler.schedule`, where a running or waiting request's new tokens are counted: a
    `qattn` request computes its passes piece by piece (`ChunkCacheScheduler.chunk_token_cap`;
    any other scheduler has none)."""
    cap = getattr(scheduler, "chunk_token_cap", None)
    return num_new_tokens if cap is None else cap(request, num_new_tokens, num_computed_tokens)
