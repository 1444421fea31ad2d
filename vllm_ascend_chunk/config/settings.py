"""Configuration from the environment, validated once at start-up.

Every variable is a row of one table, `VARIABLES` (name, kind, default, doc): how its text is
parsed, the error for a value it does not accept, the defaults of the config classes and the
table of docs/user/configuration.md (rendered by `docs_table`) all come from that row.

Unset, the pool is sized when the engine knows its KV memory (`geometry.auto_pool_bytes`): a
quarter of it, at least 256 MiB and at most 8 GiB, never more than half of it.

The tiers (`docs/design/design.md`, Tiers): entries evicted from the device pool go to host memory
(`HOST_GB`), and every computed entry is shared through a Mooncake Store (`REMOTE_*`), its objects
signed with a shared secret (`REMOTE_SECRET` or `REMOTE_SECRET_FILE`) where one is set.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

from vllm_ascend_chunk.config.kinds import (
    METADATA_SCHEMES,
    MIN_SECRET_BYTES,
    Kind,
    at_least_one,
    choice,
    master_address,
    metadata_url,
    named,
    non_blank,
    number,
    secret_file,
    secret_text,
    unless_blank,
)
from vllm_ascend_chunk.config.recovery_modes import RECOVERY_ACCEPTED, Recovery, recovery_of
from vllm_ascend_chunk.core import layouts

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
HASH_ALGORITHMS = {"sha256": "sha256_cbor", "xxhash": "xxhash_cbor"}
"""Our names → the vLLM hash function (`vllm.utils.hashing.get_hash_fn_by_name`)."""
LAYOUTS = tuple(layouts.LAYOUTS)
PROTOCOLS = ("tcp", "rdma")
"""Mooncake transports the remote tier is built for."""
MIN_TIMEOUT_S = 0.01
_MIB = 1 << 20
_GIB = 1 << 30


class ChunkCacheConfigError(ValueError):
    """An environment variable holds a value the chunk cache does not accept."""


def bool_word(value: str) -> bool | None:
    """True or False for a switch word of `TRUE_WORDS` / `FALSE_WORDS` (any case), else None."""
    word = value.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: a row of the configuration table."""

    name: str
    field: str
    """The field of `ChunkCacheConfig` (of `RemoteConfig`, for `REMOTE_SETTINGS`) it sets;
    `secret_file` sets `secret`, from the file it names."""
    kind: Kind
    default: str
    """The text an unset variable reads as (`{host}`: the host of the remote master)."""
    doc: str
    """What it sets, after its accepted values in the docs table."""
    shown_default: str = ""
    """The docs table's default, where `default` in backquotes (empty: "empty") does not say it."""

    def read(self, env: Mapping[str, str], host: str = "") -> Any:
        """Its value in `env`; `ChunkCacheConfigError` if `env` holds text it does not accept."""
        text = env.get(self.name, self.default.format(host=host))
        text = text.strip() if self.kind.strip else text
        try:
            return self.kind.parse(text)
        except ValueError:
            shown = f"<secret of {len(text.encode())} bytes>" if self.kind.secret else repr(text)
            raise ChunkCacheConfigError(
                f"{self.name}={shown} is invalid; accepted values: {self.kind.accepted}"
            ) from None

    def docs_row(self) -> str:
        """Its row of the docs table."""
        default = self.default.format(host="<master host>")
        shown = self.shown_default or (f"`{default}`" if default else "empty")
        accepted = ": ".join(part for part in (self.kind.accepted, self.doc) if part)
        return f"| `{self.name}` | {shown} | {accepted} |"


