"""The chunk cache's settings, read from the environment and validated once at start-up.

Each field's variable is a row of `config.variables.VARIABLES`, which parses and validates its text.

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

from vllm_ascend_chunk.config.recovery_modes import Recovery
from vllm_ascend_chunk.config.variables import (
    MIB,
    REMOTE_SETTINGS,
    SETTINGS,
    VARIABLES,
    ChunkCacheConfigError,
)
from vllm_ascend_chunk.core.geometry import PoolGeometry


def _default(field: str) -> Any:
    """The value of `field` when the variable that sets it is unset."""
    (variable,) = (v for v in VARIABLES if v.field == field)
    return variable.read({})


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
    buffer_bytes: int = 64 * MIB
    """The client's local transfer buffer: one get or put moves at most this much."""
    retry_s: float = 5.0
    """Reconnect interval while the store is unreachable."""
    queue_bytes: int = 512 * MIB
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
    """The chunk cache's settings (`SETTINGS`, and the remote tier's): the environment's
    (`get_config`), or one engine's, which are those with what was decided for the engine (its
    layout and its pool: `config.engine_settings`)."""

    enabled: bool = _default("enabled")
    size_gb: float | None = _default("size_gb")
    """GiB of device pool per worker; None: sized from the engine's KV memory (`geometry`)."""
    lru_threshold: float = _default("lru_threshold")
    hash_algorithm: str = _default("hash_algorithm")
    delimiter: str = _default("delimiter")
    layout: str = _default("layout")
    """`sequential` (the default, nearest full attention on every quality set: `docs/results/quality.md`)
    or `overlap`; unset, a model whose RoPE a rotation cannot move gets `overlap` for its engine
    (`config.engine`)."""
    layout_set: bool = False
    """Whether `VLLM_CHUNK_CACHE_LAYOUT` is set (then `config.engine` keeps `layout` for every model)."""
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
    pool: PoolGeometry | None = None
    """An engine's pool once it is sized (`config.engine`); None in the environment's settings."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ChunkCacheConfig:
        """The configuration `env` (default: `os.environ`) sets."""
        env = os.environ if env is None else env
        (layout,) = (v for v in SETTINGS if v.field == "layout")
        return cls(
            **{v.field: v.read(env) for v in SETTINGS},
            layout_set=layout.name in env,
            remote_config=RemoteConfig.from_env(env),
        )

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
    """The environment's settings, read once per process (raises `ChunkCacheConfigError` if
    invalid): what `config.engine.configure` builds an engine's settings from, and the plugin's
    start-up log. Everything else reads its engine's (`config.engine_settings.engine_settings`)."""
    return ChunkCacheConfig.from_env()
