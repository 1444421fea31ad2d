"""Two engines (one process each) sharing documents through a real Mooncake Store: what A
computed is read by B instead of computed, and B's answers equal the independent HF reference.
A third engine meets a store that is not there: it serves every request by computing."""

from __future__ import annotations

from pathlib import Path

from harness import chunk_cases as cc
from harness.mooncake_store import MooncakeProcs
from harness.serve_util import free_port
from tests.engine.test_chunk_engines import check_round
from tests.helpers.engine_runner import run_engine


def remote_env(procs_or_master: MooncakeProcs | str, **extra: str) -> dict[str, str]:
    if isinstance(procs_or_master, MooncakeProcs):
        master, metadata = procs_or_master.master_address, procs_or_master.metadata_server
    else:
        master, metadata = procs_or_master, f"http://{procs_or_master.split(':')[0]}:1/metadata"
    return {
        "VLLM_CHUNK_CACHE_REMOTE_MASTER": master,
        "VLLM_CHUNK_CACHE_REMOTE_METADATA": metadata,
        "VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S": "2",
        **extra,
    }


def test_documents_computed_by_one_engine_are_read_by_another(mooncake: MooncakeProcs, models_dir: Path):
    docs = [cc.document(500 + i, 80) for i in range(4)]
    first = [cc.chunked(cc.SYS, docs[:2], "What is first?"), cc.chunked(cc.SYS, docs[2:], "And next?")]
    second = [cc.chunked(cc.SYS, [docs[3], docs[0]], "Mixed?"), cc.chunked(cc.SYS, docs[1:3], "Middle?")]
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")

    a = run_engine(models_dir / "tiny-llama", [{"prompts": first}], {}, remote_env(mooncake))
    check_round(model, raw_tok, first, a["rounds"][0], 8, "A computes")
    (a_state,) = a["states"]
    assert a_state["misses"] == 4 and a_state["remote_hits"] == 0
    assert a_state["remote_up"] == 1  # (its writes finish after the steps: B shows them)

    b = run_engine(models_dir / "tiny-llama", [{"prompts": second}], {}, remote_env(mooncake))
    check_round(model, raw_tok, second, b["rounds"][0], 8, "B reads A's documents")
    (b_state,) = b["states"]
    assert (b_state["remote_hits"], b_state["misses"], b_state["chunk_prefills"]) == (4, 0, 0), b_state
    assert b_state["remote_read_failures"] == 0 and b_state["remote_bytes_read"] > 0


def test_an_engine_whose_store_is_down_computes_everything(models_dir: Path):
    docs = [cc.document(520 + i, 60) for i in range(2)]
    prompts = [cc.chunked(cc.SYS, docs, "Store down?"), cc.chunked(cc.SYS, docs[::-1], "Still?")]
    result = run_engine(
        models_dir / "tiny-llama", [{"prompts": prompts}], {}, remote_env(f"127.0.0.1:{free_port()}")
    )
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, prompts, result["rounds"][0], 8, "store down")
    (state,) = result["states"]
    assert state["misses"] == 2 and state["hits"] == 2 and state["remote_up"] == 0
    assert state["remote_hits"] == 0
