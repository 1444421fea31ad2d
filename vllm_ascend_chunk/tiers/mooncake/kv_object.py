"""The format of one entry's KV as stored in a remote tier: a self-describing, checksummed blob,
signed where the instances sharing the store share a secret.

Layout: `MAGIC` | header length (u32, little endian) | header (JSON) | payload checksum (u64,
xxh3-64) | signature (32 bytes) | payload (the raw bytes of the contiguous
`[layers, 2, tokens, kv_heads, head_size]` tensor). The signature is HMAC-SHA256 under the
secret (`SigningKey`) of everything else, header and payload; the header names the key
(`key_id`), and an unsigned object (no secret) has an empty key id and a zero signature. A reader
says what it expects (`KVHeader`); anything else is refused with a `KVObjectError`, never returned:
another model's, rank's or format version's object, a truncated or corrupt one, and, when the
reader has a secret, one it does not verify (unsigned, another key's, forged or altered).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass

import torch
import xxhash

FORMAT_VERSION = 2
"""Bumped whenever the layout or the header's meaning changes; older objects become misses.
2: the signature and the header's `key_id`, `pp_rank` and `pp_size`."""

MAGIC = b"CCKVOBJ\0"
_LENGTH = struct.Struct("<I")
_CHECKSUM = struct.Struct("<Q")
_SIGNATURE_BYTES = hashlib.sha256().digest_size
_UNSIGNED = bytes(_SIGNATURE_BYTES)
REJECTED = ("unsigned", "key", "signature")
"""The reasons of a `KVObjectError` that say an object is not authentic (a reader with a secret)."""


class KVObjectError(ValueError):
    """A blob is not the expected object. `reason`: "magic", "truncated", "version", "header",
    "foreign", "size" or "checksum"; or, for a reader with a secret, one of `REJECTED`: "unsigned"
    (no signature), "key" (signed with another secret) or "signature" (does not verify: forged, or
    altered since it was signed)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason

    @property
    def rejected(self) -> bool:
        """Whether the object is refused as not authentic (`REJECTED`)."""
        return self.reason in REJECTED


@dataclass(frozen=True)
class SigningKey:
    """The secret the instances sharing a store sign their objects with (HMAC-SHA256)."""

    secret: bytes = dataclasses.field(repr=False)

    @functools.cached_property
    def id(self) -> str:
        """Names the key in each header: a value derived from the secret that does not reveal it."""
        return hmac.new(self.secret, b"chunk-cache key id", hashlib.sha256).hexdigest()[:16]

    def sign(self, signed: memoryview, payload: memoryview) -> bytes:
        """The signature of an object: `signed` is all that precedes its signature field."""
        mac = hmac.new(self.secret, signed, hashlib.sha256)
        mac.update(payload)
        return mac.digest()


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
    pp_rank: int = 0
    pp_size: int = 1
    key_id: str = ""
    """`SigningKey.id` of the key that signs the object; empty: unsigned."""
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


def _check_key(header: KVHeader, key: SigningKey | None) -> None:
    if header.key_id != (key.id if key is not None else ""):
        raise ValueError(f"header key id {header.key_id!r} is not the signing key's")


def encode(header: KVHeader, kv: torch.Tensor, key: SigningKey | None = None) -> bytes:
    """The object for `kv`, a CPU tensor of `header.shape` in `header.dtype`, signed with `key`
    (`header.key_id` must name it; no key: unsigned, `header.key_id` empty)."""
    _check_key(header, key)
    if kv.device.type != "cpu" or tuple(kv.shape) != header.shape or kv.dtype != header.torch_dtype:
        raise ValueError(
            f"KV {tuple(kv.shape)} {kv.dtype} on {kv.device} does not match its header "
            f"({header.shape} {header.dtype} on cpu)"
        )
    payload = memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy())
    meta = _meta(header)
    signed = b"".join(
        (MAGIC, _LENGTH.pack(len(meta)), meta, _CHECKSUM.pack(xxhash.xxh3_64_intdigest(payload)))
    )
    signature = key.sign(memoryview(signed), payload) if key is not None else _UNSIGNED
    return b"".join((signed, signature, payload))


def object_size(header: KVHeader) -> int:
    """The length of `encode(header, kv)`: what a reader expecting `header` fetches."""
    return (
        len(MAGIC)
        + _LENGTH.size
        + len(_meta(header))
        + _CHECKSUM.size
        + _SIGNATURE_BYTES
        + header.payload_bytes
    )


def _meta(header: KVHeader) -> bytes:
    return json.dumps(dataclasses.asdict(header), sort_keys=True, separators=(",", ":")).encode()


def decode(blob: bytes | memoryview, expected: KVHeader, key: SigningKey | None = None) -> torch.Tensor:
    """The tensor in `blob` (a new one, `expected.shape` in `expected.dtype`), or `KVObjectError`.
    With `key` (`expected.key_id` names it) only an object it signed, unaltered, is returned."""
    _check_key(expected, key)
    view = memoryview(blob).cast("B")
    if len(view) < len(MAGIC) + _LENGTH.size:
        raise KVObjectError("truncated", f"{len(view)} bytes")
    if view[: len(MAGIC)] != MAGIC:
        raise KVObjectError("magic")
    meta_start = len(MAGIC) + _LENGTH.size
    (meta_len,) = _LENGTH.unpack_from(view, len(MAGIC))
    signature_start = meta_start + meta_len + _CHECKSUM.size
    payload_start = signature_start + _SIGNATURE_BYTES
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
    if key is not None and fields.get("key_id") != key.id:
        reason = "key" if fields.get("key_id") else "unsigned"
        raise KVObjectError(reason, f"key id {fields.get('key_id')!r}, expected {key.id!r}")
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
    if key is not None and not hmac.compare_digest(
        key.sign(view[:signature_start], payload), bytes(view[signature_start:payload_start])
    ):
        raise KVObjectError("signature")
    (checksum,) = _CHECKSUM.unpack_from(view, signature_start - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise KVObjectError("checksum")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(expected.torch_dtype).view(expected.shape)
