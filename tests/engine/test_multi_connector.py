"""The chunk cache next to vLLM's other KV connectors, in vLLM's `MultiConnector` (engines of their own).

- MooncakeStoreConnector (a prefix-keyed store; Mooncake's `mooncake_master` is started here, TCP
  transport, on free ports): chunked prompts are answered as the HF reference, cold and after a
  reset of the prefix cache (which drops the chunk pool, not the store: a chunked prompt whose
  blocks the store holds whole is loaded from it, the others' documents are computed again by
  chunk prefills, which the store never sees); ordinary
  prompts are answered as the HF reference too, and after the reset they are loaded from the
  store (cached tokens with an empty prefix cache).
- ExampleConnector (vLLM's example, KV to files; no HMA support): the engine starts and answers
  as the HF reference.
- OffloadingConnector (CPU offloading) cannot run on this CPU-only build, with or without the
  chunk cache: its worker refuses the CPU platform when it registers the KV caches
  (`vllm/v1/kv_offload/cpu/spec.py`, `CPUOffloadingSpec.get_handlers`: "CPU Offloading is
  currently only supported on CUDA-alike and XPU GPUs"). The engine start shows it is that
  error, after the chunk cache was configured next to it, and nothing of ours.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from harness.serve_util import free_ports
from tests.engine.test_chunk_engines import check_round
from tests.helpers.engine_runner import run_engine

MASTER = Path(sys.executable).parent / "mooncake_master"


def multi(*children: dict) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


@pytest.fixture
def mooncake_config(tmp_path: Path):
    """A running `mooncake_master` (with its HTTP metadata server) and the JSON config of
    vLLM's `MooncakeStoreConfig` for it; yields the config's path."""
    if not MASTER.exists():
        pytest.skip(f"Mooncake Store is not installed ({MASTER} missing)")
    rpc, http = free_ports(2)
    log = (tmp_path / "mooncake_master.log").open("w")
    master = subprocess.Popen(
        [
            str(MASTER),
            f"-rpc_port={rpc}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={http}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", http), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "metadata_server": f"http://127.0.0.1:{http}/metadata",
                "master_server_address": f"127.0.0.1:{rpc}",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": 2**27,
                "local_buffer_size": 2**27,
            }
        )
    )
    yield config
    master.terminate()
    master.wait(timeout=30)
    log.close()


def test_chunk_cache_next_to_mooncake_store(models_dir: Path, mooncake_config: Path):
    chunked, ordinary = cc.next_to_a_block_store()
    rounds = [
        {"prompts": chunked + ordinary},
        {"prompts": chunked + ordinary, "reset_prefix_cache": True},
    ]
    result = run_engine(
        models_dir / "tiny-llama",
        rounds,
        {"kv_transfer_config": multi({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})},
        {"MOONCAKE_CONFIG_PATH": str(mooncake_config)},
    )
    assert result["engine"]["scheduler"] == "ChunkCacheScheduler"
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    for rnd, res, what in zip(rounds, result["rounds"], ["cold", "after a reset"], strict=True):
        check_round(model, raw_tok, rnd["prompts"], res, 8, f"next to Mooncake, {what}")
    cold, after_reset = result["states"]
    assert (cold["hits"], cold["misses"]) == (1, 3)  # docs[0] planned by the first request
    # The pool was dropped. The store (`kv_both`: it loads) holds the first chunked prompt's
    # blocks whole, written by that prompt (chunk namespace): it loads that prompt, documents
    # included; the second one's documents are computed again by chunk prefills.
    assert cold["external_loads"] == 0
    assert (
        after_reset["external_loads"],
        after_reset["misses"] - cold["misses"],
        after_reset["chunk_prefills"] - cold["chunk_prefills"],
    ) == (1, 2, 2)
    assert after_reset["pinned_entries"] == after_reset["users"] == after_reset["prefills"] == 0
    # The ordinary prompts were computed cold, then loaded from the store (the prefix cache was
    # empty after the reset): whole 128-token blocks, the last prompt token always computed.
    assert [r["cached"] for r in result["rounds"][0][2:]] == [0, 0]
    for res in result["rounds"][1][2:]:
        assert res["cached"] == (len(res["prompt_ids"]) - 1) // 128 * 128 > 0


def test_chunk_cache_next_to_a_connector_without_hma(models_dir: Path, tmp_path: Path):
    """vLLM's ExampleConnector does not support the hybrid KV cache manager: vLLM turns the
    manager off for it, with the chunk cache as without (it used to be left on, and the
    MultiConnector refused to start)."""
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    chunked, ordinary = cc.next_to_a_block_store()
    rounds = [{"prompts": chunked + ordinary}]
    result = run_engine(models_dir / "tiny-llama", rounds, {"kv_transfer_config": example})
    assert result["engine"]["scheduler"] == "ChunkCacheScheduler"
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, rounds[0]["prompts"], result["rounds"][0], 8, "next to ExampleConnector")


def test_offloading_connector_cannot_run_on_the_cpu_platform(models_dir: Path):
    offloading = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2**26},
    }
    with pytest.raises(AssertionError) as failed:
        run_engine(models_dir / "tiny-llama", [], {"kv_transfer_config": multi(offloading)})
    log = str(failed.value)
    assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in log
    assert "multi_connector.py" in log  # raised inside the MultiConnector, chunk cache first
