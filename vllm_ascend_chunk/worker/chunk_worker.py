"""ChunkCacheWorker: executes a step's chunk operations on one worker.

Per step: `shift_positions` (from the model runner, once the slot mapping is computed from the
logical positions) lowers the RoPE positions of chunk-path requests in the overlap layout;
`load` (connector `start_load_kv`, before the forward) starts the tiers' jobs (`tiers.worker_base`;
the tiers are built from the engine's settings by `tiers.registry.build_worker_tiers`) and copies
pool rows into slots; `save` (connector `wait_for_save`, after the forward) copies the slots that
chunk prefills wrote into pool rows and hands the tiers what to keep; `report` (connector
`build_connector_worker_meta`, the step's end, with or without a forward) collects the tiers'
reports (a tier's fill may take several steps) under this worker's rank, and the `qattn` scores.
Nothing but the scorer (`worker/scoring.py`, one layer, only in steps with question pieces to
score) runs inside the attention op, so a forward replayed from a graph is handled the same.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_ascend_chunk.config.engine_settings import engine_settings
from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.layouts import LAYOUTS
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata
from vllm_ascend_chunk.ops.base import Staging
from vllm_ascend_chunk.ops.dispatch import make_kv_loader, make_kv_reader
from vllm_ascend_chunk.ops.rotary import RotarySpec, Rotation, UnsupportedRopeError, rotary_spec_from_vllm
from vllm_ascend_chunk.tiers.registry import build_worker_tiers
from vllm_ascend_chunk.worker.scoring import QuestionScorer, score_layer_index

if TYPE_CHECKING:
    from vllm_ascend_chunk.tiers.worker_base import WorkerTier

logger = logging.getLogger("vllm.chunk_cache")


def _same_rope(a: RotarySpec, b: RotarySpec) -> bool:
    return (a.rotary_dim, a.head_size, a.is_neox_style) == (
        b.rotary_dim,
        b.head_size,
        b.is_neox_style,
    ) and torch.equal(a.inv_freq, b.inv_freq)


class ChunkCacheWorker:
    def __init__(self, vllm_config, geometry: PoolGeometry) -> None:
        self.vllm_config = vllm_config
        self.settings = engine_settings(vllm_config)
        self.geometry = geometry
        self.pool: ChunkCachePool | None = None
        self.rotary: RotarySpec | None = None
        """The model's RoPE, in the sequential layout (None: overlap, or a model without RoPE)."""
        self._model_bound = False
        self.tiers: list[WorkerTier] = []
        """The tiers below the pool, in the order their jobs run (`tiers.registry.BACKENDS`)."""
        self.rank = 0
        """This worker's rank in its engine (pipeline stage major, as vLLM orders them)."""
        self._kv_caches: dict[str, torch.Tensor] = {}
        self.scorer: QuestionScorer | None = None
        """Scores `qattn` question pieces, if this worker holds the scoring layer."""
        self._unscored: list[str] = []
        """Pieces of this step no worker here can score (no scoring layer on a single stage)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        layers = self.vllm_config.compilation_config.static_forward_context
        staging = Staging()
        loaders = [
            make_kv_loader(kv, layers.get(n), self.vllm_config, staging) for n, kv in kv_caches.items()
        ]
        readers = [make_kv_reader(kv, self.vllm_config) for kv in kv_caches.values()]
        first = next(iter(kv_caches.values()))
        device = (first[0] if isinstance(first, (tuple, list)) else first).device  # NPU: (K, V) pairs
        self.pool = ChunkCachePool(self.geometry, loaders, readers, device)
        self.rank = _worker_rank()
        self.tiers = build_worker_tiers(self.settings, self.vllm_config, self.geometry, device)

    def bind_model(self, model) -> None:
        """Sequential layout: find the model's RoPE; refuse one a rotation cannot move (start-up)."""
        self._model_bound = True
        if not LAYOUTS[self.settings.layout].rotates_loaded_keys:
            return
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

        ropes = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbeddingBase)}
        if not ropes:  # e.g. vLLM's Transformers backend: RoPE inside modules this cannot rotate with
            raise UnsupportedRopeError(
                f"the model ({type(model).__name__}) has no vLLM RoPE module, so keys loaded from the "
                "pool cannot be re-rotated; VLLM_CHUNK_CACHE_LAYOUT=sequential needs one, "
                "VLLM_CHUNK_CACHE_LAYOUT=overlap works with any model"
            )
        specs = [rotary_spec_from_vllm(m) for m in ropes.values()]
        if any(not _same_rope(specs[0], s) for s in specs[1:]):
            raise UnsupportedRopeError(
                "the model's layers use different RoPEs; VLLM_CHUNK_CACHE_LAYOUT=sequential supports one "
                "RoPE per model, VLLM_CHUNK_CACHE_LAYOUT=overlap works with any"
            )
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        heads = {getattr(layer, "head_size", None) for layer in layers} - {None}
        if heads and heads != {specs[0].head_size}:  # e.g. DeepSeek's k_pe, after k_nope in each head
            raise UnsupportedRopeError(
                f"the model's RoPE spans {specs[0].head_size} dims, its attention heads {sorted(heads)}: "
                "keys loaded from the pool cannot be re-rotated; VLLM_CHUNK_CACHE_LAYOUT=overlap works "
                "with any model"
            )
        self.rotary = specs[0]
        logger.info(
            "Chunk Cache: sequential layout, cached keys re-rotated on load (rotary_dim=%d, neox=%s)",
            self.rotary.rotary_dim,
            self.rotary.is_neox_style,
        )

    def bind_scorer(self) -> None:
        """Wrap the scoring layer's attention (`qattn`), if this worker holds it (start-up)."""
        from vllm.model_executor.models.utils import extract_layer_index

        target = score_layer_index(self.vllm_config)
        layers = self.vllm_config.compilation_config.static_forward_context
        for name, kv in self._kv_caches.items():
            if extract_layer_index(name) == target and name in layers:
                self.scorer = QuestionScorer(layers[name], make_kv_reader(kv, self.vllm_config))
                return

    def plan_scores(self, specs: dict, req_ids: list[str], query_starts: np.ndarray) -> None:
        """This step's `qattn` question pieces (`ScoreSpec` by request id) and their batch rows."""
        if self.scorer is not None:
            self.scorer.plan(specs, req_ids, query_starts)
        elif self.vllm_config.parallel_config.pipeline_parallel_size == 1:
            self._unscored = list(specs)  # the layer is nowhere: served without recompute

    @staticmethod
    def shift_positions(
        shifts: dict[str, int], req_ids: list[str], query_starts: np.ndarray, positions: torch.Tensor
    ) -> None:
        """Lower, in place, the RoPE positions of the tokens each request computes this step by
        its shift (`query_starts[i]..query_starts[i+1]` are request `req_ids[i]`'s tokens)."""
        per_request = np.array([shifts.get(r, 0) for r in req_ids], dtype=np.int64)
        if per_request.any():
            per_token = torch.from_numpy(np.repeat(per_request, np.diff(query_starts)))
            positions -= per_token.to(positions.device)

    def load(self, meta: ChunkCacheStepMetadata) -> None:
        for tier in self.tiers:
            tier.start(meta, self.pool)
        if not meta.load_rows:
            return
        device = self.pool.kv.device
        rotation = None
        if meta.load_deltas and not self._model_bound:  # a model runner without the bind_model hook
            raise RuntimeError(
                "Chunk Cache: the sequential layout needs the model's RoPE, but the model "
                "runner never called vllm_adapter.runner_hooks.bind_model; run scripts/apply_patches.sh"
            )
        if meta.load_deltas and self.rotary is not None:
            deltas = torch.tensor(meta.load_deltas, dtype=torch.int64)  # host: float64 angles
            if deltas.any():
                rotation = Rotation.for_deltas(deltas, self.rotary, device)
        self.pool.load(
            torch.tensor(meta.load_rows, dtype=torch.int64, device=device),
            torch.tensor(meta.load_slots, dtype=torch.int64, device=device),
            rotation,
        )

    def save(self, meta: ChunkCacheStepMetadata) -> None:
        if meta.save_rows:
            device = self.pool.kv.device
            self.pool.save(
                torch.tensor(meta.save_rows, dtype=torch.int64, device=device),
                torch.tensor(meta.save_slots, dtype=torch.int64, device=device),
            )
        for tier in self.tiers:
            tier.save(meta, self.pool)

    def report(self, meta: ChunkCacheStepMetadata) -> ChunkCacheWorkerMetadata | None:
        """The step's end: the tiers' jobs that ended, and what the scheduler must know."""
        scores = self.scorer.take() if self.scorer is not None else dict.fromkeys(self._unscored)
        self._unscored = []
        tiers = {
            tier.name: {self.rank: report}
            for tier in self.tiers
            if (report := tier.finish(meta, self.pool)) is not None
        }
        if not tiers and not scores:
            return None
        return ChunkCacheWorkerMetadata(tiers=tiers, scores=scores)

    def shutdown(self) -> None:
        for tier in self.tiers:
            tier.close()


def worker_rank(tp_rank: int, tp_size: int, pp_rank: int) -> int:
    """A worker's rank in its engine, as vLLM numbers them: pipeline stage major."""
    return pp_rank * tp_size + tp_rank


def _worker_rank() -> int:
    """This process's worker rank (0 outside vLLM's process groups, e.g. a unit test)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return 0
    tp = get_tp_group()
    return worker_rank(tp.rank_in_group, tp.world_size, get_pp_group().rank_in_group)
