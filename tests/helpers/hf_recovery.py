"""HF-transformers forms of the chunk layouts and of candidate *recovery modes*.

A recovery mode recomputes some tokens of the document region with full attention, so that
answers move toward full attention's at a small, tunable cost. Every form here is one *plan*
over the prompt `SYS + C_1 + ... + C_n + Q`:

- SYS is always loaded as computed alone (causal: exactly full attention's SYS KV).
- Each token of the document region is either **loaded** or **computed**:
  - *loaded*: the K/V of its chunk computed as the prompt `SYS + C_i` (positions `s..`), keys
    re-rotated by `start_i - s` (0 in `overlap`; the lengths of the chunks before it in
    `sequential`);
  - *computed*: a forward of the token at its layout position, attending to every token before
    it in prompt order (loaded or computed; causal), as the question does.
- Q and generated tokens are computed (attend to everything before them).

Positions (`layout_starts`): chunk C_i starts at `s` (`overlap`) or `s + sum_{j<i} len(C_j)`
(`sequential`); Q starts at `s + max len(C_i)` (`overlap`) or `s + sum len(C_i)` (`sequential`).

Candidate modes (`recompute_set`):
- `plain`: nothing computed in the region (the layouts as the engine serves them today).
- `suffix:k`: the last `k` tokens of the region (across chunk boundaries if k > len(C_n)) are
  computed, at their layout positions. `suffix:last` = the whole last chunk. This is the one
  form that fits vLLM's scheduler as it is: a request loads a prefix of its chunk region and
  computes a contiguous suffix of its tokens.
- `epic:k`: the first `k` tokens of every chunk but the first are computed (EPIC / LegoLink);
  needs non-contiguous computation (not a suffix).
- `blend:r`: the fraction `r` of region tokens whose layer-1 keys deviate most from full
  attention's are computed (CacheBlend's selection with an oracle check layer: full attention's
  keys stand in for the check layer's fresh keys); not a suffix either.
- `full`: every token computed, i.e. an ordinary causal prompt (the ceiling).
- `defer-<mode>` (e.g. `defer-epic:16`, `defer-blend:0.15`): the same recompute set, *executed
  after every loaded token*: the KV order becomes SYS, the loaded tokens in prompt order, the
  computed tokens in prompt order, Q (positions unchanged). A computed token then attends to
  every loaded token, including those at later positions, and to the computed tokens before it.
  Any recompute set fits vLLM's scheduler this way (load, then compute a contiguous suffix).

The loop runs the plan in order: maximal runs of loaded tokens are appended to an HF
`DynamicCache`, maximal runs of computed tokens are one forward over that cache. Greedy decoding
continues on the cache. fp32, eager attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkKV:
    """Per layer (K, V) of SYS alone, and of each chunk computed as `SYS + C_i` (chunk part only)."""

    sys: list[tuple[torch.Tensor, torch.Tensor]]
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class Outcome:
    tokens: list[int]
    first_logprobs: torch.Tensor  # [vocab] log-softmax of the first answer token
    computed: int  # prompt tokens computed on a warm request (region tokens computed + Q)


def layout_starts(sys_len: int, chunk_lens: list[int], layout: str) -> tuple[list[int], int]:
    if layout == "overlap":
        return [sys_len] * len(chunk_lens), sys_len + max(chunk_lens, default=0)
    if layout == "sequential":
        starts, at = [], sys_len
        for n in chunk_lens:
            starts.append(at)
            at += n
        return starts, at
    raise ValueError(f"unknown layout {layout!r}")


def _cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _layers(cache, start: int = 0, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in cache.layers]


@torch.no_grad()
def chunk_kv(model, prompt: list[int], sys_len: int, chunk_lens: list[int]) -> ChunkKV:
    sys_cache = model(input_ids=torch.tensor([prompt[:sys_len]]), use_cache=True).past_key_values
    sys_layers = _layers(sys_cache)
    chunks, at = [], sys_len
    for n in chunk_lens:
        cache = _cache_from([(k.clone(), v.clone()) for k, v in sys_layers])
        model(
            input_ids=torch.tensor([prompt[at : at + n]]),
            position_ids=torch.arange(sys_len, sys_len + n)[None],
            past_key_values=cache,
            use_cache=True,
        )
        chunks.append(_layers(cache, sys_len))
        at += n
    return ChunkKV(sys=sys_layers, chunks=chunks)


def rotate(model, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Post-RoPE keys [1, H, T, D] moved by `delta` positions (HF's own rotary embedding)."""
    if delta == 0:
        return keys
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = model.model.rotary_emb(keys, torch.full((1, keys.shape[2]), delta))
    _, moved = apply_rotary_pos_emb(keys, keys, cos, sin)
    return moved


