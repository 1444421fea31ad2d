"""The RAG benchmark's `vllm serve` configurations, one streamed request, and the servers' counters.

A configuration (CONFIGS) is the chunk cache on or off and vLLM's prefix caching on or off (and
`qattn`: the chunk cache with the `--qattn` recovery mode);
`make_server` builds its (not yet started) server from the benchmark's options. `ttft_request`
sends one streamed completion and times it; `read_counters` and `counter_delta` read what the
server's Prometheus counters say a request did.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness.serve_util import VllmServer

if TYPE_CHECKING:
    import openai

CONFIGS: dict[str, dict] = {
    "no_cache": {"chunk_cache": False, "prefix_caching": False, "title": "no caching"},
    "prefix": {"chunk_cache": False, "prefix_caching": True, "title": "vLLM prefix caching"},
    "chunk": {"chunk_cache": True, "prefix_caching": True, "title": "chunk cache + prefix caching"},
    "qattn": {"chunk_cache": True, "prefix_caching": True, "title": "chunk cache + qattn recovery"},
}
CHUNK_HITS, CHUNK_MISSES = "vllm:chunk_cache_hits_total", "vllm:chunk_cache_misses_total"
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
SELECTED_TOKENS = "vllm:chunk_cache_selected_tokens_total"
COVER_FALLBACKS = "vllm:chunk_cache_cover_fallbacks_total"
ITL_SUM, ITL_COUNT = "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"


def server_env(
    config: str, args: argparse.Namespace, kv_space_gb: int | None = None, pool_gb: float | None = None
) -> dict[str, str]:
    """The environment of the configuration's server (KV budget and pool from `args` unless given)."""
    # VLLM_CPU_KVCACHE_SPACE is the CPU engine's KV budget; a GPU engine ignores it and sizes its
    # cache by --gpu-memory-utilization (pass it with --server-arg).
    # VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM's CPU worker keeps one core more out of its OpenMP set
    # when a KV connector is configured (`ompmultiprocessing.py`, meant for NIXL), and the chunk
    # cache is one: left alone, on 2 cores the chunk-on server computes on 2 OpenMP threads and
    # the others on 1. The same count for every configuration keeps the comparison fair.
    recovery = "none"
    if config == "qattn":
        recovery = args.qattn
    elif CONFIGS[config]["chunk_cache"]:
        recovery = getattr(args, "recovery", "none")
    extra = dict(getattr(args, "server_env", None) or [])  # --server-env
    return {
        "VLLM_ENABLE_CHUNK_CACHE": "true" if CONFIGS[config]["chunk_cache"] else "false",
        "VLLM_CHUNK_CACHE_RECOVERY": recovery,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb if kv_space_gb is not None else args.kv_space_gb),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.cpu_reserved_cores),
        "VLLM_CHUNK_CACHE_SIZE_GB": str(pool_gb if pool_gb is not None else args.pool_gb),
    } | extra


def model_max_positions(model: Path) -> int | None:
    """The model's `max_position_embeddings` (None if its config.json has none or is unreadable)."""
    try:
        return json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def server_args(config: str, args: argparse.Namespace) -> list[str]:
    """The `vllm serve` arguments of the configuration (after the model)."""
    out = [
        "--served-model-name",
        args.served_name,
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        "0",
        "--enable-prefix-caching" if CONFIGS[config]["prefix_caching"] else "--no-enable-prefix-caching",
    ]
    if getattr(args, "load_format", "auto") != "auto":
        out += ["--load-format", args.load_format]
    limit = model_max_positions(args.model)
    if limit is not None and args.max_model_len > limit:
        # Random-weight models: a longer RoPE table is all that a longer context needs (without
        # the chunk cache, 32 x 1K documents reach position ~37,000).
        out += ["--hf-overrides", json.dumps({"max_position_embeddings": args.max_model_len})]
    return out + list(args.server_arg or [])


def make_server(
    config: str, args: argparse.Namespace, log_path: Path | None = None, **env_overrides
) -> VllmServer:
    """The configuration's server, not started (`env_overrides`: see `server_env`)."""
    return VllmServer(
        args.model,
        server_args(config, args),
        env=server_env(config, args, **env_overrides),
        log_path=log_path,
    )


def ttft_request(
    client: openai.OpenAI,
    model: str,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool = False,
    xargs: dict | None = None,
) -> dict:
    """One streamed completion: TTFT, end-to-end time, prompt tokens, text; with several tokens,
    the inter-token latency (time from the first to the last token event / tokens after the
    first: the mean gap, also when an event carries more than one token). `xargs`: the
    request's `vllm_xargs` (e.g. `chunk_cache_recovery`)."""
    start = time.perf_counter()
    ttft = last = None
    usage = None
    text = []
    extra = ({"ignore_eos": True} if ignore_eos else {}) | ({"vllm_xargs": xargs} if xargs else {})
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra or None,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            if chunk.choices[0].text:
                last = now
            text.append(chunk.choices[0].text or "")
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - start
    tokens = usage.completion_tokens if usage else None
    itl = (
        (last - start - ttft) / (tokens - 1)
        if tokens and tokens > 1 and last is not None and ttft is not None
        else None
    )
    return {
        "ttft_s": ttft if ttft is not None else e2e,
        "e2e_s": e2e,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": tokens,
        "itl_s": itl,
        "text": "".join(text),
    }


def read_counters(
    server: VllmServer,
    before: dict[str, float] | None = None,
    wait_for: tuple[str, ...] = (),
    timeout: float = 2.0,
) -> dict[str, float]:
    """The server's metrics; if `before` is given, poll until the `wait_for` counters (when the
    server has them) moved since `before`, or `timeout` passes: they are updated right after the
    response, by the next engine step's stats."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.metrics()
        present = [k for k in wait_for if k in now]
        if (
            before is None
            or not present
            or sum(now[k] for k in present) != sum(before.get(k, 0.0) for k in present)
            or time.monotonic() > deadline
        ):
            return now
        time.sleep(0.02)


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """How much counter `name` moved (None if the server does not have it)."""
    return after[name] - before.get(name, 0.0) if name in after else None
