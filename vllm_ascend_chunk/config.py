"""Configuration from the environment, validated once at start-up.

| variable                          | default   | accepted                      |
|-----------------------------------|-----------|-------------------------------|
| `VLLM_ENABLE_CHUNK_CACHE`         | `true`    | true/false, 1/0, yes/no, on/off |
| `VLLM_CHUNK_CACHE_SIZE_GB`        | unset: auto | a number > 0 (GiB of pool per worker) |
| `VLLM_CHUNK_CACHE_LRU_THRESHOLD`  | `0.9`     | a number in (0, 1]            |
| `VLLM_CHUNK_CACHE_HASH_ALGORITHM` | `sha256`  | `sha256`, `xxhash`            |
| `VLLM_CHUNK_DELIMITER`            | `# #`     | any non-blank text            |
| `VLLM_CHUNK_CACHE_LAYOUT`         | `sequential` | `sequential`, `overlap`    |
| `VLLM_CHUNK_CACHE_RECOVERY`       | `none`    | `none`, `last`, `last:K`      |
| `VLLM_CHUNK_CACHE_HOST_GB`        | `0` (off) | a number >= 0                 |
| `VLLM_CHUNK_CACHE_REMOTE_MASTER`  | empty (off) | `host:port` of a `mooncake_master` |
| `VLLM_CHUNK_CACHE_REMOTE_METADATA` | `http://<master host>:8080/metadata` | Mooncake metadata server URL |
| `VLLM_CHUNK_CACHE_REMOTE_PROTOCOL` | `tcp`    | `tcp` or `rdma` (the Mooncake transport) |
| `VLLM_CHUNK_CACHE_REMOTE_DEVICE`  | empty     | the RDMA device names, for `rdma` |
| `VLLM_CHUNK_CACHE_REMOTE_SEGMENT_GB` | `0`    | a number >= 0: memory this instance lends the store |
| `VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S` | `5`     | a number >= 0.01: longest wait for one read |
| `VLLM_CHUNK_CACHE_REMOTE_PART_MB` | `16`      | a number in [0.001, 16]: larger objects go in parts |
| `VLLM_CHUNK_CACHE_REMOTE_LOCAL_HOST` | this host's IP | the address the store reaches this instance at |

Unset, the pool is sized when the engine knows its KV memory (`geometry.auto_pool_bytes`): a
quarter of it, at least 256 MiB and at most 8 GiB, never more than half of it.

The tiers (`docs/design.md`, Tiers): entries evicted from the device pool go to host memory
(`HOST_GB`), and every computed entry is shared through a Mooncake Store (`REMOTE_*`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping

from vllm_ascend_chunk import layouts

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
HASH_ALGORITHMS = {"sha256": "sha256_cbor", "xxhash": "xxhash_cbor"}
"""Our names → the vLLM hash function (`vllm.utils.hashing.get_hash_fn_by_name`)."""
LAYOUTS = tuple(layouts.LAYOUTS)
RECOVERY_ACCEPTED = "none, last (= last:1), or last:K with K >= 1"
"""Recovery modes (`frontend.recovery`): `last:K` computes the last K documents with the question."""


PROTOCOLS = ("tcp", "rdma")
"""Mooncake transports the remote tier is built for."""
METADATA_SCHEMES = ("http", "https", "etcd", "redis")
MIN_TIMEOUT_S = 0.01


class ChunkCacheConfigError(ValueError):
    """An environment variable holds a value the chunk cache does not accept."""


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """Where the shared tier's Mooncake Store is and how this instance talks to it."""

    master: str
    """`host:port` of the `mooncake_master`."""
    metadata_server: str
    protocol: str = "tcp"
    device_name: str = ""
    segment_gb: float = 0.0
    """Memory this instance lends the store (0: a separate store process holds the objects)."""
    timeout_s: float = 5.0
    part_mb: float = 16.0
    """Objects larger than this go in parts (one Mooncake transfer moves at most a quarter of
    the client's 64 MiB buffer: two reads and a write in flight)."""
    local_host: str = ""
    """The address the store's processes reach this instance at (empty: vLLM's `get_ip()`)."""

    @classmethod
    def from_env(cls, get) -> RemoteConfig | None:
        master = get("VLLM_CHUNK_CACHE_REMOTE_MASTER", "")
        if not master:
            return None
        host, _, port = master.rpartition(":")
        if not host or not port.isdecimal() or not 0 < int(port) < 65536:
            raise _error(
                "VLLM_CHUNK_CACHE_REMOTE_MASTER", master, "host:port of a mooncake_master (port 1-65535)"
            )
        return cls(
            master=master,
            metadata_server=_parse_metadata_url(
                get("VLLM_CHUNK_CACHE_REMOTE_METADATA", f"http://{host}:8080/metadata")
            ),
            protocol=_parse_choice(
                "VLLM_CHUNK_CACHE_REMOTE_PROTOCOL", get("VLLM_CHUNK_CACHE_REMOTE_PROTOCOL", "tcp"), PROTOCOLS
            ),
            device_name=get("VLLM_CHUNK_CACHE_REMOTE_DEVICE", ""),
            segment_gb=_parse_float(
                "VLLM_CHUNK_CACHE_REMOTE_SEGMENT_GB",
                get("VLLM_CHUNK_CACHE_REMOTE_SEGMENT_GB", 0),
                lambda v: v >= 0,
                "a number >= 0",
            ),
            timeout_s=_parse_float(
                "VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S",
                get("VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S", 5),
                lambda v: v >= MIN_TIMEOUT_S,
                f"a number of seconds >= {MIN_TIMEOUT_S:g} (no read completes sooner)",
            ),
            part_mb=_parse_float(
                "VLLM_CHUNK_CACHE_REMOTE_PART_MB",
                get("VLLM_CHUNK_CACHE_REMOTE_PART_MB", 16),
                lambda v: 0.001 <= v <= 16,
                "a number of MiB in [0.001, 16]",
            ),
            local_host=get("VLLM_CHUNK_CACHE_REMOTE_LOCAL_HOST", ""),
        )

    def describe(self) -> str:
        return f"mooncake://{self.master} ({self.protocol})"


