"""The environment variables: one table, `VARIABLES` (name, kind, default, doc).

How a variable's text is parsed, the error for a value it does not accept, the defaults of the
config classes (`config.settings`) and the table of docs/user/configuration.md (rendered by
`docs_table`) all come from its row.
"""

from __future__ import annotations

import dataclasses
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
from vllm_ascend_chunk.config.recovery_modes import RECOVERY_ACCEPTED, recovery_of
from vllm_ascend_chunk.core import layouts

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
HASH_ALGORITHMS = {"sha256": "sha256_cbor", "xxhash": "xxhash_cbor"}
"""Our names → the vLLM hash function (`vllm.utils.hashing.get_hash_fn_by_name`)."""
LAYOUTS = tuple(layouts.LAYOUTS)
PROTOCOLS = ("tcp", "rdma")
"""Mooncake transports the remote tier is built for."""
MIN_TIMEOUT_S = 0.01
MIB = 1 << 20
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
        number(lambda v: 0.001 <= v <= 16, "a number of MiB in [0.001, 16]", unit=MIB),
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


def docs_table() -> str:
    """The configuration table as docs/user/configuration.md shows it (`tests/unit/test_config.py`
    checks it; its links are relative to that page)."""
    return "\n".join(
        ["| variable | default | accepted: meaning |", "|---|---|---|", *(v.docs_row() for v in VARIABLES)]
    )
