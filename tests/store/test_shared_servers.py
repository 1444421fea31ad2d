"""Two real `vllm serve` instances sharing documents through a real Mooncake Store (master and
store process on loopback), talked to with a real HTTP client: what A computed is read by B,
answers equal the independent HF reference; the master killed in the middle of a stream and
started again: every request is still served right, and the tier comes back."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from harness.mooncake_store import MooncakeProcs
from tests.helpers import server_utils
from tests.store.test_shared_engines import remote_env


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> MooncakeProcs:
    procs = MooncakeProcs(tmp_path_factory.mktemp("mooncake"))
    try:
        yield procs.start()
    finally:
        procs.stop()


@pytest.fixture(scope="module")
def pair(store: MooncakeProcs, models_dir: Path, tmp_path_factory) -> tuple[str, str]:
    logs = tmp_path_factory.mktemp("servers")
    env = remote_env(store, VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S="2")
    with contextlib.ExitStack() as stack:
        a, b = (
            stack.enter_context(server_utils.vllm_server(models_dir / "tiny-llama", logs / f"{n}.log", env))
            for n in ("a", "b")
        )
        yield a, b


@pytest.fixture(scope="module")
def tiny(models_dir: Path):
    return cc.reference_tools(models_dir, "tiny-llama")


def ask(url: str, prompt: str, tiny, what: str, stream: bool = False) -> None:
    """A greedy completion of `prompt` on `url`, checked against the HF reference."""
    model, raw_tok = tiny
    kwargs = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    body = {"ignore_eos": True, "return_token_ids": True}
    client = server_utils.client(url)
    exp, ref = cc.reference(model, raw_tok, prompt, 6)
    if stream:
        tokens, logprobs = [], []
        for chunk in client.completions.create(**kwargs, stream=True, extra_body=body):
            tokens += chunk.choices[0].token_ids or []
            logprobs += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    else:
        choice = client.completions.create(**kwargs, extra_body=body).choices[0]
        assert choice.prompt_token_ids == exp.token_ids
        tokens, logprobs = choice.token_ids, choice.logprobs.token_logprobs
    cc.assert_matches(tokens, logprobs, ref, what)


def settle_writes(url: str) -> None:
    """Until the remote writes of `url` stop growing (the counters move with engine steps: an
    ordinary one-token request makes one)."""
    client = server_utils.client(url)
    last = -1
    for _ in range(50):
        client.completions.create(model="tiny-llama", prompt="ping", max_tokens=1)
        now = server_utils.metrics(url).remote_bytes_written
        if now == last and now > 0:
            return
        last = now
        time.sleep(0.2)
    raise AssertionError(f"remote writes never settled ({last} bytes)")


def test_documents_computed_by_a_are_read_by_b(pair, tiny):
    a, b = pair
    docs = [cc.document(600 + i, 70) for i in range(3)]
    ask(a, cc.chunked(cc.SYS, docs, "What do they say?"), tiny, "A, cold")
    settle_writes(a)
    before = server_utils.metrics(b)
    ask(b, cc.chunked(cc.SYS, docs[::-1], "And backwards?"), tiny, "B, documents from A")
    after = server_utils.wait_metrics(b, lambda m: m.remote_hits >= before.remote_hits + 3)
    assert (after.remote_hits - before.remote_hits, after.miss_count - before.miss_count) == (3, 0)
    assert after.chunk_prefills == before.chunk_prefills and after.remote_up


def test_the_master_killed_mid_stream_then_started_again(pair, store: MooncakeProcs, tiny):
    a, b = pair
    docs = [cc.document(620 + i, 70) for i in range(4)]
    stream_prompt = cc.chunked(cc.SYS, docs[:2], "Streamed while the store goes?")
    client = server_utils.client(a)
    stream = client.completions.create(
        model="tiny-llama",
        prompt=stream_prompt,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    store.kill_master()
    rest = "".join(c.choices[0].text for c in stream)
    assert first.choices[0].text + rest  # the stream finished

    # Down: documents nobody has are computed, and answers stay right on both instances.
    ask(b, cc.chunked(cc.SYS, docs[2:], "With the store gone?"), tiny, "B, store down")
    ask(a, cc.chunked(cc.SYS, docs[1:3], "Still?"), tiny, "A, store down", stream=True)
    down = server_utils.wait_metrics(b, lambda m: not m.remote_up)
    assert not down.remote_up and down.remote_errors + down.remote_read_failures > 0

    store.start_master()  # an empty store: what was written before is gone
    fresh = [cc.document(640 + i, 70) for i in range(2)]
    deadline = time.monotonic() + 60
    while not server_utils.metrics(a).remote_up:  # the tier reconnects in the background
        assert time.monotonic() < deadline, "the remote tier never came back"
        server_utils.client(a).completions.create(model="tiny-llama", prompt="ping", max_tokens=1)
        time.sleep(0.5)
    ask(a, cc.chunked(cc.SYS, fresh, "After the restart?"), tiny, "A, store back")
    settle_writes(a)
    deadline = time.monotonic() + 60
    while not server_utils.metrics(b).remote_up:
        assert time.monotonic() < deadline, "B's remote tier never came back"
        server_utils.client(b).completions.create(model="tiny-llama", prompt="ping", max_tokens=1)
        time.sleep(0.5)
    before = server_utils.metrics(b)
    ask(b, cc.chunked(cc.SYS, fresh[::-1], "Read back?"), tiny, "B, store back")
    after = server_utils.wait_metrics(b, lambda m: m.remote_hits >= before.remote_hits + 2)
    assert after.remote_hits - before.remote_hits == 2
