"""Rotary correction: move a cached post-RoPE key to a new position by re-rotating it.

A key cached at position ``p`` holds ``mscale * R(p) k``, where ``R(p)`` rotates each pair of the
first ``rotary_dim`` dims by the angles ``p * inv_freq``. When those angles are linear in ``p``,
``R(p + d) = R(d) R(p)``, so the key at ``p + d`` is ``R(d)`` applied to the cached key: a pure
unit rotation (the cached key already carries ``mscale``). This module is the backend-neutral
torch reference of that correction; per-backend kernels must match it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

_VLLM_ROPE_MODULE = "vllm.model_executor.layers.rotary_embedding"
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class UnsupportedRopeError(ValueError):
    """The model's RoPE cannot be corrected by a rotation by the position delta."""


@dataclass(frozen=True, eq=False)
class RotarySpec:
    """What the correction needs to know about a model's RoPE.

    ``inv_freq`` [rotary_dim // 2] holds the per-pair angular frequencies (angle = position *
    inv_freq). ``mscale`` is the magnitude the model's cos/sin cache carries (YaRN); it is
    informational only: the correction is a unit rotation.
    """

    head_size: int
    rotary_dim: int
    is_neox_style: bool
    inv_freq: torch.Tensor
    mscale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.rotary_dim <= self.head_size or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in (0, {self.head_size}]")
        if self.inv_freq.shape != (self.rotary_dim // 2,) or not self.inv_freq.is_floating_point():
            raise ValueError(
                f"inv_freq must be a float tensor of shape ({self.rotary_dim // 2},), "
                f"got {self.inv_freq.dtype} {tuple(self.inv_freq.shape)}"
            )


def rotation_tables(
    deltas: torch.Tensor, spec: RotarySpec, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim // 2] (``dtype`` on ``device``) of the rotation by ``deltas`` [T].

    Angles are computed in float64 on ``deltas``' device (exact to float32 rounding for deltas
    far beyond 100k); pass host deltas for devices without float64.
    """
    if deltas.dim() != 1 or deltas.dtype not in _INT_DTYPES:
        raise ValueError(f"deltas must be a 1-D integer tensor, got {deltas.dtype} {tuple(deltas.shape)}")
    angles = deltas.to(torch.float64)[:, None] * spec.inv_freq.to(deltas.device, torch.float64)[None, :]
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rotation_(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RotarySpec
) -> torch.Tensor:
    """Rotate ``keys`` [T, H, head_size] in place by the tables of `rotation_tables`; returns ``keys``.

    Math in float32 (float64 for float64 keys), one rounding to the keys' dtype at the end. Dims
    past ``rotary_dim`` are untouched; a zero angle leaves a key bit-identical. This is the
    reference every backend kernel must match.
    """
    if keys.dim() != 3 or keys.shape[-1] != spec.head_size or not keys.is_floating_point():
        raise ValueError(f"keys must be float [T, H, {spec.head_size}], got {keys.dtype} {tuple(keys.shape)}")
    half, work = spec.rotary_dim // 2, torch.promote_types(keys.dtype, torch.float32)
    if cos.shape != (keys.shape[0], half) or sin.shape != cos.shape:
        raise ValueError(
            f"cos/sin must be [{keys.shape[0]}, {half}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    cos, sin = cos.to(work)[:, None, :], sin.to(work)[:, None, :]  # [T, 1, half]
    rot = keys[..., : spec.rotary_dim]
    if spec.is_neox_style:  # pairs (i, i + half)
        x1, x2 = rot[..., :half], rot[..., half:]
    else:  # GPT-J: pairs (2i, 2i + 1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    a, b = x1.to(work), x2.to(work)  # may alias x1, x2: compute both outputs before writing
    o1 = a * cos - b * sin
    o2 = b * cos + a * sin
    x1.copy_(o1)
    x2.copy_(o2)
    return keys


@dataclass(frozen=True, eq=False)
class Rotation:
    """The rotary correction of one load: every row moved by its own delta."""

    spec: RotarySpec
    cos: torch.Tensor
    """[T, rotary_dim // 2] float32, from `rotation_tables`."""
    sin: torch.Tensor

    @classmethod
    def for_deltas(cls, deltas: torch.Tensor, spec: RotarySpec, device: torch.device) -> Rotation:
        return cls(spec, *rotation_tables(deltas, spec, device))

    def apply_(self, keys: torch.Tensor) -> torch.Tensor:
        return apply_rotation_(keys, self.cos, self.sin, self.spec)

    def piece(self, rows: slice) -> Rotation:
        """The correction of `rows` of this load."""
        return Rotation(self.spec, self.cos[rows], self.sin[rows])


def rerotate_keys_(keys: torch.Tensor, deltas: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """Rotate ``keys`` [T, H, head_size] in place by ``deltas`` [T] positions; returns ``keys``."""
    if deltas.shape != keys.shape[:1]:
        raise ValueError(f"deltas must be [{keys.shape[0]}], got {tuple(deltas.shape)}")
    cos, sin = rotation_tables(deltas, spec, keys.device, torch.promote_types(keys.dtype, torch.float32))
    return apply_rotation_(keys, cos, sin, spec)


def rerotate_keys(keys: torch.Tensor, deltas: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """The keys [T, H, head_size] moved by ``deltas`` [T] positions, as a new tensor of keys' dtype."""
    return rerotate_keys_(keys.clone(), deltas, spec)


# ---------------------------------------------------------------------------------------------
# RotarySpec from a vLLM rotary embedding module.

_InvFreq = tuple[torch.Tensor, float]  # (inv_freq, mscale)


def _own_inv_freq(m) -> _InvFreq:
    # RotaryEmbedding, Llama3 (rescaled bands), NTK (fixed/mixed), Gemma4 (zero-padded pairs).
    return m._compute_inv_freq(m.base), 1.0


def _linear(m) -> _InvFreq:
    if len(m.scaling_factors) != 1:  # several LoRA factors: which one a token used is per request
        raise UnsupportedRopeError(_refusal(m, f"it holds several scaling factors {m.scaling_factors}"))
    return m._compute_inv_freq(m.base).double() / float(m.scaling_factors[0]), 1.0


def _yarn(m) -> _InvFreq:
    # YaRN, TeleChat3 YaRN, Deepseek YaRN: blended inv_freq; cos/sin cache scaled by mscale.
    return m._compute_inv_freq(m.scaling_factor), float(m.mscale)


def _dynamic_ntk(m) -> _InvFreq:
    # vLLM's "dynamic" NTK is static: one base fixed at construction, as its cache computes it.
    scale = m.scaling_factor * m.max_position_embeddings / m.max_trained_positions - (m.scaling_factor - 1)
    return m._compute_inv_freq(m.base * scale ** (m.rotary_dim / (m.rotary_dim - 2))), 1.0


def _dynamic_ntk_alpha(m) -> _InvFreq:
    return m._compute_inv_freq(m.base * m.scaling_alpha ** (m.rotary_dim / (m.rotary_dim - 2))), 1.0


_SUPPORTED: dict[str, Callable[[object], _InvFreq]] = {
    "RotaryEmbedding": _own_inv_freq,
    "Llama3RotaryEmbedding": _own_inv_freq,
    "NTKScalingRotaryEmbedding": _own_inv_freq,
    "Gemma4RotaryEmbedding": _own_inv_freq,
    "LinearScalingRotaryEmbedding": _linear,
    "YaRNScalingRotaryEmbedding": _yarn,
    "TeleChat3RoPEScaledRotaryEmbedding": _yarn,
    "DeepseekScalingRotaryEmbedding": _yarn,
    "DynamicNTKScalingRotaryEmbedding": _dynamic_ntk,
    "DynamicNTKAlphaRotaryEmbedding": _dynamic_ntk_alpha,
}

LINEAR_ROPE_TYPES = frozenset(
    {
        "default",
        "llama3",
        "linear",
        "ntk",
        "dynamic",
        "yarn",
        "deepseek_yarn",
        "deepseek_llama_scaling",
        "proportional",
        "telechat3-yarn",
    }
)
"""`rope_type` values of a model's config for which vLLM's `get_rope` builds a class of `_SUPPORTED`
(the engine's start-up check of the default layout; the worker checks the module itself)."""

_WHY_NOT: dict[str, str] = {
    "MRotaryEmbedding": "M-RoPE rotates sections of each head by different position components",
    "MRotaryEmbeddingInterleaved": "M-RoPE rotates sections of each head by different position components",
    "Ernie4_5_VLRotaryEmbedding": "3-D RoPE rotates sections of each head by different position components",
    "XDRotaryEmbedding": "XD-RoPE rotates sections of each head by different position components",
    "DualChunkRotaryEmbedding": "dual-chunk attention maps positions per chunk (modulo the chunk length)",
    "Phi3LongRoPEScaledRotaryEmbedding": "LongRoPE (short and long frequency sets) is not supported",
    "FourierRotaryEmbedding": "FoPE mixes frequencies with learned coefficients, not a pure rotation",
    "Llama4VisionRotaryEmbedding": "it is a 2-D vision RoPE",
    "DeepseekV4ScalingRotaryEmbedding": "it rotates the last rotary_dim dims of a head, this op the first",
}


def _refusal(rotary_emb: object, reason: str) -> str:
    return (
        f"{type(rotary_emb).__name__}: {reason}. The sequential chunk-cache layout "
        "(VLLM_CHUNK_CACHE_LAYOUT=sequential) needs a RoPE whose angles are linear in the position, "
        "so that a cached key moves by a rotation; VLLM_CHUNK_CACHE_LAYOUT=overlap works with any RoPE."
    )


def _vllm_class_name(rotary_emb: object) -> str | None:
    """The in-tree vLLM class the module is, or that it replaces as a platform's out-of-tree op
    (vllm-ascend's AscendRotaryEmbedding replaces RotaryEmbedding). None for anything else."""
    cls = type(rotary_emb)
    if cls.__module__.startswith(_VLLM_ROPE_MODULE):
        return cls.__name__
    from vllm.model_executor.custom_op import op_registry_oot

    for base in cls.__mro__[1:]:
        if base.__module__.startswith(_VLLM_ROPE_MODULE):
            return base.__name__ if op_registry_oot.get(base.__name__) is cls else None
    return None


def _check_against_cache(rotary_emb: object, spec: RotarySpec) -> None:
    """The module's own cos/sin cache must match the derived angles (guards vLLM code drift)."""
    cache = getattr(rotary_emb, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != spec.rotary_dim:
        raise UnsupportedRopeError(_refusal(rotary_emb, "it has no [positions, rotary_dim] cos/sin cache"))
    # Power-of-two positions: vLLM's float32 angle t * inv_freq is exact there.
    positions = [0] + [1 << k for k in range(13) if 1 << k < cache.shape[0]]
    rows = cache[positions].detach().to("cpu", torch.float64)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * spec.inv_freq.double()[None, :]
    expected = torch.cat((angles.cos(), angles.sin()), dim=-1) * spec.mscale
    tol = max(8 * torch.finfo(cache.dtype).eps, 1e-3) * max(1.0, spec.mscale)
    err = (rows - expected).abs().max().item()
    if not err <= tol:
        raise UnsupportedRopeError(
            _refusal(
                rotary_emb, f"its cos/sin cache differs from the derived angles by {err:.3g} (> {tol:.3g})"
            )
        )


def rotary_spec_from_vllm(rotary_emb: object) -> RotarySpec:
    """The RotarySpec of a vLLM rotary embedding module (``get_rope(...)``'s result).

    Raises UnsupportedRopeError for a RoPE whose angles are not linear in the position (M-RoPE,
    dual-chunk, LongRoPE, ...) and for any class not known to be linear.
    """
    name = _vllm_class_name(rotary_emb)
    derive = _SUPPORTED.get(name) if name is not None else None
    if derive is None:
        raise UnsupportedRopeError(
            _refusal(
                rotary_emb,
                _WHY_NOT.get(
                    name or "",
                    "not a RoPE class known to be linear in the position "
                    f"(supported: {', '.join(sorted(_SUPPORTED))})",
                ),
            )
        )
    inv_freq, mscale = derive(rotary_emb)
    spec = RotarySpec(
        head_size=rotary_emb.head_size,
        rotary_dim=rotary_emb.rotary_dim,
        is_neox_style=bool(rotary_emb.is_neox_style),
        inv_freq=inv_freq.detach().to("cpu", torch.float64),
        mscale=mscale,
    )
    if not (math.isfinite(mscale) and mscale > 0 and torch.isfinite(spec.inv_freq).all()):
        raise UnsupportedRopeError(_refusal(rotary_emb, f"non-finite inv_freq or mscale={mscale}"))
    _check_against_cache(rotary_emb, spec)
    return spec
