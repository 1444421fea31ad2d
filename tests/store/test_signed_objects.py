"""Signed objects against a real Mooncake master and store process: a rogue writer that knows
everything but the secret (tests/store/rogue.py) puts, under an entry's name, every kind of
object it can make: forged, replayed (another document's or another model's genuine object),
rewritten to another format version, with an edited header, unsigned, signed with another
secret, garbage, truncated. A client with the secret serves none of them, counts each as
rejected, logs each cause once and removes it, so that one honest write puts the entry back in
the store. Through engines, with answers checked against the HF reference: test_rogue_writer.py."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch

from harness.mooncake_store import MooncakeProcs
from tests.store import rogue
from tests.store.test_remote_store import MakeStore, connected, get, header, kv_for, written
from vllm_ascend_chunk.tiers.mooncake.kv_object import FORMAT_VERSION, SigningKey
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore

SECRET = b"shared by every honest instance"
OTHER_KEY = SigningKey(b"a secret the rogue made up itself")


def signed(name: str, secret: bytes = SECRET, **changes):
    return header(name, key_id=SigningKey(secret).id, **changes)


@dataclasses.dataclass(frozen=True)
class Genuine:
    """A genuine object as the rogue reads it: header fields, signature, K/V."""

    fields: dict
    signature: bytes
    kv: torch.Tensor

    def build(self, signature: bytes | None = None, kv: torch.Tensor | None = None, **changes) -> bytes:
        """This object with its header fields changed, and another signature or K/V."""
        return rogue.build(
            {**self.fields, **changes},
            self.signature if signature is None else signature,
            self.kv if kv is None else kv,
        )


Attack = Callable[[Genuine, Genuine, Genuine], bytes]
"""What the rogue puts under the victim's name, from the victim's object, another document's
and the victim document's object of another model."""

ATTACKS: dict[str, tuple[str, Attack]] = {
    "forged-payload": ("signature", lambda v, d, t: v.build(kv=-v.kv)),
    "another-documents-object": ("replay", lambda v, d, t: d.build()),
    "another-documents-object-as-this-ones": ("signature", lambda v, d, t: v.build(d.signature, d.kv)),
    "another-models-object": ("replay", lambda v, d, t: t.build()),
    "another-models-object-as-this-models": ("signature", lambda v, d, t: v.build(t.signature, t.kv)),
    "older-format-version": ("version", lambda v, d, t: v.build(version=FORMAT_VERSION - 1)),
    "unknown-format-version": ("version", lambda v, d, t: v.build(version=FORMAT_VERSION + 7)),
    "edited-header": ("signature", lambda v, d, t: v.build(layout="hnd")),
    "unsigned": ("unsigned", lambda v, d, t: v.build(bytes(32), key_id="")),
    "another-key": ("key", lambda v, d, t: v.build(bytes(32), key_id=OTHER_KEY.id)),
    "garbage": ("magic", lambda v, d, t: b"not a kv object" * 100),
    "truncated": ("signature", lambda v, d, t: v.build()[:-100]),
}
"""Attack → the cause it is refused for (`KVObjectError.reason`), and the object it puts."""


def attacked(mooncake: MooncakeProcs, honest: RemoteStore, name: str, attack: Attack):
    """The header and K/V of entry `name`, written by `honest` and replaced by the rogue's object."""
    h, donor, theirs = signed(name), signed(f"{name}-donor"), signed(name, model="another-model")
    for n, (object_name, hx) in enumerate([(name, h), (f"{name}-donor", donor), (f"{name}-theirs", theirs)]):
        written(honest, object_name, hx, kv_for(hx, n))
    raw = mooncake.raw_client()
    try:
        victim, other_doc, other_model = (
            Genuine(*rogue.read(raw, n)) for n in (name, f"{name}-donor", f"{name}-theirs")
        )
        rogue.replace(raw, name, attack(victim, other_doc, other_model))
    finally:
        raw.close()
    return h, kv_for(h, 0)


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attack_is_never_served_and_one_honest_write_heals_it(
    mooncake: MooncakeProcs, remote_store: MakeStore, caplog, attack: str
) -> None:
    cause, make = ATTACKS[attack]
    honest = connected(mooncake, remote_store, secret=SECRET)
    h, kv = attacked(mooncake, honest, attack, make)
    reader = connected(mooncake, remote_store, secret=SECRET)
    with caplog.at_level(logging.WARNING, logger="vllm.chunk_cache"):
        assert get(reader, attack, h)[0] is None
    stats = reader.stats()
    assert (stats.rejected, stats.corrupt, stats.hits, stats.errors) == (1, 0, 0, 0), stats
    refused = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert len(refused) == 1 and f"({cause}" in refused[0], refused
    raw = mooncake.raw_client()
    try:
        assert raw.is_exist(attack) == 0, "the rogue's object outlived its read"
    finally:
        raw.close()
    # The next honest write (an instance that computed the document after the miss) is written,
    # not skipped, and every instance reads the document from the store again.
    before = honest.stats()
    written(honest, attack, h, kv)
    after = honest.stats()
    assert (after.puts - before.puts, after.put_skips - before.put_skips) == (1, 0), after
    assert torch.equal(get(reader, attack, h)[0], kv)
    assert reader.stats().hits == 1


def test_each_cause_is_logged_once(mooncake: MooncakeProcs, remote_store: MakeStore, caplog) -> None:
    honest = connected(mooncake, remote_store, secret=SECRET)
    victims = {
        f"logged-{i}": attacked(mooncake, honest, f"logged-{i}", ATTACKS[a][1])
        for i, a in enumerate(["forged-payload", "unsigned", "forged-payload", "unsigned"])
    }
    reader = connected(mooncake, remote_store, secret=SECRET)
    with caplog.at_level(logging.WARNING, logger="vllm.chunk_cache"):
        for name, (h, _) in victims.items():
            assert get(reader, name, h)[0] is None
    refused = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert len(refused) == 2 and "(signature)" in refused[0] and "(unsigned" in refused[1], refused
    assert reader.stats().rejected == 4


def test_an_instance_without_the_secret_and_one_with_it_do_not_share(
    mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    """Each refuses the other's objects and removes them: a store is shared by instances of one
    secret (or all without one), and a mixed one only replaces objects (misses, never wrong K/V)."""
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
    raw = mooncake.raw_client()
    try:
        assert [raw.is_exist(n) for n in ("shared-doc", "signed-doc")] == [0, 0]
    finally:
        raw.close()


@pytest.mark.parametrize("change", [{"model": "another-model"}, {"version": FORMAT_VERSION + 7}])
def test_without_a_secret_an_object_not_the_one_asked_for_is_corrupt_removed_and_rewritten(
    mooncake: MooncakeProcs, remote_store: MakeStore, change: dict
) -> None:
    """The store is trusted without a secret, but an object that is not the one asked for is of no
    use under this name (the name fixes every header field): it is removed, so that the next write
    replaces it (before, another model's or format's object was kept and every write skipped)."""
    store = connected(mooncake, remote_store)
    name = f"unsigned-{next(iter(change))}"
    h = header(name)
    written(store, name, h, kv_for(h))
    raw = mooncake.raw_client()
    try:
        rogue.replace(raw, name, Genuine(*rogue.read(raw, name)).build(**change))
        assert get(store, name, h)[0] is None and store.stats().corrupt == 1
        assert raw.is_exist(name) == 0
    finally:
        raw.close()
    written(store, name, h, kv_for(h))
    assert store.stats().put_skips == 0 and torch.equal(get(store, name, h)[0], kv_for(h))
