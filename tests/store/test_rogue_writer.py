"""Engines sharing a real Mooncake Store with a rogue writer (tests/store/rogue.py): it lists and
reads every object and knows the format, names, headers and key ids, but not the secret. After
an honest engine has stored five documents, it forges one's payload, replays another document's
object as a third and another model's object (same shapes) as a fourth. An engine with the
secret serves none of them: each is rejected, computed instead and written again, signed; every
answer equals the HF reference. (Without the secret the same engine serves all three and answers
wrongly: docs/operator/tiers.md.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from harness import chunk_cases as cc
from harness.mooncake_store import MooncakeProcs, wait_for
from tests.engine.test_chunk_engines import check_round
from tests.helpers.engine_runner import run_engine
from tests.store import rogue
from tests.store.test_shared_engines import remote_env
from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake.kv_object import KVHeader
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore

SECRET = "k3y-shared-by-every-honest-instance"
MAX_TOKENS = 8


def env(procs: MooncakeProcs) -> dict[str, str]:
    return remote_env(procs, **({"VLLM_CHUNK_CACHE_REMOTE_SECRET": SECRET} if SECRET else {}))


def by_length(client, names: list[str], model: str) -> dict[int, str]:
    """The objects of `model`, by token count (the documents' counts differ)."""
    found = {}
    for name in names:
        fields, _, _ = rogue.read(client, name)
        if fields["model"] == model:
            found[fields["num_tokens"]] = name
    return found


def test_a_rogue_writer_cannot_change_an_answer(mooncake: MooncakeProcs, models_dir: Path, raw_tok, tmp_path):
    docs = [cc.document(1400 + i, 60 + 7 * i) for i in range(5)]
    lens = cc.expected_structure(raw_tok, cc.chunked(cc.SYS, docs, "?")).chunk_lens
    sys_len = cc.expected_structure(raw_tok, cc.chunked(cc.SYS, docs, "?")).sys_len
    assert len({*lens, sys_len}) == 6  # the rogue tells the objects apart by their length
    llama = models_dir / "tiny-llama"
    # Another model with the same shapes (other weights), served next to it with the secret.
    other = tmp_path / "other-llama"
    shutil.copytree(models_dir / "tiny-llama3", other)
    first = [cc.chunked(cc.SYS, docs[:3], "First?"), cc.chunked(cc.SYS, docs[3:], "Then?")]
    for model_dir, prompts in [(llama, first), (other, [cc.chunked(cc.SYS, docs[2:3], "Other?")])]:
        (state,) = run_engine(model_dir, [{"prompts": prompts}], {}, env(mooncake))["states"]
        assert state["remote_write_drops"] == 0 and state["remote_bytes_written"] > 0, state

    raw = mooncake.raw_client()
    try:
        ours = by_length(raw, rogue.names(mooncake), str(llama))
        theirs = by_length(raw, rogue.names(mooncake), str(other))
        assert set(ours) == {*lens, sys_len} and set(theirs) == {sys_len, lens[2]}, (ours, theirs)
        # Forged payload: document 0's header and signature, its K/V perturbed, checksum right.
        fields, signature, kv = rogue.read(raw, ours[lens[0]])
        rogue.replace(raw, ours[lens[0]], rogue.build(fields, signature, kv + 0.5 * torch.randn_like(kv)))
        # Replay: document 3's object as document 1's (K/V cut or repeated to its length).
        fields, _, _ = rogue.read(raw, ours[lens[1]])
        _, signature, kv = rogue.read(raw, ours[lens[3]])
        kv = kv.repeat(1, 1, 2, 1, 1)[:, :, : lens[1]]
        rogue.replace(raw, ours[lens[1]], rogue.build(fields, signature, kv))
        # Another model's object of document 2, as this model's.
        fields, _, _ = rogue.read(raw, ours[lens[2]])
        _, signature, kv = rogue.read(raw, theirs[lens[2]])
        rogue.replace(raw, ours[lens[2]], rogue.build(fields, signature, kv))
    finally:
        raw.close()

    prompts = [
        cc.chunked(cc.SYS, [docs[0], docs[1], docs[2]], "Which came first?"),
        cc.chunked(cc.SYS, [docs[2], docs[4], docs[1]], "Which one is last?"),
        cc.chunked(cc.SYS, [docs[3], docs[0]], "And these two?"),
    ]
    victim = run_engine(llama, [{"prompts": prompts}], {}, env(mooncake))
    model, _ = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, prompts, victim["rounds"][0], MAX_TOKENS, "next to a rogue writer")
    (state,) = victim["states"]
    assert (state["remote_rejected"], state["chunk_prefills"]) == (3, 3), state
    # Read: SYS and the five documents; SYS and documents 3 and 4 arrived, genuine.
    assert (state["remote_reads"], state["remote_read_failures"], state["remote_hits"]) == (6, 3, 2), state
    assert state["remote_corrupt"] == 0

    # The rejected objects were computed and written again: an instance with the secret reads
    # every document of this model from the store.
    raw = mooncake.raw_client()
    try:
        headers = {name: KVHeader(**rogue.read(raw, name)[0]) for name in ours.values()}
    finally:
        raw.close()
    config = RemoteConfig(mooncake.master_address, mooncake.metadata_server, secret=SECRET.encode())
    store = RemoteStore(config)
    try:
        wait_for(lambda: store.up, 10, "client connected")
        assert all(store.get(n, h).result(timeout=30) is not None for n, h in headers.items())
    finally:
        store.close()
