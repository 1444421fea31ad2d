"""The remote tier with two workers per engine (issue 29), against a real Mooncake Store: every
worker writes and reads its own object of an entry (TP=2: its KV heads; PP=2: its stage's
layers); an engine of another parallel layout never reads them; an entry one worker cannot read
is a miss for the whole engine, computed again. Answers are checked against the HF reference."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from harness.mooncake_store import MooncakeProcs
from tests.engine.test_chunk_engines import check_round
from tests.engine.test_model_parallel import BIND, PP2, TP2, needs_two_cores
from tests.helpers.engine_runner import run_engine
from tests.store.test_shared_engines import remote_env
from vllm_ascend_chunk.tiers.mooncake.kv_object import FORMAT_VERSION

DOCS = [cc.document(540 + i, 70) for i in range(3)]
PROMPTS = [cc.chunked(cc.SYS, DOCS[:2], "First two?"), cc.chunked(cc.SYS, DOCS[1:], "Last two?")]
ENTRIES = 1 + len(DOCS)  # SYS and each document
PARALLEL = {"TP=2": (TP2, {"tp0of2", "tp1of2"}), "PP=2": (PP2, {"tp0of1-pp0of2", "tp0of1-pp1of2"})}

pytestmark = needs_two_cores


def objects(procs: MooncakeProcs) -> set[str]:
    """Names of the entries' objects in the store (the master's HTTP interface)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{procs.metrics_port}/get_all_keys", timeout=5) as r:
        names = r.read().decode().split()
    return {name for name in names if name.startswith(f"chunk-cache/v{FORMAT_VERSION}/")}


def served(procs: MooncakeProcs, models_dir: Path, engine: dict, env: dict) -> dict:
    """One engine's run of PROMPTS, its answers checked; its chunk-cache state."""
    env = {**env, **remote_env(procs)}
    result = run_engine(models_dir / "tiny-llama", [{"prompts": PROMPTS}], engine, env)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, PROMPTS, result["rounds"][0], 8, f"engine {engine}")
    (state,) = result["states"]
    return state


@pytest.fixture(scope="module")
def one_worker(mooncake: MooncakeProcs, models_dir: Path) -> tuple[dict, set[str]]:
    """An engine of one worker computed every entry: its state, and the store's objects then."""
    state = served(mooncake, models_dir, {}, {})
    assert state["remote_hits"] == 0 and state["remote_read_failures"] == ENTRIES
    written = objects(mooncake)
    assert len(written) == ENTRIES and all(name.endswith("/tp0of1") for name in written)
    return state, written


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_each_worker_shares_its_own_objects(
    parallel: str, mooncake: MooncakeProcs, models_dir: Path, one_worker: tuple[dict, set[str]]
):
    engine, shards = PARALLEL[parallel]
    (alone, alone_objects) = one_worker
    first = served(mooncake, models_dir, engine, BIND)
    assert first["remote_hits"] == 0 and first["remote_read_failures"] == ENTRIES, "read another layout's"
    assert first["chunk_prefills"] == alone["chunk_prefills"]
    written = objects(mooncake) - alone_objects
    written = {name for name in written if name.rsplit("/", 1)[1] in shards}
    assert {name.rsplit("/", 1)[1] for name in written} == shards and len(written) == 2 * ENTRIES

    # One entry loses the object of its second worker: the others are read, that one computed.
    lost = sorted(name for name in written if name.endswith(sorted(shards)[1]))[0]
    client = mooncake.raw_client()
    try:
        assert client.remove(lost, True) == 0
    finally:
        client.close()
    second = served(mooncake, models_dir, engine, BIND)
    assert second["remote_reads"] == ENTRIES and second["remote_read_failures"] == 1, second
    assert second["chunk_prefills"] == 1, second
    assert second["remote_bytes_read"] > 0 and second["remote_errors"] == 0
    assert lost in objects(mooncake), "the entry computed again is written again"
