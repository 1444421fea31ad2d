"""A rogue writer of a shared store: it reaches the Mooncake master and knows everything about
the objects (names, format, headers, key ids; it lists and reads every object) but the secret."""

from __future__ import annotations

import json
import struct
import urllib.request

import torch
import xxhash

from harness.mooncake_store import MooncakeProcs
from vllm_ascend_chunk.tiers.mooncake.kv_object import FORMAT_VERSION, MAGIC, KVHeader

_SIGNATURE_BYTES = 32


def names(procs: MooncakeProcs) -> list[str]:
    """The name of every chunk-cache object the master holds (from its HTTP `get_all_keys`,
    which anyone who reaches it may ask)."""
    prefix = f"chunk-cache/v{FORMAT_VERSION}/"
    url = f"http://127.0.0.1:{procs.metrics_port}/get_all_keys"
    with urllib.request.urlopen(url, timeout=10) as response:
        return [n for n in response.read().decode().split() if n.startswith(prefix)]


def parse(blob: bytes) -> tuple[dict, bytes, torch.Tensor]:
    """An object's header fields, its signature and its KV."""
    (meta_len,) = struct.unpack_from("<I", blob, len(MAGIC))
    meta_start = len(MAGIC) + 4
    fields = json.loads(blob[meta_start : meta_start + meta_len])
    signature_start = meta_start + meta_len + 8
    payload = bytearray(blob[signature_start + _SIGNATURE_BYTES :])
    kv = torch.frombuffer(payload, dtype=torch.uint8).view(KVHeader(**fields).torch_dtype)
    return (
        fields,
        blob[signature_start : signature_start + _SIGNATURE_BYTES],
        kv.view(KVHeader(**fields).shape),
    )


def build(fields: dict, signature: bytes, kv: torch.Tensor) -> bytes:
    """An object of header `fields`, with a checksum that matches `kv` and `signature` (the rogue
    cannot compute a valid one: it reuses one it read, or any 32 bytes)."""
    meta = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    payload = kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    checksum = struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))
    return MAGIC + struct.pack("<I", len(meta)) + meta + checksum + signature + payload


def read(client, name: str) -> tuple[dict, bytes, torch.Tensor]:
    blob = client.get(name)
    assert blob, f"no object {name!r}"
    return parse(bytes(blob))


def replace(client, name: str, blob: bytes) -> None:
    """Put `blob` as `name`, whatever was there."""
    client.remove(name, True)
    assert client.put(name, blob) == 0, name
