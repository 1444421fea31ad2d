"""The format of one entry's KV as stored in a remote tier: a self-describing, checksummed blob,
signed where the instances sharing the store share a secret.

Layout: `MAGIC` | header length (u32, little endian) | header (JSON) | payload checksum (u64,
xxh3-64) | signature (32 bytes) | payload (the raw bytes of the contiguous
`[layers, 2, tokens, kv_heads, head_size]` tensor). The signature is HMAC-SHA256 under the
secret (`SigningKey`) of everything else, header and payload; the header names the key
(`key_id`), and an unsigned object (no secret) has an empty key id and a zero signature. A reader
says what it expects (`KVHeader`); anything else is refused with a `KVObjectError`, never returned:
another model's, rank's or format version's object, a truncated or corrupt one, and, when the
reader has a secret, one it does not verify. A reader with a secret checks the signature before
it reads anything else of the header, and then that the header is the one it expects: the
header holds the entry key and the shard that the object's name is made of, so a genuine object
copied under another entry's name (a replay) is refused too.
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


class KVObjectError(ValueError):
    """A blob is not the expected object. `reason`: "magic", "truncated", "header", "version",
    "foreign", "size" or "checksum"; for a reader with a secret also "unsigned" (no signature),
    "key" (signed with another secret), "signature" (does not verify: forged, or altered since it
    was signed) and "replay" (a genuine object of another entry). `rejected`: the reader has a
    secret and the object is not one it signed for this entry (every reason but "size" and
    "checksum", which a verified object can still fail)."""

    def __init__(self, reason: str, detail: str = "", *, rejected: bool = False) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.rejected = rejected


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
    With `key` (`expected.key_id` names it) only an object it signed for `expected`, unaltered, is
    returned; the signature is checked before the header is read."""
    _check_key(expected, key)
    view = memoryview(blob).cast("B")
    meta, signature_start, payload = _split(view, rejected=key is not None)
    if key is not None:
        signature = bytes(view[signature_start : signature_start + _SIGNATURE_BYTES])
        if not hmac.compare_digest(key.sign(view[:signature_start], payload), signature):
            raise _unverified(meta, expected, key)
        if meta != _meta(expected):  # genuine, but another entry's (or another format's)
            raise KVObjectError("replay", _differing(_fields(meta, rejected=True), expected), rejected=True)
    else:
        fields = _fields(meta)
        if fields.get("version") != expected.version:
            raise KVObjectError("version", f"{fields.get('version')!r}, expected {expected.version}")
        if differing := _differing(fields, expected):
            raise KVObjectError("foreign", differing)
    if len(payload) != expected.payload_bytes:
        reason = "truncated" if len(payload) < expected.payload_bytes else "size"
        raise KVObjectError(reason, f"payload {len(payload)} bytes, expected {expected.payload_bytes}")
    (checksum,) = _CHECKSUM.unpack_from(view, signature_start - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise KVObjectError("checksum")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(expected.torch_dtype).view(expected.shape)


def _split(view: memoryview, rejected: bool) -> tuple[memoryview, int, memoryview]:
    """The header bytes, where the signature starts, and the payload of `view`."""
    if len(view) < len(MAGIC) + _LENGTH.size:
        raise KVObjectError("truncated", f"{len(view)} bytes", rejected=rejected)
    if view[: len(MAGIC)] != MAGIC:
        raise KVObjectError("magic", rejected=rejected)
    meta_start = len(MAGIC) + _LENGTH.size
    (meta_len,) = _LENGTH.unpack_from(view, len(MAGIC))
    signature_start = meta_start + meta_len + _CHECKSUM.size
    payload_start = signature_start + _SIGNATURE_BYTES
    if len(view) < payload_start:
        detail = f"{len(view)} bytes, header ends at {payload_start}"
        raise KVObjectError("truncated", detail, rejected=rejected)
    return view[meta_start : meta_start + meta_len], signature_start, view[payload_start:]


def _fields(meta: memoryview, rejected: bool = False) -> dict:
    try:
        fields = json.loads(bytes(meta))
    except ValueError as e:
        raise KVObjectError("header", str(e), rejected=rejected) from None
    if not isinstance(fields, dict):
        raise KVObjectError("header", "not an object", rejected=rejected)
    return fields


def _differing(fields: dict, expected: KVHeader) -> str:
    """The header fields in which `fields` differ from `expected`, comma-separated ("" if none)."""
    names = {f.name for f in dataclasses.fields(KVHeader)} | fields.keys()
    return ", ".join(sorted(n for n in names if fields.get(n) != getattr(expected, n, None)))


def _unverified(meta: memoryview, expected: KVHeader, key: SigningKey) -> KVObjectError:
    """Why an object's signature does not verify, as far as its (untrusted) header tells."""
    try:
        fields = _fields(meta, rejected=True)
    except KVObjectError as e:
        return e
    if fields.get("version") != expected.version:
        return KVObjectError(
            "version", f"{fields.get('version')!r}, expected {expected.version}", rejected=True
        )
    if fields.get("key_id") != key.id:
        reason = "key" if fields.get("key_id") else "unsigned"
        return KVObjectError(reason, f"key id {fields.get('key_id')!r}, expected {key.id!r}", rejected=True)
    return KVObjectError("signature", rejected=True)