@dataclasses.dataclass(frozen=True)
class ChunkCacheConfig:
    enabled: bool = True
    size_gb: float | None = None
    """GiB of device pool per worker; None: sized from the engine's KV memory (`geometry`)."""
    lru_threshold: float = 0.9
    hash_algorithm: str = "sha256"
    delimiter: str = "# #"
    layout: str = "sequential"
    """`sequential` (the default, nearest full attention on every quality set: `docs/quality.md`)
    or `overlap`; unset, a model whose RoPE a rotation cannot move gets `overlap`
    (`engine_config`)."""
    recovery_docs: int = 0
    """Documents at the end of a request computed with its question (`VLLM_CHUNK_CACHE_RECOVERY`)."""
    host_gb: float = 0.0
    """Host memory for entries evicted from the device pool (0: no host tier)."""
    remote: RemoteConfig | None = None
    """The shared Mooncake Store tier (None: off)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ChunkCacheConfig:
        env = os.environ if env is None else env
        defaults = cls()

        def get(name: str, default: object) -> str:
            return env.get(name, str(default)).strip()

        return cls(
            enabled=_parse_bool("VLLM_ENABLE_CHUNK_CACHE", get("VLLM_ENABLE_CHUNK_CACHE", "true")),
            size_gb=_parse_float(
                "VLLM_CHUNK_CACHE_SIZE_GB",
                get("VLLM_CHUNK_CACHE_SIZE_GB", ""),
                lambda v: v > 0,
                "a number greater than 0",
            )
            if get("VLLM_CHUNK_CACHE_SIZE_GB", "")
            else None,
            lru_threshold=_parse_float(
                "VLLM_CHUNK_CACHE_LRU_THRESHOLD",
                get("VLLM_CHUNK_CACHE_LRU_THRESHOLD", defaults.lru_threshold),
                lambda v: 0 < v <= 1,
                "a number in (0, 1]",
            ),
            hash_algorithm=_parse_choice(
                "VLLM_CHUNK_CACHE_HASH_ALGORITHM",
                get("VLLM_CHUNK_CACHE_HASH_ALGORITHM", defaults.hash_algorithm),
                tuple(HASH_ALGORITHMS),
            ),
            delimiter=_parse_delimiter(env.get("VLLM_CHUNK_DELIMITER", defaults.delimiter)),
            layout=_parse_choice(
                "VLLM_CHUNK_CACHE_LAYOUT", get("VLLM_CHUNK_CACHE_LAYOUT", defaults.layout), LAYOUTS
            ),
            recovery_docs=_parse_recovery(
                "VLLM_CHUNK_CACHE_RECOVERY", get("VLLM_CHUNK_CACHE_RECOVERY", "none")
            ),
            host_gb=_parse_float(
                "VLLM_CHUNK_CACHE_HOST_GB",
                get("VLLM_CHUNK_CACHE_HOST_GB", 0),
                lambda v: v >= 0,
                "a number >= 0",
            ),
            remote=RemoteConfig.from_env(get),
        )

    def pool_setting(self) -> str:
        """How the pool's size is chosen, in the words of the settings."""
        if self.size_gb is None:
            return "the auto-sized pool (VLLM_CHUNK_CACHE_SIZE_GB unset)"
        return f"VLLM_CHUNK_CACHE_SIZE_GB={self.size_gb:g}"

    def describe(self) -> str:
        if not self.enabled:
            return "Chunk Cache disabled (VLLM_ENABLE_CHUNK_CACHE=false): vLLM behaves as unpatched"
        pool = "auto" if self.size_gb is None else f"{self.size_gb:g} GiB"
        return (
            f"Chunk Cache enabled: delimiter={self.delimiter!r} layout={self.layout} "
            f"pool={pool} lru_threshold={self.lru_threshold:g} "
            f"hash={self.hash_algorithm} recovery={recovery_name(self.recovery_docs)} "
            f"host={self.host_gb:g} GiB remote={self.remote.describe() if self.remote else 'off'}"
        )


