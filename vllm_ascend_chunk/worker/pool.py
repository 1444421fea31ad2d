"""ChunkCachePool: the pool tensors, and the two moves — capture into it, load out of it.

`[layers, 2, rows, kv_heads, head_size]` in the KV dtype, allocated once after the paged KV
cache. Rows are addressed by the scheduler (pages of `PAGE_SIZE` rows); the pool never decides.
"""

from __future__ import annotations

import torch

from vllm_ascend_chunk.geometry import PoolGeometry
from vllm_ascend_chunk.ops.kv_write import KVLoader
from vllm_ascend_chunk.ops.rotary import Rotation


class ChunkCachePool:
    def __init__(self, geometry: PoolGeometry, layer_names: list[str], loaders: list[KVLoader],
                 device: torch.device) -> None:
        if len(layer_names) != geometry.num_layers:
            raise RuntimeError(f"Chunk Cache pool sized for {geometry.num_layers} attention layers, "
                               f"the model has {len(layer_names)}")
        self.geometry = geometry
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.loaders = loaders
        self.kv = torch.zeros((geometry.num_layers, 2, geometry.num_rows, geometry.num_kv_heads,
                               geometry.head_size), dtype=geometry.dtype, device=device)

    def store(self, layer_name: str, key: torch.Tensor, value: torch.Tensor,
              src: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy tokens `src` of this step's post-RoPE `key`/`value` into pool `rows`."""
        layer = self.kv[self.layer_index[layer_name]]
        layer[0].index_copy_(0, rows, key.index_select(0, src).to(layer.dtype))
        layer[1].index_copy_(0, rows, value.index_select(0, src).to(layer.dtype))

    def load(self, rows: torch.Tensor, slots: torch.Tensor, rotation: Rotation | None = None) -> None:
        """Write pool `rows` into paged-cache `slots`, every layer, keys moved by `rotation`."""
        for layer, load in zip(self.kv, self.loaders, strict=True):
            load(layer[0], layer[1], rows, slots, rotation)
