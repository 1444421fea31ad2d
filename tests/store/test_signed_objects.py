"""Signed objects against a real Mooncake master and store process: a rogue writer that knows
everything but the secret (tests/store/rogue.py) makes forged, unsigned, other-key and replayed
objects; a client with the secret serves none of them, counts each as rejected, logs each cause
once, and removes them so that the next honest writer writes them again. Through engines, with
answers checked against the HF reference: test_rogue_writer.py."""

from __future__ import annotations

import dataclasses
import logging

import torch

from harness.mooncake_store import MooncakeProcs
from tests.store import rogue
from tests.store.test_remote_store import MakeStore, connected, get, header, kv_for, written
from vllm_ascend_chunk.tiers.mooncake.kv_object import SigningKey

SECRET = b"shared by every honest instance"


def signed(name: str, secret: bytes = SECRET, **changes):
    return header(name, key_id=SigningKey(secret).id, **changes)


def test_a_rogue_writer_without_the_secret_is_never_served(
    mooncake: MooncakeProcs, remote_store: MakeStore, caplog
) -> None:
    honest = connected(mooncake, remote_store, secret=SECRET)
    docs = {f"doc-{c}": signed(f"doc-{c}") for c in "abcdefg"}
    for i, (name, h) in enumerate(docs.items()):
        written(honest, name, h, kv_for(h, i))
    theirs = signed("doc-g", model="another-model")  # another model of the same shapes
    written(honest, "theirs-g", theirs, kv_for(theirs, 9))
    raw = mooncake.raw_client()
    try:
        a_fields, a_signature, a_kv = rogue.read(raw, "doc-a")
        # Forged payload: doc-b's header and signature, other KV, its checksum right.
        b_fields, b_signature, b_kv = rogue.read(raw, "doc-b")
        rogue.replace(raw, "doc-b", rogue.build(b_fields, b_signature, -b_kv))
        # Replayed: doc-a's genuine object under doc-c's name, its header made doc-c's ...
        c_fields, _, _ = rogue.read(raw, "doc-c")
        rogue.replace(raw, "doc-c", rogue.build(c_fields, a_signature, a_kv))
        # ... and verbatim (the header still says doc-a).
        rogue.replace(raw, "doc-d", rogue.build(a_fields, a_signature, a_kv))
        # Unsigned, as an instance without the secret writes it; and signed with another secret.
        e_fields = {**dataclasses.asdict(docs["doc-e"]), "key_id": ""}
        rogue.replace(raw, "doc-e", rogue.build(e_fields, bytes(32), a_kv))
        other = SigningKey(b"a secret the rogue made up itself")
        f_fields = {**dataclasses.asdict(docs["doc-f"]), "key_id": other.id}
        rogue.replace(raw, "doc-f", rogue.build(f_fields, bytes(32), a_kv))
        # Another model's genuine object, its header made this model's.
        g_fields, _, _ = rogue.read(raw, "doc-g")
        _, theirs_signature, theirs_kv = rogue.read(raw, "theirs-g")
        rogue.replace(raw, "doc-g", rogue.build(g_fields, theirs_signature, theirs_kv))

        reader = connected(mooncake, remote_store, secret=SECRET)
        with caplog.at_level(logging.WARNING, logger="vllm.chunk_cache"):
            assert torch.equal(get(reader, "doc-a", docs["doc-a"])[0], kv_for(docs["doc-a"], 0))
            for name in ("doc-b", "doc-c", "doc-d", "doc-e", "doc-f", "doc-g"):
                assert get(reader, name, docs[name])[0] is None, name
            rogue.replace(raw, "doc-c", rogue.build(c_fields, b_signature, a_kv))  # forged again
            assert get(reader, "doc-c", docs["doc-c"])[0] is None
        stats = reader.stats()
        assert (stats.hits, stats.rejected, stats.corrupt) == (1, 6, 1), stats  # doc-d: foreign
        # One warning per cause: forged or altered, unsigned, another key; the foreign replay is
        # a corrupt object (rate-limited warning of its own).
        refused = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
        assert len(refused) == 3, refused
        assert [c for c in ("(signature)", "(unsigned", "(key:") if any(c in m for m in refused)] == [
            "(signature)",
            "(unsigned",
            "(key:",
        ], refused
        # The rejected objects are gone: the next honest writer writes them again.
        assert [raw.is_exist(n) for n in ("doc-b", "doc-c", "doc-e", "doc-f", "doc-g")] == [0] * 5
        assert raw.is_exist("doc-d") == 1  # foreign: left alone, as an unsigned reader does
    finally:
        raw.close()
    written(honest, "doc-b", docs["doc-b"], kv_for(docs["doc-b"], 1))
    assert torch.equal(get(reader, "doc-b", docs["doc-b"])[0], kv_for(docs["doc-b"], 1))


def test_an_instance_without_the_secret_and_one_with_it_do_not_share(
    mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    trusting = connected(mooncake, remote_store)
    signing = connected(mooncake, remote_store, secret=SECRET)
    h = header("shared-doc")
    written(trusting, "shared-doc", h, kv_for(h))
    assert get(signing, "shared-doc", signed("shared-doc"))[0] is None
    assert signing.stats().rejected == 1
    s = signed("signed-doc")
    written(signing, "signed-doc", s, kv_for(s))
    assert get(trusting, "signed-doc", header("signed-doc"))[0] is None  # foreign to it
    assert trusting.stats().corrupt == 1 and trusting.stats().rejected == 0
