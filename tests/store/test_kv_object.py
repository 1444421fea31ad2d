"""The stored object format: round trips, and every way a blob is refused."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from vllm_ascend_chunk.tiers.mooncake.kv_object import (
    FORMAT_VERSION,
    MAGIC,
    KVHeader,
    KVObjectError,
    SigningKey,
    decode,
    encode,
    object_size,
)


def header(dtype: torch.dtype = torch.float32, **changes) -> KVHeader:
    base = KVHeader(
        key="ab" * 16,
        model="tiny-llama",
        dtype=str(dtype),
        layout="nhd",
        num_tokens=7,
        num_layers=3,
        num_kv_heads=2,
        head_size=8,
        tp_rank=0,
        tp_size=1,
    )
    return dataclasses.replace(base, **changes)


def kv_for(h: KVHeader) -> torch.Tensor:
    return torch.randn(h.shape, generator=torch.Generator().manual_seed(0)).to(h.torch_dtype)


def reason(blob: bytes | bytearray, expected: KVHeader, key: SigningKey | None = None) -> str:
    with pytest.raises(KVObjectError) as caught:
        decode(bytes(blob), expected, key)
    return caught.value.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip(dtype: torch.dtype) -> None:
    h = header(dtype)
    kv = kv_for(h)
    blob = encode(h, kv)
    assert object_size(h) == len(blob)  # what a reader fetches, in parts, before decoding
    out = decode(blob, h)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out, kv)
    assert h.version == FORMAT_VERSION


def test_non_contiguous_input_and_memoryview_blob() -> None:
    h = header()
    kv = kv_for(h)
    strided = kv.transpose(2, 3).contiguous().transpose(2, 3)
    assert not strided.is_contiguous()
    assert torch.equal(decode(memoryview(encode(h, strided)), h), kv)


def test_encode_refuses_kv_not_matching_header() -> None:
    h = header()
    with pytest.raises(ValueError):
        encode(h, kv_for(h).to(torch.float16))
    with pytest.raises(ValueError):
        encode(dataclasses.replace(h, num_tokens=8), kv_for(h))


def test_refusals() -> None:
    h = header()
    blob = encode(h, kv_for(h))
    assert reason(b"", h) == "truncated"
    assert reason(b"garbage!" * 4, h) == "magic"
    assert reason(blob[:-1], h) == "truncated"
    assert reason(blob[:40], h) == "truncated"
    assert reason(blob + b"\0", h) == "size"
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40
    assert reason(flipped, h) == "checksum"
    # The same bytes read as another model's, rank's or length's entry.
    for change in ({"model": "other"}, {"tp_rank": 1}, {"key": "cd" * 16}, {"dtype": "torch.float16"}):
        assert reason(blob, header(**change)) == "foreign", change
    assert reason(blob, header(version=FORMAT_VERSION + 1)) == "version"
    # A header that is not JSON, and one with a field the reader does not know.
    assert reason(with_header(b"{x}", blob, h), h) == "header"
    extra = json.dumps({**dataclasses.asdict(h), "extra": 1}).encode()
    assert reason(with_header(extra, blob, h), h) == "foreign"


def with_header(meta: bytes, blob: bytes, h: KVHeader) -> bytes:
    """`blob` with its header replaced by `meta` (checksum, signature and payload kept)."""
    tail = blob[len(blob) - h.payload_bytes - 8 - 32 :]
    return MAGIC + struct.pack("<I", len(meta)) + meta + tail


KEY = SigningKey(b"the secret every instance shares")


def signed(dtype: torch.dtype = torch.float32, signing_key: SigningKey = KEY, **changes) -> KVHeader:
    return header(dtype, key_id=signing_key.id, **changes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_roundtrip(dtype: torch.dtype) -> None:
    h = signed(dtype)
    kv = kv_for(h)
    blob = encode(h, kv, KEY)
    assert object_size(h) == len(blob)
    assert torch.equal(decode(blob, h, KEY), kv)
    # The key id names the key without revealing it; neither does the key's repr.
    assert KEY.id == SigningKey(b"the secret every instance shares").id != SigningKey(b"x" * 32).id
    assert b"secret" not in KEY.id.encode() and "secret" not in repr(KEY)


def test_a_key_and_a_header_that_disagree_are_a_bug() -> None:
    with pytest.raises(ValueError, match="key id"):
        encode(header(), kv_for(header()), KEY)
    with pytest.raises(ValueError, match="key id"):
        decode(encode(header(), kv_for(header())), signed(), None)


def forge(h: KVHeader, kv: torch.Tensor, signature: bytes = bytes(32)) -> bytes:
    """What a writer without the secret can make: a well-formed object of header `h` (checksum
    right) with a signature of its choice."""
    blob = bytearray(encode(dataclasses.replace(h, key_id=""), kv))
    meta = json.dumps(dataclasses.asdict(h), sort_keys=True, separators=(",", ":")).encode()
    blob = bytearray(with_header(meta, bytes(blob), h))
    start = len(blob) - h.payload_bytes - 32
    blob[start : start + 32] = signature
    return bytes(blob)


def test_a_reader_with_a_key_refuses_what_it_did_not_sign() -> None:
    h = signed()
    genuine = encode(h, kv_for(h), KEY)
    other_kv = -kv_for(h)
    assert reason(encode(header(), other_kv), h, KEY) == "unsigned"
    other_key = SigningKey(b"another deployment's secret!")
    assert reason(encode(signed(signing_key=other_key), other_kv, other_key), h, KEY) == "key"
    # Forged: the right header and key id, a checksum that matches, any signature but the right one.
    assert reason(forge(h, other_kv), h, KEY) == "signature"
    assert (
        reason(forge(h, other_kv, genuine[len(genuine) - h.payload_bytes - 32 :][:32]), h, KEY) == "signature"
    )
    # Altered: a bit of the payload (its checksum fixed too), or the header made another entry's.
    flipped = bytearray(genuine)
    flipped[-3] ^= 0x40
    assert reason(flipped, h, KEY) == "signature"
    other = dataclasses.replace(h, key="cd" * 16)
    meta = json.dumps(dataclasses.asdict(other), sort_keys=True, separators=(",", ":")).encode()
    assert reason(with_header(meta, genuine, h), other, KEY) == "signature"
    # Rewritten to another format version, or its header edited in any other way.
    for change in ({"version": FORMAT_VERSION - 1}, {"version": 99}, {"num_tokens": 6}):
        meta = json.dumps({**dataclasses.asdict(h), **change}, sort_keys=True).encode()
        assert reason(with_header(meta, genuine, h), h, KEY) == (
            "version" if "version" in change else "signature"
        )
    # Not an object at all, or cut short: nothing this key signed either.
    assert reason(b"garbage!" * 40, h, KEY) == "magic"
    assert reason(genuine[:-1], h, KEY) == "signature"
    assert reason(genuine[:40], h, KEY) == "truncated"
    assert reason(with_header(b"{x}", genuine, h), h, KEY) == "header"


def rejected(blob: bytes, expected: KVHeader, key: SigningKey | None = KEY) -> bool:
    with pytest.raises(KVObjectError) as caught:
        decode(blob, expected, key)
    return caught.value.rejected


def test_with_a_key_every_object_it_did_not_sign_for_this_entry_is_rejected() -> None:
    h = signed()
    genuine = encode(h, kv_for(h), KEY)
    for blob in (
        b"garbage!" * 40,
        genuine[:40],
        genuine[:-1],
        encode(header(), kv_for(h)),
        forge(h, -kv_for(h)),
    ):
        assert rejected(blob, h)
    # Without a key nothing is rejected: the store is trusted, a bad object is corrupt.
    assert not rejected(b"garbage!" * 40, header(), None) and not rejected(genuine, header(), None)


def test_a_genuine_object_of_another_entry_is_a_replay_and_a_reader_without_a_key_keeps_out() -> None:
    """The signature is checked first, then the header against the entry asked for: the header
    holds the key and the shard the object's name is made of, so the signature covers the name."""
    h = signed()
    genuine = encode(h, kv_for(h), KEY)
    for change in ({"model": "other"}, {"pp_rank": 1}, {"key": "cd" * 16}, {"num_tokens": 6}):
        with pytest.raises(KVObjectError, match=next(iter(change))) as caught:
            decode(genuine, signed(**change), KEY)
        assert (caught.value.reason, caught.value.rejected) == ("replay", True), change
    # Readers without a secret do not load signed objects (nor do instances share across keys).
    assert reason(genuine, header()) == "foreign"
