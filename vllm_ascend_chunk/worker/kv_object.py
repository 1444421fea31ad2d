"""The format of one entry's KV as stored in a remote tier: a self-describing, checksummed blob.

Layout: `MAGIC` | header length (u32, little endian) | header (JSON) | payload checksum (u64,
xxh3-64) | payload (the raw bytes of the contiguous `[layers, 2, tokens, kv_heads, head_size]`
tensor). A reader says what it expects (`KVHeader`); anything else is refused with a
`KVObjectError`, never returned: another model's, rank's or format version's object, a truncated or
corrupt one.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass

import torch
import xxhash

FORMAT_VERSION = 1
"""Bumped whenever the layout or the header's meaning changes; older objects become misses."""

MAGIC = b"CCKVOBJ\0"
_LENGTH = struct.Struct("<I")
_CHECKSUM = struct.Struct("<Q")


class KVObjectError(ValueError):
    """A blob is not the expected object. `reason`: "magic", "truncated", "version", "header",
    "foreign", "size" or "checksum"."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class KVHeader:
    """What an object holds; a reader's `expected` must match it field for field."""

    key: str
    """Hex of the entry key."""
    model: str
    dtype: str
    """`str(torch.dtype)`, e.g. "torch.bfloat16"."""
    layout: str
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int
    tp_size: int
    version: int = FORMAT_VERSION

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {self.dtype!r}")
        return dtype

    @property
    def payload_bytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.num_tokens
            * self.num_kv_heads
            * self.head_size
            * (self.torch_dtype.itemsize)
        )


def encode(header: KVHeader, kv: torch.Tensor) -> bytes:
    """The object for `kv`, a CPU tensor of `header.shape` in `header.dtype`."""
    if kv.device.type != "cpu" or tuple(kv.shape) != header.shape or kv.dtype != header.torch_dtype:
        raise ValueError(
            f"KV {tuple(kv.shape)} {kv.dtype} on {kv.device} does not match its header "
            f"({header.shape} {header.dtype} on cpu)"
        )
    payload = memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy())
    meta = _meta(header)
    return b"".join(
        (MAGIC, _LENGTH.pack(len(meta)), meta, _CHECKSUM.pack(xxhash.xxh3_64_intdigest(payload)), payload)
    )


def object_size(header: KVHeader) -> int:
    """The length of `encode(header, kv)`: what a reader expecting `header` fetches."""
    return len(MAGIC) + _LENGTH.size + len(_meta(header)) + _CHECKSUM.size + header.payload_bytes


def _meta(header: KVHeader) -> bytes:
    return json.dumps(dataclasses.asdict(header), sort_keys=True, separators=(",", ":")).encode()


def decode(blob: bytes | memoryview, expected: KVHeader) -> torch.Tensor:
    """The tensor in `blob` (a new one, `expected.shape` in `expected.dtype`), or `KVObjectError`."""
    view = memoryview(blob).cast("B")
    if len(view) < len(MAGIC) + _LENGTH.size:
        raise KVObjectError("truncated", f"{len(view)} bytes")
    if view[: len(MAGIC)] != MAGIC:
        raise KVObjectError("magic")
    meta_start = len(MAGIC) + _LENGTH.size
    (meta_len,) = _LENGTH.unpack_from(view, len(MAGIC))
    payload_start = meta_start + meta_len + _CHECKSUM.size
    if len(view) < payload_start:
        raise KVObjectError("truncated", f"{len(view)} bytes, header ends at {payload_start}")
    try:
        fields = json.loads(bytes(view[meta_start : meta_start + meta_len]))
    except ValueError as e:
        raise KVObjectError("header", str(e)) from None
    if not isinstance(fields, dict):
        raise KVObjectError("header", "not an object")
    if fields.get("version") != expected.version:
        raise KVObjectError("version", f"{fields.get('version')!r}, expected {expected.version}")
    differing = sorted(
        name
        for name in {f.name for f in dataclasses.fields(KVHeader)} | fields.keys()
        if fields.get(name) != getattr(expected, name, None)
    )
    if differing:
        raise KVObjectError("foreign", ", ".join(differing))
    payload = view[payload_start:]
    if len(payload) != expected.payload_bytes:
        reason = "truncated" if len(payload) < expected.payload_bytes else "size"
        raise KVObjectError(reason, f"payload {len(payload)} bytes, expected {expected.payload_bytes}")
    (checksum,) = _CHECKSUM.unpack_from(view, payload_start - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise KVObjectError("checksum")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(expected.torch_dtype).view(expected.shape)
