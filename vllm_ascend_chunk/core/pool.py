"""ChunkCachePool: the pool tensor, and the moves — save into it, load out of it, and read or
write rows as host tensors (for the tiers below it, `tiers.worker_base`).

`[layers, 2, rows, kv_heads, head_size]` in the KV dtype, allocated once after the paged KV
cache. Rows are addressed by the scheduler (pages of `PAGE_SIZE` rows); the pool never decides.
"""

from __future__ import annotations

import torch

from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.ops.base import KVLoader, KVReader
from vllm_ascend_chunk.ops.rotary import Rotation


class ChunkCachePool:
    def __init__(
        self, geometry: PoolGeometry, loaders: list[KVLoader], readers: list[KVReader], device: torch.device
    ) -> None:
        if len(loaders) != geometry.num_layers:
            raise RuntimeError(
                f"Chunk Cache pool sized for {geometry.num_layers} attention layers, "
                f"the model has {len(loaders)}"
            )
        self.geometry = geometry
        self.loaders = loaders
        self.readers = readers
        shape = (geometry.num_layers, 2, geometry.num_rows, geometry.num_kv_heads, geometry.head_size)
        self.kv = torch.zeros(shape, dtype=geometry.dtype, device=device)

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy paged-cache `slots` (post-RoPE K/V, every layer) into pool `rows`."""
        for layer, read in zip(self.kv, self.readers, strict=True):
            key, value = read(slots)
            layer[0].index_copy_(0, rows, key)
            layer[1].index_copy_(0, rows, value)

    def load(self, rows: torch.Tensor, slots: torch.Tensor, rotation: Rotation | None = None) -> None:
        """Write pool `rows` into paged-cache `slots`, every layer, keys moved by `rotation`."""
        for layer, load in zip(self.kv, self.loaders, strict=True):
            load(layer[0], layer[1], rows, slots, rotation)

    def read_rows(self, rows: list[int]) -> torch.Tensor:
        """Pool `rows` as a host tensor `[layers, 2, len(rows), kv_heads, head_size]` (a copy)."""
        return self.kv.index_select(2, torch.tensor(rows, dtype=torch.int64, device=self.kv.device)).cpu()

    def write_rows(self, rows: list[int], values: torch.Tensor) -> None:
        """Pool `rows` := `values` (a host tensor shaped as `read_rows` returns)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(2, index, values.to(self.kv.device, non_blocking=values.is_pinned()))
