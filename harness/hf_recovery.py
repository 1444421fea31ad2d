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

Budgeted forms (issue 25; `r` = the fraction of region tokens computed, `round(r * region)`):
- `blend:r` above (its count is `round(r * region)`; C_1's deviation is 0 in both layouts).
- `qattn:r` (question-driven): the question is run once over the plainly loaded cache (a forward
  of Q alone, as `plain` serves it) and its attention weights at one layer (default: the middle
  one, `num_hidden_layers // 2`; `qattn:r@L` picks layer L), summed over heads and question
  tokens, score every region token; the top `round(r * region)` of C_2..C_n are computed (C_1's
  cached KV is already full attention's). Deterministic; an engine needs only that extra forward
  of the question (`question_attention`).
- `qattn:r/m` (the engine's `qattn:r`, with m = 16): the same budget in at most `m` runs, so that
  an engine computes it in at most `m` forwards. The scores come from every question token but
  the last (the engine's scoring pass must not sample); the region after C_1 is cut into windows
  of `w = ceil(count / m)` tokens from C_2's first token on, and the `ceil(count / w)` windows of
  highest summed score are computed (ties: the earlier window).
- Candidate refinements of `qattn:r/m` (issue 35, item 1), options after a comma (they need `/m`):
  - `qattn:r/m@L1+L2+...` (also without `/m`): the scores summed over the layers named (each
    layer's weights summed over heads and question tokens, as above);
  - `,sink:k`: the first `k` tokens of every chunk but the first always computed (EPIC's
    attention-sink repair; `k` capped so that the heads fit the count), counted in the count;
    the rest of the count goes to windows as in `qattn:r/m` over the scores with those heads at 0;
  - `,floor`: every chunk but the first gets its best window before the rest are ranked, so that
    no chunk is starved (at most as many windows as the count allows);
  - `,grow`: windows sized by score mass instead of fixed width: tokens are added one at a time,
    each the highest-scoring token next to a chosen run or, while fewer than `m` runs exist, any
    token (ties: the earlier), until the count is reached (at most `m` runs, merged when they touch).
  - `,two-stage` (alone): the windows of `qattn:r/m`'s grid chosen in two stages, after
    ProphetKV's idea of selecting again once part of the budget is recomputed (its exact rule is
    not reproduced here): the better half of the windows (rounded up) by the scores over the
    plainly loaded cache, computed; the question scored again, at the same layer(s), over that
    partly recomputed cache (`question_attention(..., compute=...)`); the rest of the windows by
    those second scores among the windows not yet chosen. Same windows, same count as
    `qattn:r/m`; an engine would need a second scoring pass after the first recompute.
- `cover:t[/rmax[/rmin]]` (issue 35, item 2; the engine's `cover:TAU`): the windows of
  `qattn:rmax/16` (rmax default 0.2, rmin 0), ranked as there; the fewest best of them, at least
  `ceil(round(rmin * region) / w)`, such that C_1's score (C_1 is exact already) and theirs reach
  `t` of the whole region's (`cover_choice`); where all of them do not, every token after C_1 is
  computed (the guard). A region with no score is covered.
- `epicr:r`: EPIC with k chosen to hit the budget: the first `k = round(r * region / (n - 1))`
  tokens of every chunk but the first (capped at the chunk's length; `r >= 1`: every chunk whole).
- `qdoc:k`: the `k` chunks after C_1 with the largest summed question attention (as `qattn`'s
  scores; ties: the earlier chunk), each computed whole: a budget in whole documents.
- `chunks:i+j+...`: the chunks named (0 = C_1) computed whole: `explore_recovery`'s oracles
  `gold` (the chunk that holds the answer) and `gold-rest` (every other chunk).
- `suffix:last:m`: the whole last `m` chunks (`suffix:last:1` = `suffix:last`).
- `ape:T,S`: nothing computed (as `plain`); the question's and generated tokens' attention over
  the region follows APE (Yang et al., ICLR 2025): region logits divided by the temperature `T`
  and the region's total weight multiplied by `S` against SYS and the question (SYS is APE's
  shared prefix). Per query row, with `l` the region logits: region weights
  `softmax(l / T)` inside, `exp(T * logsumexp(l / T) + log S)` as a group (`run(..., ape=(T, S))`).
- `defer-<mode>` (e.g. `defer-epic:16`, `defer-blend:0.15`): the same recompute set, *executed
  after every loaded token*: the KV order becomes SYS, the loaded tokens in prompt order, the
  computed tokens in prompt order, Q (positions unchanged). A computed token then attends to
  every loaded token, including those at later positions, and to the computed tokens before it.
  Any recompute set fits vLLM's scheduler this way (load, then compute a contiguous suffix).

`run(..., one_pass=True)` executes the same plan in one forward: every loaded token is appended
first, then all computed tokens go in one forward with a 4D mask that lets each see exactly what
the plan lets it see (loaded tokens before it in prompt order, or all of them when deferred, and
computed tokens up to itself); attention does not depend on the order of the KV, so the result
equals the loop's (checked by `tests/models/test_hf_recovery.py`), at one forward instead of one
per run of scattered tokens.

The loop runs the plan in order: maximal runs of loaded tokens are appended to an HF
`DynamicCache`, maximal runs of computed tokens are one forward over that cache. Greedy decoding
continues on the cache. fp32, eager attention.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch

from harness.hf_reference import Reference


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
    logprobs: list[float] = field(default_factory=list)  # of each greedy token
    gaps: list[float] = field(default_factory=list)  # top-1 minus top-2 log-probability per step


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
    mode: str,
    sys_len: int,
    chunk_lens: list[int],
    deviation: torch.Tensor | None = None,
    attention: torch.Tensor | None = None,
    rescore: Callable[[set[int]], torch.Tensor] | None = None,
) -> set[int]:
    """Region offsets (0 = first token of C_1) computed rather than loaded, for `mode`.

    `deviation` (for `blend`) and `attention` (for `qattn`): one score per region token.
    `rescore` (for `,two-stage`): the scores over the cache with the given offsets computed."""
    mode = mode.removeprefix("defer-")
    region = sum(chunk_lens)
    name, _, arg = mode.partition(":")
    if name in ("plain", "ape"):
        return set()
    if name == "full":
        return set(range(region))
    if name == "suffix":
        if arg.startswith("last"):
            m = int(arg.partition(":")[2] or 1)
            k = sum(chunk_lens[len(chunk_lens) - m :])
        else:
            k = int(arg)
        return set(range(max(0, region - k), region))
    if name in ("epic", "epicr"):
        if name == "epic":
            k = int(arg)
        else:
            r, rest = float(arg), len(chunk_lens) - 1
            k = max(chunk_lens) if r >= 1 else round(r * region / rest) if rest else 0
        out, at = set(), 0
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
    at = [0, *itertools.accumulate(chunk_lens)]  # chunk i spans at[i]..at[i + 1]
    if name == "chunks":
        return {t for i in map(int, arg.split("+")) for t in range(at[i], at[i + 1])}
    if name == "qdoc":
        if attention is None:
            raise ValueError("qdoc needs the question's attention over the region")
        mass = {i: float(attention[at[i] : at[i + 1]].float().sum()) for i in range(1, len(chunk_lens))}
        best = sorted(mass, key=lambda i: (-mass[i], i))[: int(arg)]
        return {t for i in best for t in range(at[i], at[i + 1])}
    if name == "cover":
        if attention is None:
            raise ValueError("cover needs the question's attention over the region")
        return cover_choice(attention, chunk_lens, arg)[0]
    if name == "qattn":
        if attention is None:
            raise ValueError("qattn needs the question's attention over the region")
        spec, *options = arg.split(",")
        fraction, _, runs = spec.partition("@")[0].partition("/")
        first = chunk_lens[0]  # C_1's cached KV is full attention's already
        count = min(round(float(fraction) * region), region - first)
        if not count:
            return set()
        if options:
            if not runs:
                raise ValueError(f"{mode!r}: the options of qattn need a run count (qattn:r/m,...)")
            return _refined(attention.float(), chunk_lens, count, int(runs), options, rescore)
        if runs:
            return _top_windows(attention.float(), first, count, int(runs))
        scores = attention.clone().float()
        scores[:first] = -math.inf
        return set(torch.topk(scores, count).indices.tolist())
    raise ValueError(f"unknown mode {mode!r}")


def _top_windows(
    scores: torch.Tensor, first: int, count: int, runs: int, floor: list[int] | None = None
) -> set[int]:
    """`qattn:r/m`: the region after C_1 cut into windows of `ceil(count / m)` tokens from C_2's
    first token on; the `ceil(count / width)` windows of highest summed score (ties: the earlier).
    `floor` (chunk start offsets after C_1): each of those chunks' best window ranks first."""
    width = -(-count // runs)
    starts, order = _ranked_windows(scores, first, width)
    if floor:
        bounds = [*floor, len(scores)]
        each = [
            next((i for i in order if lo <= starts[i] < hi), None) for lo, hi in itertools.pairwise(bounds)
        ]
        best_each = [i for i in each if i is not None]
        order = [*best_each, *(i for i in order if i not in best_each)]
    return _window_tokens(starts, order[: -(-count // width)], width, len(scores))


def _ranked_windows(scores: torch.Tensor, first: int, width: int) -> tuple[list[int], list[int]]:
    """The starts of the `width`-token windows from `first` on, and their indices by summed score
    (highest first; ties: the earlier window)."""
    starts = list(range(first, len(scores), width))
    sums = [float(scores[s : s + width].sum()) for s in starts]
    return starts, sorted(range(len(starts)), key=lambda i: (-sums[i], i))


def _window_tokens(starts: list[int], windows: list[int], width: int, end: int) -> set[int]:
    """The region offsets of those windows (the last one may stop at `end`)."""
    return {t for i in windows for t in range(starts[i], min(starts[i] + width, end))}


def _two_stage(
    scores: torch.Tensor,
    first: int,
    count: int,
    runs: int,
    rescore: Callable[[set[int]], torch.Tensor],
) -> set[int]:
    """`,two-stage`: `qattn:r/m`'s windows, the better half by `scores`, the rest by
    `rescore(first half)` among the windows left (see the module docstring)."""
    width = -(-count // runs)
    wanted = -(-count // width)
    starts, order = _ranked_windows(scores, first, width)
    early = order[: -(-wanted // 2)]
    chosen = _window_tokens(starts, early, width, len(scores))
    if len(early) == wanted:
        return chosen
    _, again = _ranked_windows(rescore(chosen).float(), first, width)
    late = [i for i in again if i not in early][: wanted - len(early)]
    return chosen | _window_tokens(starts, late, width, len(scores))


def cover_choice(attention: torch.Tensor, chunk_lens: list[int], arg: str) -> tuple[set[int], float, bool]:
    """`cover:t[/rmax[/rmin]]` (`arg` after the colon): the region offsets computed, the coverage
    (C_1's score and the computed windows' over the region's; at the ceiling when it falls back)
    and whether it falls back to every token after C_1."""
    values = [float(x) for x in arg.split("/")]
    target, rmax, rmin = [*values, 0.2, 0.0][:3] if len(values) == 1 else [*values, 0.0][:3]
    scores = attention.double()
    region, first = len(scores), chunk_lens[0]
    ceiling = min(round(rmax * region), region - first)
    floor = min(round(rmin * region), ceiling)
    total = math.fsum(scores.tolist())
    width = math.ceil(ceiling / 16) if ceiling else 1
    starts = list(range(first, region, width))
    sums = [float(scores[s : s + width].sum()) for s in starts]
    ranked = sorted(range(len(starts)), key=lambda i: (-sums[i], i))[: math.ceil(ceiling / width)]
    picked = [set(range(starts[i], min(starts[i] + width, region))) for i in ranked]
    covered = [
        math.fsum(scores[:first].tolist() + scores[sorted(set().union(*picked[:k]))].tolist())
        for k in range(len(picked) + 1)
    ]
    for k in range(math.ceil(floor / width), len(covered)):
        if covered[k] >= target * total:
            return set().union(*picked[:k]), covered[k] / total if total > 0 else 1.0, False
    return set(range(first, region)), covered[-1] / total, True


def _grown_runs(scores: torch.Tensor, first: int, count: int, runs: int) -> set[int]:
    """`,grow`: `count` tokens after C_1 in at most `runs` runs, each step the best token next to
    a chosen run or, while fewer than `runs` runs exist, the best token anywhere."""
    chosen = torch.zeros(len(scores), dtype=torch.bool)
    chosen[:first] = True  # never C_1
    for _ in range(count):
        picked = chosen.clone()
        picked[:first] = False
        edges = picked.int().diff(
            prepend=torch.zeros(1, dtype=torch.int32), append=torch.zeros(1, dtype=torch.int32)
        )
        open_ = torch.zeros(len(scores), dtype=torch.bool)
        if int((edges == 1).sum()) < runs:
            open_ = ~chosen
        else:
            for lo in (edges == 1).nonzero().flatten().tolist():
                if lo - 1 >= first and not chosen[lo - 1]:
                    open_[lo - 1] = True
            for hi in (edges == -1).nonzero().flatten().tolist():
                if hi < len(scores) and not chosen[hi]:
                    open_[hi] = True
        if not open_.any():
            break
        chosen[int(torch.where(open_, scores, -math.inf).argmax())] = True
    chosen[:first] = False
    return set(chosen.nonzero().flatten().tolist())


def _refined(
    scores: torch.Tensor,
    chunk_lens: list[int],
    count: int,
    runs: int,
    options: list[str],
    rescore: Callable[[set[int]], torch.Tensor] | None = None,
) -> set[int]:
    """`qattn:r/m,<options>` (sink:k, floor, grow, two-stage): see the module docstring."""
    if "two-stage" in options:
        if options != ["two-stage"]:
            raise ValueError(f"two-stage takes no other qattn option: {options}")
        if rescore is None:
            raise ValueError("two-stage needs the question's attention over a partly recomputed cache")
        return _two_stage(scores, chunk_lens[0], count, runs, rescore)
    heads: set[int] = set()
    floor, grow = None, False
    offsets = [sum(chunk_lens[:i]) for i in range(1, len(chunk_lens))]  # chunk starts after C_1
    for option in options:
        key, _, value = option.partition(":")
        if key == "sink" and offsets:
            k = min(int(value), count // len(offsets))
            heads = {at + j for at, n in zip(offsets, chunk_lens[1:], strict=True) for j in range(min(k, n))}
        elif key == "floor":
            floor = offsets
        elif key == "grow":
            grow = True
        elif key != "sink":
            raise ValueError(f"unknown qattn option {option!r}")
    rest = count - len(heads)
    if not rest:
        return heads
    scores = scores.clone()
    scores[sorted(heads)] = 0.0
    first = chunk_lens[0]
    if grow:
        chosen = _grown_runs(scores, first, rest, runs)
    else:
        chosen = _top_windows(scores, first, rest, runs, floor)
    return heads | chosen


def ape_setting(mode: str) -> tuple[float, float] | None:
    """(T, S) of an `ape:T,S` mode, else None."""
    name, _, arg = mode.removeprefix("defer-").partition(":")
    if name != "ape":
        return None
    t, s = arg.split(",")
    return float(t), float(s)


def qattn_layer(model, mode: str) -> int | tuple[int, ...]:
    """The layer whose attention a `qattn:r[@L]` mode reads (default: the middle one), or the
    layers of `qattn:r@L1+L2+...` (their scores summed)."""
    _, _, layer = mode.partition(",")[0].partition("@")
    if "+" in layer:
        return tuple(int(x) for x in layer.split("+"))
    return int(layer) if layer else model.config.num_hidden_layers // 2


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@contextlib.contextmanager
def _attention(model, ape: tuple[float, float] | None = None, region: slice | None = None, record=None):
    """Eager attention (of the model's own modeling module: Llama, Qwen2), with APE's region
    scaling and/or one layer's weights recorded.

    `ape` = (T, S): for the KV columns `region`, logits `l` become `l / T + (T - 1) * lse(l / T) +
    log S` (lse over the region, per query row), i.e. APE's grouped softmax in one softmax.
    `record` = (layers, list): the attention weights [1, H, q, kv] of those layers are appended."""
    modeling = sys.modules[type(model).__module__]

    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = module.num_key_value_groups
        k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
        logits = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            logits = logits + attention_mask[:, :, :, : k.shape[-2]]
        if ape is not None:
            t, s = ape
            doc = logits[..., region] / t
            logits = logits.clone()
            logits[..., region] = doc + (t - 1) * torch.logsumexp(doc, -1, keepdim=True) + math.log(s)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
        if record is not None and module.layer_idx in record[0]:
            record[1].append(weights)
        return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights

    if model.config._attn_implementation != "eager":
        raise ValueError("the APE / recording attention replaces eager attention only")
    with mock.patch.object(modeling, "eager_attention_forward", forward):
        yield


def _loaded_cache(model, kv: ChunkKV, sys_len: int, starts: list[int]):
    """SYS + every chunk loaded whole (re-rotated to `starts`), as `plain` serves it."""
    cache = _cache_from([(k.clone(), v.clone()) for k, v in kv.sys])
    for i, layers in enumerate(kv.chunks):
        for layer, (k, v) in enumerate(layers):
            cache.update(rotate(model, k, starts[i] - sys_len), v, layer)
    return cache


@torch.no_grad()
def question_attention(
    model,
    prompt: list[int],
    sys_len: int,
    chunk_lens: list[int],
    layout: str,
    kv: ChunkKV,
    layer: int | tuple[int, ...],
    drop_last: bool = False,
    compute: set[int] | None = None,
) -> torch.Tensor:
    """Per region token: the question's attention weight at `layer` over the plainly loaded cache,
    summed over heads and question tokens (`qattn:r`), and over the layers if `layer` is a tuple;
    `drop_last`: over all but the question's last token (`qattn:r/m`, the engine's form: its
    scoring pass stops before the token that samples). `compute`: over the cache with those region
    offsets computed instead (`,two-stage`'s second scores)."""
    starts, q_start = layout_starts(sys_len, chunk_lens, layout)
    if compute:  # run by run, so that the cache's columns stay in prompt order
        cache = _region_cache(model, prompt, sys_len, chunk_lens, layout, compute, kv)
    else:
        cache = _loaded_cache(model, kv, sys_len, starts)
    q_ids = prompt[sys_len + sum(chunk_lens) :]
    weights: list[torch.Tensor] = []
    layers = layer if isinstance(layer, tuple) else (layer,)
    with _attention(model, record=(layers, weights)):
        model(
            input_ids=torch.tensor([q_ids]),
            position_ids=torch.arange(q_start, q_start + len(q_ids))[None],
            past_key_values=cache,
            use_cache=True,
        )
    rows = slice(0, len(q_ids) - 1 if drop_last else None)
    region = slice(sys_len, sys_len + sum(chunk_lens))
    return sum(w[0, :, rows, region].sum(dim=(0, 1)).float() for w in weights)


def _region_cache(
    model,
    prompt: list[int],
    sys_len: int,
    chunk_lens: list[int],
    layout: str,
    compute: set[int],
    kv: ChunkKV,
    defer: bool = False,
    one_pass: bool = False,
):
    """SYS and the region as the plan serves them: the tokens of `compute` computed, the others
    loaded (see `run`)."""
    starts, _ = layout_starts(sys_len, chunk_lens, layout)
    # Per region token: (prompt index, position, chunk, offset in chunk, computed?)
    tokens = []
    at = 0
    for i, n in enumerate(chunk_lens):
        for j in range(n):
            tokens.append((sys_len + at + j, starts[i] + j, i, j, (at + j) in compute))
        at += n
    if defer or one_pass:
        tokens = [t for t in tokens if not t[4]] + [t for t in tokens if t[4]]
    cache = _cache_from([(k.clone(), v.clone()) for k, v in kv.sys])
    r = 0
    while r < len(tokens):
        end = r
        # A run: computed tokens of any chunks, or consecutive loaded tokens of one chunk.
        while (
            end < len(tokens)
            and tokens[end][4] == tokens[r][4]
            and (
                tokens[r][4]
                or end == r
                or (tokens[end][2] == tokens[r][2] and tokens[end][3] == tokens[end - 1][3] + 1)
            )
        ):
            end += 1
        run_ = tokens[r:end]
        if run_[0][4]:  # computed
            ids = torch.tensor([[prompt[t[0]] for t in run_]])
            pos = torch.tensor([[t[1] for t in run_]])
            mask = _plan_mask(tokens[:r], run_, sys_len, defer) if one_pass and not defer else None
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, attention_mask=mask)
        else:  # loaded: one chunk's slice, re-rotated to the layout's start
            i, j0, j1 = run_[0][2], run_[0][3], run_[-1][3] + 1
            delta = starts[i] - sys_len
            for layer, (k, v) in enumerate(kv.chunks[i]):
                cache.update(rotate(model, k[:, :, j0:j1], delta), v[:, :, j0:j1], layer)
        r = end
    return cache


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
    one_pass: bool = False,
    ape: tuple[float, float] | None = None,
) -> Outcome:
    """Execute the plan (loaded/computed region tokens, then Q), then decode greedily.

    `defer`: the computed tokens go after every loaded token (a contiguous suffix before Q).
    `one_pass`: every loaded token first, then the computed ones in one masked forward (same result).
    `ape` = (T, S): the question's and generated tokens' attention over the region follows APE."""
    cache = _region_cache(model, prompt, sys_len, chunk_lens, layout, compute, kv, defer, one_pass)
    _, q_start = layout_starts(sys_len, chunk_lens, layout)
    q_ids = prompt[sys_len + sum(chunk_lens) :]
    positions = torch.arange(q_start, q_start + len(q_ids))[None]
    region = slice(sys_len, sys_len + sum(chunk_lens))
    scaled = _attention(model, ape=ape, region=region) if ape else contextlib.nullcontext()
    with scaled:
        logits = (
            model(
                input_ids=torch.tensor([q_ids]), position_ids=positions, past_key_values=cache, use_cache=True
            )
            .logits[0, -1]
            .float()
        )
        steps, first = _decode(model, cache, logits, q_start + len(q_ids), max_tokens, eos)
    return Outcome(steps.tokens, first, len(compute) + len(q_ids), steps.logprobs, steps.gaps)


def _plan_mask(loaded: list[tuple], computed: list[tuple], sys_len: int, defer: bool) -> torch.Tensor:
    """[1, 1, m, kv] additive mask of one forward of every computed token over SYS + the loaded
    tokens: a computed token sees SYS, the loaded tokens before it in prompt order (all of them if
    `defer`), and the computed tokens up to itself in prompt order."""
    lp = torch.tensor([t[0] for t in loaded], dtype=torch.long)
    cp = torch.tensor([t[0] for t in computed], dtype=torch.long)
    see_sys = torch.ones(len(cp), sys_len, dtype=torch.bool)
    see_loaded = torch.ones(len(cp), len(lp), dtype=torch.bool) if defer else lp[None, :] < cp[:, None]
    see_computed = cp[None, :] <= cp[:, None]
    allowed = torch.cat([see_sys, see_loaded, see_computed], dim=1)
    mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(
        ~allowed, torch.finfo(torch.float32).min
    )
    return mask[None, None]


def _decode(
    model, cache, logits: torch.Tensor, pos: int, max_tokens: int, eos: int | None
) -> tuple[Reference, torch.Tensor]:
    """Greedy steps from the first answer token's logits on (tokens, their log-probabilities and
    top-2 gaps), and the first token's log-softmax."""
    first = torch.log_softmax(logits, dim=-1)
    steps = Reference(tokens=[])
    for _ in range(max_tokens):
        if eos is not None and int(logits.argmax()) == eos:
            break
        token = steps.take(logits)
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
    return steps, first


@torch.no_grad()
def run_full(
    model, prompt: list[int], max_tokens: int = 16, eos: int | None = None, check_layer: int = 1
) -> tuple[Outcome, torch.Tensor]:
    """Full attention (an ordinary causal prompt), and its keys at `check_layer` [T, H*D]."""
    outputs = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, logits = outputs.past_key_values, outputs.logits[0, -1].float()
    keys = cache.layers[check_layer].keys[0].transpose(0, 1).reshape(len(prompt), -1).clone()
    steps, first = _decode(model, cache, logits, len(prompt), max_tokens, eos)
    return Outcome(steps.tokens, first, len(prompt), steps.logprobs, steps.gaps), keys


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
