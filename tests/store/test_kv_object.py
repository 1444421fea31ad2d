"""The stored object format: round trips, and every way a blob is refused."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from vllm_ascend_chunk.worker.kv_object import (
    FORMAT_VERSION,
    MAGIC,
    KVHeader,
    KVObjectError,
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


def reason(blob: bytes | bytearray, expected: KVHeader) -> str:
    with pytest.raises(KVObjectError) as caught:
        decode(bytes(blob), expected)
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
    """`blob` with its header replaced by `meta` (checksum and payload kept)."""
    tail = blob[len(blob) - h.payload_bytes - 8 :]
    return MAGIC + struct.pack("<I", len(meta)) + meta + tail
