"""Independent reference of the Chunk Cache semantics: HF transformers (eager attention) with an
explicit 4D float mask and explicit position ids, greedy, no KV cache (every step recomputes).

The contract (`docs/design/design.md`, Semantics): SYS is causal; chunk C_i attends to SYS and
causally within itself; the question and generated tokens attend to everything before them.
Positions: `overlap` puts every chunk at `s..s+len(C_i)-1` and the question at `s + max len(C_i)`.
With no chunks this is ordinary causal decoding.

`sequential` (`greedy_sequential`) cannot be one masked forward: each chunk is computed as the
prompt `SYS + C_i` (so it sees SYS at the distances of that prompt), its keys are then moved to
the positions of the plain concatenation by HF's own rotary embedding (a rotation by the sum of
the lengths of the chunks before it), and the question and generated tokens are decoded on that
assembled cache at the positions of the plain concatenation. The move uses the model's own
family module's `apply_rotary_pos_emb` (its pair layout and rotary span: GLM-4's interleaved
pairs on half of each head, Phi-3's partial span), never the code under test.

Many tests check engines of several layouts and sizes against the same prompts: a model is loaded
once per directory, and a reference is computed once per (model, prompt, spans, layout, length).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each greedy token."""
    gaps: list[float] = field(default_factory=list)
    """Top-1 minus top-2 log-probability at each step (how far greedy is from a tie)."""

    def take(self, logits: torch.Tensor) -> int:
        """Record the greedy token of one step's logits and return it."""
        logprobs = torch.log_softmax(logits, dim=-1)
        top2 = logprobs.topk(2).values
        token = int(logprobs.argmax())
        self.tokens.append(token)
        self.logprobs.append(float(logprobs[token]))
        self.gaps.append(float(top2[0] - top2[1]))
        return token


def segment_ids(sys_len: int, chunk_lens: list[int], total: int) -> torch.Tensor:
    """0 for SYS, i for chunk i (1-based), -1 for the question and generated tokens."""
    seg = torch.full((total,), -1, dtype=torch.long)
    seg[:sys_len] = 0
    start = sys_len
    for i, n in enumerate(chunk_lens, start=1):
        seg[start : start + n] = i
        start += n
    return seg


def attention_mask(sys_len: int, chunk_lens: list[int], total: int) -> torch.Tensor:
    """[1, 1, total, total] additive float mask (0 = may attend, finfo.min = may not)."""
    seg = segment_ids(sys_len, chunk_lens, total)
    q, k = seg[:, None], seg[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    # A chunk token sees SYS and its own chunk; SYS and question tokens see everything causal.
    allowed = causal & ((q <= 0) | (k == 0) | (q == k))
    mask = torch.zeros(total, total, dtype=torch.float32)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]


def position_ids(sys_len: int, chunk_lens: list[int], total: int, layout: str = "overlap") -> torch.Tensor:
    if layout not in ("overlap", "sequential"):
        raise ValueError(f"unknown layout {layout!r}")
    pos = torch.arange(total)  # `sequential`: the positions of the plain concatenation
    if layout == "overlap" and chunk_lens:
        chunk_pos = [torch.arange(sys_len, sys_len + n) for n in chunk_lens]
        pos[sys_len : sys_len + sum(chunk_lens)] = torch.cat(chunk_pos)
        q_start = sys_len + sum(chunk_lens)
        pos[q_start:] = torch.arange(total - q_start) + sys_len + max(chunk_lens)
    return pos[None]


_references: dict[tuple, Reference] = {}


def greedy(
    model,
    prompt: list[int],
    max_tokens: int,
    sys_len: int | None = None,
    chunk_lens: list[int] | None = None,
    layout: str = "overlap",
) -> Reference:
    """The reference answer (a copy of the one computed first for the same model and arguments)."""
    key = (
        model.name_or_path,
        model.dtype,
        tuple(prompt),
        max_tokens,
        sys_len,
        tuple(chunk_lens or ()),
        layout,
    )
    if key not in _references:
        _references[key] = _greedy(model, prompt, max_tokens, sys_len, chunk_lens, layout)
    ref = _references[key]
    return Reference(list(ref.tokens), list(ref.logprobs), list(ref.gaps))


@torch.no_grad()
def _greedy(
    model,
    prompt: list[int],
    max_tokens: int,
    sys_len: int | None,
    chunk_lens: list[int] | None,
    layout: str,
) -> Reference:
    chunk_lens = chunk_lens or []
    if layout == "sequential" and chunk_lens:
        return greedy_sequential(model, prompt, max_tokens, sys_len, chunk_lens)
    sys_len = len(prompt) if sys_len is None else sys_len
    ids = list(prompt)
    out = Reference(tokens=[])
    for _ in range(max_tokens):
        n = len(ids)
        logits = (
            model(
                input_ids=torch.tensor([ids]),
                attention_mask=attention_mask(sys_len, chunk_lens, n),
                position_ids=position_ids(sys_len, chunk_lens, n, layout),
            )
            .logits[0, -1]
            .float()
        )
        token = out.take(logits)
        ids.append(token)
    return out


@torch.no_grad()
def greedy_sequential(
    model, prompt: list[int], max_tokens: int, sys_len: int, chunk_lens: list[int]
) -> Reference:
    from transformers import DynamicCache

    apply_rotary_pos_emb = family_rope(model)
    layers = model.config.num_hidden_layers
    keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    start = offset = sys_len
    for i, n in enumerate(chunk_lens):
        ids = prompt[:sys_len] + prompt[start : start + n]
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        delta = torch.full((1, n), offset - sys_len)  # computed at sys_len.., placed at offset..
        for layer in range(layers):
            k, v = cache.layers[layer].keys, cache.layers[layer].values  # [1, H, T, D], post-RoPE
            cos, sin = model.model.rotary_emb(v, delta)
            _, moved = apply_rotary_pos_emb(k[:, :, sys_len:], k[:, :, sys_len:], cos, sin)
            if i == 0:
                keys[layer].append(k[:, :, :sys_len])
                values[layer].append(v[:, :, :sys_len])
            keys[layer].append(moved)
            values[layer].append(v[:, :, sys_len:])
        start += n
        offset += n
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(torch.cat(keys[layer], dim=2), torch.cat(values[layer], dim=2), layer)
    out, ids = Reference(tokens=[]), list(prompt[offset:])
    for _ in range(max_tokens):
        positions = torch.arange(offset, offset + len(ids))[None]
        logits = (
            model(
                input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache, use_cache=True
            )
            .logits[0, -1]
            .float()
        )
        token = out.take(logits)
        offset += len(ids)
        ids = [token]
    return out


def family_rope(model):
    """`apply_rotary_pos_emb(q, k, cos, sin)` of the model's transformers family module."""
    import sys

    module = sys.modules[type(model).__module__]
    if not hasattr(module, "apply_rotary_pos_emb"):
        raise NotImplementedError(f"{type(model).__name__}: no apply_rotary_pos_emb in {module.__name__}")
    return module.apply_rotary_pos_emb


def load(model_dir) -> torch.nn.Module:
    """The model of `model_dir` (float32, eager attention), loaded once: callers never change it."""
    return _load(str(Path(model_dir).resolve()))


@functools.cache
def _load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
