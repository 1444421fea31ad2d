"""The RAG benchmark's summary tables on stdout, from its JSON report: TTFT and hit rates per
configuration and phase, the concurrent streams, decode cost, the document sweep, the targets.
"""

from __future__ import annotations

from benchmarks.rag_servers import CHUNK_HITS, CHUNK_MISSES, CONFIGS


def fmt(value: float | None, spec: str = ".0f") -> str:
    """`value` formatted with `spec`, "-" for None."""
    return "-" if value is None else format(value, spec)


def print_summary(report: dict) -> None:
    """Every table of the report that has data."""
    _print_phases(report["configs"])
    if any(r.get("concurrency") for r in report["configs"].values()):
        _print_concurrency(report["configs"])
    itl = report.get("itl", {}).get("summary")
    if itl:
        _print_itl(itl)
    _print_sweep(report["configs"])
    if report.get("sets"):
        _print_sets(report["sets"])
    _print_targets(report["targets"])


def _print_phases(configs: dict[str, dict]) -> None:
    print("\nTTFT (ms) per configuration and phase; hit rates over the phase")
    print(
        f"{'config':<9} {'phase':<9} {'n':>3} {'mean':>8} {'p50':>8} {'p99':>8} {'req/s':>6} "
        f"{'chunk hit':>9} {'prefix hit':>10}"
    )
    for name, result in configs.items():
        if "error" in result:
            print(f"{name:<9} ERROR: {result['error'].splitlines()[0]}")
            continue
        for phase, p in result["summary"]["phases"].items():
            t = p["ttft_ms"]
            print(
                f"{name:<9} {phase:<9} {t['n']:>3} {fmt(t['mean']):>8} {fmt(t['p50']):>8} "
                f"{fmt(t['p99']):>8} "
                f"{fmt(p['requests_per_s'], '.2f'):>6} {fmt(p['chunk_hit_rate'], '.0%'):>9} "
                f"{fmt(p['prefix_hit_rate'], '.0%'):>10}"
            )


def _print_concurrency(configs: dict[str, dict]) -> None:
    print("\nZipf stream with requests in flight")
    for name, result in configs.items():
        for level, c in result.get("concurrency", {}).items():
            print(
                f"{name:<9} {level:>3} clients: {c['requests']:>3} requests "
                f"{c['requests_per_s']:6.2f} req/s, "
                f"TTFT p50 {c['p50']:7.0f} ms p99 {c['p99']:7.0f} ms, chunk hit rate "
                f"{fmt(c['chunk_hit_rate'], '.0%')}"
            )


def _print_itl(itl: dict) -> None:
    print(
        "\nInter-token latency (ms; vLLM's histogram, mean / p50 over requests), chunk cache off "
        "(prefix) / on (chunk)"
    )
    for kind in ("ordinary", "chunked"):
        off, on = itl[f"{kind}_prefix"], itl[f"{kind}_chunk"]
        print(
            f"  {kind:<9} off {fmt(off['mean'], '.2f')} / {fmt(off['p50'], '.2f')}   on "
            f"{fmt(on['mean'], '.2f')} / {fmt(on['p50'], '.2f')}   overhead mean "
            f"{fmt(itl[f'{kind}_overhead_mean'], '+.1%')}, "
            f"p50 {fmt(itl[f'{kind}_overhead_p50'], '+.1%')}, "
            f"paired median {fmt(itl[f'{kind}_overhead_paired_median'], '+.1%')}; as the client saw "
            f"it {fmt(itl[f'{kind}_prefix_client']['mean'], '.2f')} / "
            f"{fmt(itl[f'{kind}_chunk_client']['mean'], '.2f')} "
            f"({fmt(itl[f'{kind}_overhead_client_mean'], '+.1%')})"
        )


def _print_sweep(configs: dict[str, dict]) -> None:
    print("\nTTFT (ms) vs documents per request (p50; cold = first time, warm = same documents reordered)")
    names = [n for n, r in configs.items() if "summary" in r]
    print(f"{'docs':>4} " + " ".join(f"{n + ' cold':>14} {n + ' warm':>14}" for n in names))
    ns = sorted(
        {n for name in names for n in configs[name]["summary"]["sweep"]},
        key=lambda n: tuple(int(x) for x in n.split("x")),
    )
    for n in ns:
        cells = []
        for name in names:
            sw = configs[name]["summary"]["sweep"].get(n, {})
            cells.append(f"{fmt(sw.get('cold_ms')):>14} {fmt(sw.get('warm_ms')):>14}")
        print(f"{n:>4} " + " ".join(cells))
    missing = [
        n
        for n in names
        if not configs[n]["summary"]["metrics_available"]["chunk_cache"] and CONFIGS[n]["chunk_cache"]
    ]
    if missing:
        print(f"\nnote: the server exposes no {CHUNK_HITS} / {CHUNK_MISSES}: chunk hit rates are null")


def _print_sets(sets: dict[str, dict]) -> None:
    print(
        "\nDocument sets, TTFT p50 (ms): no caching, the exact-prefix floor, chunk cache, recovery variants"
    )
    for key, row in sets.items():
        variants = "  ".join(
            f"{mode} {fmt(v['warm_ms'])} ({fmt(v['vs_full'], '.2f')} x full"
            + (f", fallbacks {fmt(v['fallback_rate'], '.0%')}" if mode.startswith("cover") else "")
            + ")"
            for mode, v in row["variants"].items()
        )
        print(
            f"  {key:<8} {fmt(row['prompt_tokens']):>6} tok  no caching {fmt(row['no_cache_warm_ms'])} "
            f"floor {fmt(row['floor_ms'])}  chunk warm {fmt(row['chunk_warm_ms'])} "
            f"({fmt(row['warm_speedup'], '.1f')} x, {fmt(row['floor_ratio'], '.2f')} x floor) cold "
            f"{fmt(row['chunk_cold_ms'])} ({fmt(row['cold_overhead'], '.2f')} x)  {variants}"
        )


def _print_targets(targets: dict[str, dict]) -> None:
    print("\nTargets (each from this run)")
    for t in targets.values():
        verdict = "n/a" if t["pass"] is None else "PASS" if t["pass"] else "MISS"
        print(f"  {t['what']:<70} {fmt(t['value'], '.3f'):>8}  target {t['target']:<7} {verdict}")
