"""A prefill/decode pair (`python -m tools.deploy.pd_pair`: two `vllm serve`, vLLM's `ExampleConnector`
as `kv_producer` and `kv_consumer`, a proxy), in each layout, driven by an OpenAI client: the
decode instance loads a chunked prompt's whole KV, documents included, from the prefill instance
and answers as the HF reference of a single instance does; what it cannot load whole, and what
asks for a recovery mode, it serves itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from harness import hf_reference
from harness.serve_util import free_port
from tests.helpers import REPO, server_utils

BLOCK = 32
"""The pair's KV block size: `ExampleConnector` moves the prompt's whole blocks but the last."""
MAX_TOKENS = 6
LONG_QUESTION = "Which of the ferries in these notes leaves first in the morning, and from which pier " * 2


@pytest.fixture(scope="module", params=["sequential", "overlap"])
def pair(request, models_dir: Path, tmp_path_factory):
    """The running pair in a layout: {"proxy", "prefill", "decode"} → URL, and its "layout"."""
    tmp = tmp_path_factory.mktemp("pd")
    port = free_port()
    command = [
        sys.executable, "-m", "tools.deploy.pd_pair", str(models_dir / "tiny-llama"), "--port", str(port),
        "--storage", str(tmp / "kv"), "--log-dir", str(tmp),
        # Each instance's model worker in its engine-core process, as on one GPU or NPU (on a CPU,
        # vLLM would start a third process per instance).
        *(f"--server-env={name}={value}" for name, value in server_utils.WORKER_IN_ENGINE_CORE.items()),
        "--",
        "--served-model-name", "tiny-llama", "--dtype", "float32", "--max-model-len", "4096",
        "--seed", "0", "--block-size", str(BLOCK),
    ]  # fmt: skip
    env = os.environ | {"VLLM_CHUNK_CACHE_LAYOUT": request.param}
    with (tmp / "pd_pair.out").open("w+") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            urls = wait_ready(proc, tmp / "pd_pair.out", f"http://127.0.0.1:{port}")
            yield urls | {"layout": request.param}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def wait_ready(proc: subprocess.Popen, out: Path, proxy: str, timeout: float = 600) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, out.read_text()[-4000:]
        text = out.read_text()
        if "P/D pair ready" in text:
            try:
                urllib.request.urlopen(proxy + "/health", timeout=5).close()
            except OSError:
                time.sleep(0.5)
                continue
            urls = {"proxy": proxy}
            for line in text.splitlines():
                for name in ("prefill", "decode"):
                    if line.startswith(f"{name} instance"):
                        urls[name] = line.split(": ", 1)[1].split(" ", 1)[0]
            return urls
        time.sleep(1)
    raise TimeoutError(out.read_text()[-4000:])


@pytest.fixture(scope="module")
def reference_tools(models_dir):
    return cc.reference_tools(models_dir, "tiny-llama")


def served(url: str, prompt: str, stream: bool = False, **extra_body):
    """Token ids and logprobs of a greedy `/v1/completions` answer."""
    choice = server_utils.greedy(server_utils.client(url), prompt, MAX_TOKENS, stream, **extra_body)
    return choice.token_ids, choice.logprobs.token_logprobs


def region_is_loaded_whole(raw_tok, prompt: str) -> bool:
    """Whether `ExampleConnector`'s load (the whole blocks before the last prompt token) covers
    the documents, i.e. only question tokens are left for the decode instance to compute."""
    exp = cc.expected_structure(raw_tok, prompt)
    return (len(exp.token_ids) - 1) // BLOCK * BLOCK >= exp.sys_len + sum(exp.chunk_lens)


def test_the_decode_instance_answers_from_the_prefill_instances_kv(pair, reference_tools):
    model, raw_tok = reference_tools
    docs = [cc.document(700 + i, 45) for i in range(4)]
    prompts = [
        cc.chunked(cc.SYS, docs[:3], LONG_QUESTION),
        cc.chunked(cc.SYS, [docs[3], docs[0]], LONG_QUESTION),
        cc.chunked(cc.SYS, docs[:3], LONG_QUESTION),  # again: the prefill instance hits its pool
    ]
    assert all(region_is_loaded_whole(raw_tok, p) for p in prompts)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = served(pair["proxy"], prompt, stream=i == 1)
        _, ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS, pair["layout"])
        cc.assert_matches(tokens, logprobs, ref, f"prompt {i}")
    # The third prompt's KV is in the decode instance's prefix cache: nothing is loaded for it.
    decode = server_utils.wait_metrics(pair["decode"], lambda m: m.external_loads >= 2)
    prefill = server_utils.metrics(pair["prefill"])
    assert (decode.external_loads, decode.chunk_prefills, decode.hit_count + decode.miss_count) == (2, 0, 0)
    assert (prefill.chunk_prefills, prefill.hit_count, prefill.miss_count) == (4, 4, 4)


def test_what_the_decode_instance_cannot_load_whole_it_serves_itself(pair, reference_tools):
    """A question shorter than the tail `ExampleConnector` leaves: its last document tokens would
    be computed as an ordinary prompt's, so the decode instance's chunk cache serves the prompt."""
    model, raw_tok = reference_tools
    prompt = next(
        p
        for i in range(20)
        if not region_is_loaded_whole(raw_tok, p := cc.chunked(cc.SYS, [cc.document(760 + i, 40)], "Why?"))
    )
    before = server_utils.metrics(pair["decode"])
    tokens, logprobs = served(pair["proxy"], prompt)
    _, ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS, pair["layout"])
    cc.assert_matches(tokens, logprobs, ref, "short question")
    after = server_utils.wait_metrics(pair["decode"], lambda m: m.chunk_prefills > before.chunk_prefills)
    assert after.external_loads == before.external_loads and after.chunk_prefills == before.chunk_prefills + 1


def test_an_ordinary_prompt_is_loaded_as_without_the_chunk_cache(pair, reference_tools):
    model, raw_tok = reference_tools
    prompt = "An ordinary prompt about the harbour. " + cc.document(790, 80)
    tokens, logprobs = served(pair["proxy"], prompt)
    ids = raw_tok.encode(prompt).ids
    ref = hf_reference.greedy(model, ids, MAX_TOKENS, sys_len=len(ids), chunk_lens=[])
    cc.assert_matches(tokens, logprobs, ref, "ordinary prompt")


def test_a_recovery_mode_is_served_by_the_decode_instance(pair, reference_tools):
    """`qattn` and `last:2` requests for a prompt whose plain KV the prefill instance already
    stored under its token ids: `ExampleConnector` keys by token ids alone (and stores a `qattn`
    prompt before its runs are recomputed), so the decode instance serves them from its own
    pool, and answers as the HF plan of the requested mode."""
    model, raw_tok = reference_tools
    layout = pair["layout"]
    prompt = cc.chunked(cc.SYS, [cc.document(840 + i, 45) for i in range(3)], LONG_QUESTION)
    assert region_is_loaded_whole(raw_tok, prompt)
    tokens, logprobs = served(pair["proxy"], prompt)
    _, plain = cc.reference(model, raw_tok, prompt, MAX_TOKENS, layout)
    cc.assert_matches(tokens, logprobs, plain, "plain")
    before = server_utils.wait_metrics(pair["decode"], lambda m: m.external_loads > 0)
    mode = "qattn:0.3/4"
    _, ref, compute = cc.qattn_reference(model, raw_tok, prompt, MAX_TOKENS, mode, layout)
    assert compute and ref.tokens != plain.tokens  # the plan's answer tells it from plain reuse
    tokens, logprobs = served(pair["proxy"], prompt, vllm_xargs={"chunk_cache_recovery": mode})
    assert tokens == ref.tokens, f"{mode} through the P/D pair"
    assert abs(logprobs[0] - float(ref.first_logprobs[ref.tokens[0]])) < 2e-3
    tokens, logprobs = served(pair["proxy"], prompt, vllm_xargs={"chunk_cache_recovery": "last:2"})
    _, ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS, layout, recovery_docs=2)
    cc.assert_matches(tokens, logprobs, ref, "last:2 through the P/D pair")
    after = server_utils.wait_metrics(pair["decode"], lambda m: m.chunk_prefills >= before.chunk_prefills + 3)
    assert after.external_loads == before.external_loads  # both served by the decode instance
