"""The RAG benchmark's document sets (`--doc-sets`, `--long-sets`): per set of n documents of ~T
tokens, the TTFT p50 of every configuration and recovery variant, their ratios, and the targets
of issue 58 (each from one run: two configurations on the same requests).
"""

from __future__ import annotations

from benchmarks.rag_summary import Spec, p50_of, sweep_key

SET_TARGETS: dict[tuple[str, str | None], Spec] = {
    ("warm_speedup", "32x1024"): ("fully warm TTFT p50 of 32 x 1K: no caching / chunk cache", 10.0, "min"),
    ("warm_speedup", "8x2048"): ("fully warm TTFT p50 of 8 x 2K: no caching / chunk cache", 5.0, "min"),
    ("floor_ratio", "32x1024"): (
        "fully warm TTFT p50 of 32 x 1K: chunk cache / the exact-prefix hit (prefix caching)",
        1.2,
        "max",
    ),
    ("cold_overhead", None): ("cold TTFT p50 of {set}: chunk cache / no caching", 1.2, "max"),
    ("qattn_vs_full", None): (
        "fully warm TTFT p50 of {set}: {mode} / no caching (full prefill)",
        0.35,
        "max",
    ),
}
"""(ratio, set) -> target; set None: every set (issue 58's targets on the 8B shape)."""


def set_key(sample: dict) -> str | None:
    """`NxT` of a sample of a document set (None for one of the plain sweep)."""
    return None if sample.get("doc_tokens") is None else sweep_key(sample)


def _in_set(key: str, phase: str, label: str, recovery: str | None = None):
    return lambda s: (
        set_key(s) == key and s["phase"] == phase and s["label"] == label and s.get("recovery") == recovery
    )


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def set_table(results: dict[str, dict]) -> dict[str, dict]:
    """Per set (`NxT`, in the order sent): TTFT p50 (ms) of no caching warm and cold, prefix
    caching warm (reordered) and its exact-prefix hit (the floor), the chunk cache warm and cold,
    each recovery variant warm (with its fallbacks per request and tokens recomputed), and the
    ratios against them."""
    nc, pc, cc = (results.get(k) for k in ("no_cache", "prefix", "chunk"))
    samples = [s for r in results.values() for s in r.get("samples", [])]
    keys = list(dict.fromkeys(k for k in map(set_key, samples) if k))
    modes = list(dict.fromkeys(s["recovery"] for s in samples if s.get("recovery")))
    table = {}
    for key in keys:
        row = {
            "prompt_tokens": max(
                (s["prompt_tokens"] or 0 for s in samples if set_key(s) == key), default=None
            ),
            "no_cache_warm_ms": p50_of(nc, _in_set(key, "sweep", "warm")),
            "no_cache_cold_ms": p50_of(nc, _in_set(key, "sweep", "cold")),
            "prefix_warm_ms": p50_of(pc, _in_set(key, "sweep", "warm")),
            "floor_ms": p50_of(pc, _in_set(key, "repeat", "warm")),
            "chunk_warm_ms": p50_of(cc, _in_set(key, "sweep", "warm")),
            "chunk_cold_ms": p50_of(cc, _in_set(key, "sweep", "cold")),
        }
        row |= {
            "warm_speedup": _ratio(row["no_cache_warm_ms"], row["chunk_warm_ms"]),
            "floor_ratio": _ratio(row["chunk_warm_ms"], row["floor_ms"]),
            "cold_overhead": _ratio(row["chunk_cold_ms"], row["no_cache_cold_ms"]),
        }
        variants = {}
        for mode in modes:
            picked = [s for s in (cc or {}).get("samples", []) if _in_set(key, "variant", "warm", mode)(s)]
            warm = p50_of(cc, _in_set(key, "variant", "warm", mode))
            fallbacks = [s["cover_fallbacks"] for s in picked if s.get("cover_fallbacks") is not None]
            selected = [s["selected_tokens"] for s in picked if s.get("selected_tokens") is not None]
            variants[mode] = {
                "warm_ms": warm,
                "requests": len(picked),
                "fallback_rate": sum(fallbacks) / len(fallbacks) if fallbacks else None,
                "selected_tokens_mean": sum(selected) / len(selected) if selected else None,
                "vs_full": _ratio(warm, row["no_cache_warm_ms"]),
                "vs_reuse": _ratio(warm, row["chunk_warm_ms"]),
            }
        table[key] = row | {"variants": variants}
    return table


def set_targets(table: dict[str, dict]) -> dict[str, dict]:
    """The targets of `SET_TARGETS` that the sets of `table` have, as `rag_summary.targets` gives
    them (`qattn_vs_full`: every `qattn` variant)."""
    out = {}
    for key, row in table.items():
        for (ratio, at), (what, limit, kind) in SET_TARGETS.items():
            if at not in (None, key):
                continue
            if ratio == "qattn_vs_full":
                pairs = [
                    (f"{ratio}_{mode}_{key}", v["vs_full"], what.format(set=key, mode=mode))
                    for mode, v in row["variants"].items()
                    if mode.startswith("qattn")
                ]
            else:
                pairs = [(f"{ratio}_{key}", row[ratio], what.format(set=key))]
            for name, value, said in pairs:
                ok = None if value is None else value >= limit if kind == "min" else value <= limit
                target = f"{'>=' if kind == 'min' else '<='} {limit}"
                out[name] = {"what": said, "value": value, "target": target, "pass": ok}
    return out