@functools.cache
def get_config() -> ChunkCacheConfig:
    """The process-wide configuration (read once; raises `ChunkCacheConfigError` if invalid)."""
    return ChunkCacheConfig.from_env()


def _error(name: str, value: str, accepted: str) -> ChunkCacheConfigError:
    return ChunkCacheConfigError(f"{name}={value!r} is invalid; accepted values: {accepted}")


def bool_word(value: str) -> bool | None:
    """True or False for a switch word of `TRUE_WORDS` / `FALSE_WORDS` (any case), else None."""
    word = value.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def _parse_bool(name: str, value: str) -> bool:
    if (parsed := bool_word(value)) is None:
        raise _error(name, value, "/".join(TRUE_WORDS) + " or " + "/".join(FALSE_WORDS))
    return parsed


def _parse_float(name: str, value: str, ok, accepted: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _error(name, value, accepted) from None
    if not math.isfinite(number) or not ok(number):
        raise _error(name, value, accepted)
    return number


def _parse_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value.lower() not in choices:
        raise _error(name, value, ", ".join(choices))
    return value.lower()


def recovery_documents(value: str) -> int | None:
    """Documents a recovery mode computes with the question (`none` 0, `last` 1, `last:K` K), or
    None if `value` names no mode."""
    word = value.strip().lower()
    if word in ("none", "last"):
        return int(word == "last")
    head, _, k = word.partition(":")
    return int(k) if head == "last" and k.isdecimal() and int(k) >= 1 else None


def recovery_name(docs: int) -> str:
    return "none" if docs == 0 else "last" if docs == 1 else f"last:{docs}"


def _parse_recovery(name: str, value: str) -> int:
    if (docs := recovery_documents(value)) is None:
        raise _error(name, value, RECOVERY_ACCEPTED)
    return docs


def _parse_metadata_url(value: str) -> str:
    from urllib.parse import urlsplit

    url = urlsplit(value)
    if url.scheme not in METADATA_SCHEMES or not url.hostname:
        raise _error(
            "VLLM_CHUNK_CACHE_REMOTE_METADATA",
            value,
            "a Mooncake metadata server URL: " + ", ".join(f"{s}://host:port/..." for s in METADATA_SCHEMES),
        )
    return value


def _parse_delimiter(value: str) -> str:
    if not value.strip():
        raise _error("VLLM_CHUNK_DELIMITER", value, "any text that is not blank")
    return value.strip()