def recompute_set(
    mode: str, sys_len: int, chunk_lens: list[int], deviation: torch.Tensor | None = None
) -> set[int]:
    """Region offsets (0 = first token of C_1) computed rather than loaded, for `mode`."""
    mode = mode.removeprefix("defer-")
    region = sum(chunk_lens)
    name, _, arg = mode.partition(":")
    if name == "plain":
        return set()
    if name == "full":
        return set(range(region))
    if name == "suffix":
        k = chunk_lens[-1] if arg == "last" else int(arg)
        return set(range(max(0, region - k), region))
    if name == "epic":
        k, out, at = int(arg), set(), 0
        for i, n in enumerate(chunk_lens):
            if i > 0:
                out.update(range(at, at + min(k, n)))
            at += n
        return out
    if name == "blend":
        if deviation is None:
            raise ValueError("blend needs the per-token key deviation")
        count = round(float(arg) * region)
        return set(torch.topk(deviation, count).indices.tolist()) if count else set()
    raise ValueError(f"unknown mode {mode!r}")


@torch.no_grad()
def run(
    model,
    prompt: list[int],
    sys_len: int,
    chunk_lens: list[int],
    layout: str,
    compute: set[int],
    kv: ChunkKV,
    max_tokens: int = 16,
    eos: int | None = None,
    defer: bool = False,
) -> Outcome:
    """Execute the plan (loaded/computed region tokens, then Q), then decode greedily.

    `defer`: the computed tokens go after every loaded token (a contiguous suffix before Q)."""
    starts, q_start = layout_starts(sys_len, chunk_lens, layout)
    # Per region token: (prompt index, position, chunk, offset in chunk, computed?)
    tokens = []
    at = 0
    for i, n in enumerate(chunk_lens):
        for j in range(n):
            tokens.append((sys_len + at + j, starts[i] + j, i, j, (at + j) in compute))
        at += n
    if defer:
        tokens = [t for t in tokens if not t[4]] + [t for t in tokens if t[4]]
    cache = _cache_from([(k.clone(), v.clone()) for k, v in kv.sys])
    logits = None
    r = 0
    while r < len(tokens):
        end = r
        # A run: computed tokens of any chunks, or loaded tokens of one chunk.
        while (
            end < len(tokens)
            and tokens[end][4] == tokens[r][4]
            and (tokens[r][4] or tokens[end][2] == tokens[r][2])
        ):
            end += 1
        run_ = tokens[r:end]
        if run_[0][4]:  # computed
            ids = torch.tensor([[prompt[t[0]] for t in run_]])
            pos = torch.tensor([[t[1] for t in run_]])
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        else:  # loaded: one chunk's slice, re-rotated to the layout's start
            i, j0, j1 = run_[0][2], run_[0][3], run_[-1][3] + 1
            delta = starts[i] - sys_len
            for layer, (k, v) in enumerate(kv.chunks[i]):
                cache.update(rotate(model, k[:, :, j0:j1], delta), v[:, :, j0:j1], layer)
        r = end
    q_ids = prompt[sys_len + sum(chunk_lens) :]
    positions = torch.arange(q_start, q_start + len(q_ids))[None]
    logits = (
        model(input_ids=torch.tensor([q_ids]), position_ids=positions, past_key_values=cache, use_cache=True)
        .logits[0, -1]
        .float()
    )
    tokens, first = _decode(model, cache, logits, q_start + len(q_ids), max_tokens, eos)
    return Outcome(tokens=tokens, first_logprobs=first, computed=len(compute) + len(q_ids))


def _decode(
    model, cache, logits: torch.Tensor, pos: int, max_tokens: int, eos: int | None
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from the first answer token's logits on, and that token's log-softmax."""
    first = torch.log_softmax(logits, dim=-1)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(logits.argmax())
        if eos is not None and token == eos:
            break
        out.append(token)
        logits = (
            model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[pos]]),
                past_key_values=cache,
                use_cache=True,
            )
            .logits[0, -1]
            .float()
        )
        pos += 1
    return out, first


@torch.no_grad()
def run_full(
    model, prompt: list[int], max_tokens: int = 16, eos: int | None = None, check_layer: int = 1
) -> tuple[Outcome, torch.Tensor]:
    """Full attention (an ordinary causal prompt), and its keys at `check_layer` [T, H*D]."""
    outputs = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, logits = outputs.past_key_values, outputs.logits[0, -1].float()
    keys = cache.layers[check_layer].keys[0].transpose(0, 1).reshape(len(prompt), -1).clone()
    tokens, first = _decode(model, cache, logits, len(prompt), max_tokens, eos)
    return Outcome(tokens=tokens, first_logprobs=first, computed=len(prompt)), keys


def key_deviation(
    model,
    kv: ChunkKV,
    full_keys: torch.Tensor,
    sys_len: int,
    chunk_lens: list[int],
    layout: str,
    check_layer: int = 1,
) -> torch.Tensor:
    """Per region token: || loaded key - full attention's key ||^2 at `check_layer`."""
    starts, _ = layout_starts(sys_len, chunk_lens, layout)
    loaded = []
    for i, layers in enumerate(kv.chunks):
        k = rotate(model, layers[check_layer][0], starts[i] - sys_len)
        loaded.append(k[0].transpose(0, 1).reshape(k.shape[2], -1))
    loaded_keys = torch.cat(loaded)
    region = full_keys[sys_len : sys_len + sum(chunk_lens)]
    return ((loaded_keys - region) ** 2).sum(-1)


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """KL(P || Q) in nats over the whole vocabulary."""
    return float((p_logprobs.exp() * (p_logprobs - q_logprobs)).sum().clamp_min(0))