SETTINGS = (
    Variable(
        "VLLM_ENABLE_CHUNK_CACHE",
        "enabled",
        Kind(lambda text: named(bool_word(text)), "/".join(TRUE_WORDS) + " or " + "/".join(FALSE_WORDS)),
        "true",
        "master switch; `false` = exactly unpatched behaviour",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_SIZE_GB",
        "size_gb",
        unless_blank(number(lambda v: v > 0, "a number greater than 0")),
        "",
        "device pool size (GiB per worker), taken out of the KV memory",
        shown_default="unset: 1/4 of the KV cache memory, at least 256 MiB but never more than half of "
        "it, at most 8 GiB (logged at start-up)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_LRU_THRESHOLD",
        "lru_threshold",
        number(lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "0.9",
        "pool usage at which unpinned LRU entries are evicted",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_HASH_ALGORITHM",
        "hash_algorithm",
        choice(tuple(HASH_ALGORITHMS)),
        "sha256",
        "the hash of the cache keys, vLLM's `sha256_cbor` or `xxhash_cbor`",
    ),
    Variable(
        "VLLM_CHUNK_DELIMITER",
        "delimiter",
        Kind(non_blank, "any text that is not blank", strip=False),
        "# #",
        "the delimiter",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_LAYOUT",
        "layout",
        choice(LAYOUTS),
        "sequential",
        "the positions of the documents ([how it works](../design/how-it-works.md)); unset, a model "
        "whose RoPE a rotation cannot move gets `overlap`",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_RECOVERY",
        "recovery",
        Kind(lambda text: named(recovery_of(text)), RECOVERY_ACCEPTED),
        "none",
        "the last (K) documents, or the document tokens the question attends to most (`qattn:R`; "
        "`cover:TAU`: as many as cover TAU of its attention, else every document), are computed "
        "with the question; per request: `chunk_cache_recovery` ([prompts](prompts.md))",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_HOST_GB",
        "host_gb",
        number(lambda v: v >= 0, "a number >= 0"),
        "0",
        "host memory for entries evicted from the device pool, read back instead of recomputed",
        shown_default="`0` (off)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_MAX_DOCS",
        "max_docs",
        Kind(at_least_one, "a whole number >= 1"),
        "4096",
        "the most documents one request may bring (more: HTTP 400) ([limits](limits.md))",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS",
        "max_request_tokens",
        Kind(at_least_one, "a whole number >= 1"),
        "32768",
        "the most tokens of device pool one request may hold: its SYS and distinct documents, each "
        "rounded up to 16-token pages (more: HTTP 400), so that one request cannot flush the pool",
    ),
)
"""The variables of `ChunkCacheConfig`, in the order they are read."""
REMOTE_SETTINGS = (
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_MASTER",
        "master",
        unless_blank(Kind(master_address, "host:port of a mooncake_master (port 1-65535)")),
        "",
        "documents are shared through its Mooncake Store ([tiers](../operator/tiers.md))",
        shown_default="empty (off)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_METADATA",
        "metadata_server",
        Kind(
            metadata_url,
            "a Mooncake metadata server URL: " + ", ".join(f"{s}://host:port/..." for s in METADATA_SCHEMES),
        ),
        "http://{host}:8080/metadata",
        "",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_PROTOCOL",
        "protocol",
        choice(PROTOCOLS),
        "tcp",
        "the Mooncake transport",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_DEVICE",
        "device_name",
        Kind(str),
        "",
        "the RDMA device names, for `rdma`",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_SEGMENT_GB",
        "segment_bytes",
        number(lambda v: v >= 0, "a number >= 0", unit=_GIB),
        "0",
        "memory this instance lends the store (0: a store process holds the objects)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S",
        "timeout_s",
        number(
            lambda v: v >= MIN_TIMEOUT_S,
            f"a number of seconds >= {MIN_TIMEOUT_S:g} (no read completes sooner)",
        ),
        "5",
        "longest wait for one remote read (then the document is computed)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_PART_MB",
        "part_bytes",
        number(lambda v: 0.001 <= v <= 16, "a number of MiB in [0.001, 16]", unit=_MIB),
        "16",
        "remote objects larger than this are stored in parts",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_LOCAL_HOST",
        "local_host",
        Kind(str),
        "",
        "the address the store's processes reach this instance at",
        shown_default="this host's IP (vLLM's `get_ip()`)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_SECRET",
        "secret",
        unless_blank(
            Kind(
                lambda text: secret_text(text.encode()),
                f"text of at least {MIN_SECRET_BYTES} bytes",
                secret=True,
            )
        ),
        "",
        "the secret shared by the instances of a store: every object is signed (HMAC-SHA256) and "
        "one that does not verify is never loaded "
        "([tiers](../operator/tiers.md#who-can-change-what-you-serve))",
        shown_default="empty (objects unsigned: the store is trusted)",
    ),
    Variable(
        "VLLM_CHUNK_CACHE_REMOTE_SECRET_FILE",
        "secret_file",
        unless_blank(Kind(secret_file, f"a readable file holding at least {MIN_SECRET_BYTES} bytes")),
        "",
        "the secret, read from this file (set this or `VLLM_CHUNK_CACHE_REMOTE_SECRET`, not both)",
    ),
)
"""The variables of `RemoteConfig`, read only when the first, the master, is set."""
VARIABLES = (*SETTINGS, *REMOTE_SETTINGS)
"""The configuration table."""


def _default(field: str) -> Any:
    """The value of `field` when the variable that sets it is unset."""
    (variable,) = (v for v in VARIABLES if v.field == field)
    return variable.read({})


