"""The KV ops' signatures and what the backends share (`cpu`, `npu`, `triton_kv_load`).

Every backend owns its layout (the CPU one is ISA-packed), so the pool never decodes it: rows
are written with the op the attention backend itself uses (a `KVWriter` per layer), loaded into
slots with keys re-rotated on the way (a `KVLoader`: gather, rotate, write, or one fused kernel)
and read back from the slots a forward wrote (a `KVReader`). `dispatch` picks the backend of the
current platform.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_ascend_chunk.ops.rotary import Rotation

KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`write(key [T, H, D], value [T, H, D], slots [T] int64)`."""
KVLoader = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Rotation | None], None]
"""`load(pool_key [R, H, D], pool_value [R, H, D], rows [T], slots [T], rotation)`."""
KVReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""`read(slots [T] int64) -> (key [T, H, D], value [T, H, D])`."""

STAGING_ROWS = 8192
"""Rows a gathering loader moves at a time: its staging memory is two pieces, not the whole load."""


class Staging:
    """Reusable K and V gather buffers of `STAGING_ROWS` rows, shared by every layer's loader.

    On the CPU a fresh multi-MB tensor per layer and step costs more in page faults than the
    gather itself (36 MB: 17 ms into a new tensor, 3 ms into a warm one), and a warm 32 x 1K
    request gathers 0.4 GB. Layers load one after another, so one pair serves them all.
    """

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `rows` rows (at most `STAGING_ROWS`) of K and V buffers shaped like `like`'s rows."""
        shape = (STAGING_ROWS, *like.shape[1:])
        buffers = self._buffers
        if buffers is None or buffers[0].shape != shape or buffers[0].dtype != like.dtype:
            buffers = self._buffers = tuple(
                torch.empty(shape, dtype=like.dtype, device=like.device) for _ in "kv"
            )
        return buffers[0][:rows], buffers[1][:rows]


def gathering_loader(
    write: KVWriter, rotate: Callable[[Rotation, torch.Tensor], object], staging: Staging
) -> KVLoader:
    """The loader that gathers pool rows into `staging` a piece at a time, moves the keys in
    place with `rotate(rotation, keys)` and writes the piece with `write`."""

    def load(
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        rotation: Rotation | None,
    ) -> None:
        for start in range(0, len(rows), STAGING_ROWS):
            piece = slice(start, start + STAGING_ROWS)
            key, value = staging.take(pool_k, len(rows[piece]))
            torch.index_select(pool_k, 0, rows[piece], out=key)
            if rotation is not None:
                rotate(rotation.piece(piece), key)
            torch.index_select(pool_v, 0, rows[piece], out=value)
            write(key, value, slots[piece])

    return load


def plain_reader(key_cache: torch.Tensor, value_cache: torch.Tensor) -> KVReader:
    """Reader of `[blocks, block_size, heads, head_size]` K and V caches (any strides)."""
    block_size = key_cache.shape[1]

    def read(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = slots // block_size, slots % block_size
        return key_cache[blocks, offsets], value_cache[blocks, offsets]

    return read