def docs_table() -> str:
    """The configuration table as docs/user/configuration.md shows it (`tests/unit/test_config.py`
    checks it; its links are relative to that page)."""
    return "\n".join(
        ["| variable | default | accepted: meaning |", "|---|---|---|", *(v.docs_row() for v in VARIABLES)]
    )


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """Where the shared tier's Mooncake Store is and how this instance's client uses it: the
    `REMOTE_SETTINGS`, then the client's bounds, which no variable sets."""

    master: str
    """The master's RPC address, `host:port`."""
    metadata_server: str
    """E.g. "http://127.0.0.1:8080/metadata" (the master's embedded HTTP metadata server)."""
    protocol: str = _default("protocol")
    device_name: str = _default("device_name")
    segment_bytes: int = _default("segment_bytes")
    """Memory this client contributes to the store; 0: a separate store process holds the data
    (Mooncake's "standalone-store" mode)."""
    timeout_s: float = _default("timeout_s")
    """Bound on one get."""
    part_bytes: int = _default("part_bytes")
    """Objects larger than this are stored in parts of this size (a buffer holds one part of
    each concurrent transfer: two reads and a write)."""
    local_host: str = _default("local_host")
    """The address the store's processes reach this instance at (empty: vLLM's `get_ip()`)."""
    buffer_bytes: int = 64 * _MIB
    """The client's local transfer buffer: one get or put moves at most this much."""
    retry_s: float = 5.0
    """Reconnect interval while the store is unreachable."""
    queue_bytes: int = 512 * _MIB
    """Bound on the KV bytes waiting to be written; puts beyond it are dropped."""
    read_queue: int = 4096
    """Bound on the gets waiting for a reader; gets beyond it resolve to `None` at once."""
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    """The key objects are signed with (`tiers.mooncake.kv_object.SigningKey`); None: unsigned, the store
    is trusted. From `VLLM_CHUNK_CACHE_REMOTE_SECRET` or the file `..._SECRET_FILE` names."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RemoteConfig | None:
        """The remote tier `env` configures; None without a master (off)."""
        master_variable, *others = REMOTE_SETTINGS
        if (master := master_variable.read(env)) is None:
            return None
        host = master.rpartition(":")[0]
        values = {v.field: v.read(env, host) for v in others}
        from_file = values.pop("secret_file")
        if from_file is not None:
            if values["secret"] is not None:
                raise ChunkCacheConfigError(
                    "VLLM_CHUNK_CACHE_REMOTE_SECRET and VLLM_CHUNK_CACHE_REMOTE_SECRET_FILE are both "
                    "set; set one of them"
                )
            values["secret"] = from_file
        return cls(master, **values)

    def describe(self) -> str:
        """The store, for the start-up log."""
        signed = "signed objects" if self.secret is not None else "unsigned objects"
        return f"mooncake://{self.master} ({self.protocol}, {signed})"


@dataclasses.dataclass(frozen=True)
class ChunkCacheConfig:
    """The chunk cache's settings (`SETTINGS`, and the remote tier's)."""

    enabled: bool = _default("enabled")
    size_gb: float | None = _default("size_gb")
    """GiB of device pool per worker; None: sized from the engine's KV memory (`geometry`)."""
    lru_threshold: float = _default("lru_threshold")
    hash_algorithm: str = _default("hash_algorithm")
    delimiter: str = _default("delimiter")
    layout: str = _default("layout")
    """`sequential` (the default, nearest full attention on every quality set: `docs/results/quality.md`)
    or `overlap`; unset, a model whose RoPE a rotation cannot move gets `overlap`
    (`config.engine`)."""
    recovery: Recovery = _default("recovery")
    """What of the document region a request computes with its question (`VLLM_CHUNK_CACHE_RECOVERY`)."""
    host_gb: float = _default("host_gb")
    """Host memory for entries evicted from the device pool (0: no host tier)."""
    max_docs: int = _default("max_docs")
    """The most documents one request may bring (`frontend.keys.check_num_docs`)."""
    max_request_tokens: int = _default("max_request_tokens")
    """The most pool rows (page-rounded tokens of SYS and distinct documents) one request may hold."""
    remote_config: RemoteConfig | None = None
    """The shared Mooncake Store tier (None: off)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ChunkCacheConfig:
        """The configuration `env` (default: `os.environ`) sets."""
        env = os.environ if env is None else env
        return cls(**{v.field: v.read(env) for v in SETTINGS}, remote_config=RemoteConfig.from_env(env))

    def pool_setting(self) -> str:
        """How the pool's size is chosen, in the words of the settings."""
        if self.size_gb is None:
            return "the auto-sized pool (VLLM_CHUNK_CACHE_SIZE_GB unset)"
        return f"VLLM_CHUNK_CACHE_SIZE_GB={self.size_gb:g}"

    def describe(self) -> str:
        """The settings, for the start-up log."""
        if not self.enabled:
            return "Chunk Cache disabled (VLLM_ENABLE_CHUNK_CACHE=false): vLLM behaves as unpatched"
        pool = "auto" if self.size_gb is None else f"{self.size_gb:g} GiB"
        store = self.remote_config.describe() if self.remote_config else "off"
        return (
            f"Chunk Cache enabled: delimiter={self.delimiter!r} layout={self.layout} "
            f"pool={pool} lru_threshold={self.lru_threshold:g} "
            f"hash={self.hash_algorithm} recovery={self.recovery.name} "
            f"max_docs={self.max_docs} max_request_tokens={self.max_request_tokens} "
            f"host={self.host_gb:g} GiB remote={store}"
        )


@functools.cache
def get_config() -> ChunkCacheConfig:
    """The process-wide configuration (read once; raises `ChunkCacheConfigError` if invalid)."""
    return ChunkCacheConfig.from_env()
