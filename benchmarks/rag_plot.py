"""The RAG benchmark's PNG: TTFT against the number of documents and over the request sequence;
with --concurrency / --itl, requests/s and TTFT per level and ITL per kind of prompt.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.rag_servers import CONFIGS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {"no_cache": "tab:gray", "prefix": "tab:blue", "chunk": "tab:red"}


def plot(report: dict, path: Path, title: str = "") -> None:
    """Sequential requests (if any): TTFT against the number of documents, and TTFT over the
    request sequence. With --concurrency / --itl, a row more: requests/s and TTFT p50/p99 per
    level, and ITL per kind of prompt, chunk cache off / on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["configs"]
    sequential = any(s["phase"] != "warmup" for r in results.values() for s in r.get("samples", []))
    extra = any(r.get("concurrency") for r in results.values()) or "summary" in report.get("itl", {})
    rows = int(sequential) + int(extra)
    fig = plt.figure(figsize=(13, 4.8 * rows))
    grid = fig.add_gridspec(rows, 6)
    if sequential:
        if report.get("sets"):
            _plot_sets(report["sets"], fig.add_subplot(grid[0, :2]))
        else:
            _plot_sweep(results, fig.add_subplot(grid[0, :2]))
        _plot_sequence(results, fig.add_subplot(grid[0, 2:]))
    if extra:
        row = rows - 1
        _plot_concurrency(results, fig.add_subplot(grid[row, :2]), fig.add_subplot(grid[row, 2:4]))
        _plot_itl(report.get("itl", {}), fig.add_subplot(grid[row, 4:]))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(name: str) -> str:
    return CONFIGS.get(name, {}).get("title", name)


def _plot_sweep(results: dict[str, dict], ax: Axes) -> None:
    """TTFT p50 against documents per request, cold and warm, per configuration."""
    sizes: set[int] = set()
    for name, result in results.items():
        if not result.get("samples"):
            continue
        sweep = result["summary"]["sweep"]
        ns = sorted(sweep, key=int)
        sizes.update(int(n) for n in ns)
        for kind, style in (("warm", "-o"), ("cold", "--x")):
            xs = [int(n) for n in ns if sweep[n][f"{kind}_ms"] is not None]
            ys = [sweep[n][f"{kind}_ms"] for n in ns if sweep[n][f"{kind}_ms"] is not None]
            if xs:
                ax.plot(xs, ys, style, color=COLORS.get(name), label=f"{_label(name)}, {kind}")
    ax.set(
        xlabel="documents per request",
        ylabel="TTFT (ms)",
        yscale="log",
        title="TTFT vs documents (warm: p50 of repeats in new orders)",
    )
    ax.set_xscale("log", base=2)
    ticks = sorted(sizes) or [1, 2, 4, 8]
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _plot_sets(sets: dict[str, dict], ax: Axes) -> None:
    """Per document set, TTFT p50 of each configuration and recovery variant (bars)."""
    modes = list(dict.fromkeys(m for row in sets.values() for m in row["variants"]))
    bars = [
        ("no caching", "no_cache_warm_ms", COLORS["no_cache"]),
        ("exact-prefix floor", "floor_ms", COLORS["prefix"]),
        ("chunk cache, warm", "chunk_warm_ms", COLORS["chunk"]),
        ("chunk cache, cold", "chunk_cold_ms", "tab:orange"),
        *[
            (f"{m}, warm", m, c)
            for m, c in zip(modes, ("tab:green", "tab:purple", "tab:brown"), strict=False)
        ],
    ]
    width = 0.8 / len(bars)
    for i, (label, key, color) in enumerate(bars):
        ys = [
            row["variants"].get(key, {}).get("warm_ms") if key in modes else row[key] for row in sets.values()
        ]
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(sets))]
        ax.bar(
            [x for x, y in zip(xs, ys, strict=True) if y],
            [y for y in ys if y],
            width,
            color=color,
            label=label,
        )
    ax.set_xticks(range(len(sets)), [f"{k}\n{row['prompt_tokens'] or '?'} tok" for k, row in sets.items()])
    ax.set(ylabel="TTFT p50 (ms)", yscale="log", title="TTFT per document set (n x tokens)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _plot_sequence(results: dict[str, dict], ax: Axes) -> None:
    """TTFT of every request after the warmup, in the order sent, the phases marked."""
    from matplotlib.ticker import MaxNLocator

    for name, result in results.items():
        if not result.get("samples"):
            continue
        samples = [s for s in result["samples"] if s["phase"] != "warmup"]
        ax.plot(
            [s["index"] for s in samples],
            [s["ttft_ms"] for s in samples],
            ".-",
            color=COLORS.get(name),
            label=_label(name),
            linewidth=0.8,
            markersize=4,
        )
    first = next((r for r in results.values() if r.get("samples")), None)
    if first:
        bounds: dict[str, list[int]] = {}
        for s in first["samples"]:
            if s["phase"] != "warmup":
                bounds.setdefault(s["phase"], []).append(s["index"])
        for phase, idx in bounds.items():
            ax.axvline(min(idx) - 0.5, color="black", alpha=0.2)
            ax.text(min(idx), 1.0, phase, transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)
    ax.set(xlabel="request (sent one at a time)", ylabel="TTFT (ms)", yscale="log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("TTFT over the request sequence", pad=14)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _plot_concurrency(results: dict[str, dict], ax1: Axes, ax2: Axes) -> None:
    """Requests/s per level (bars) and TTFT p50/p99 against requests in flight."""
    names = [n for n, r in results.items() if r.get("concurrency")]
    levels = sorted({lv for n in names for lv in results[n]["concurrency"]}, key=int)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        color, label = COLORS.get(name), _label(name)
        conc = results[name]["concurrency"]
        xs = [j + (i - (len(names) - 1) / 2) * width for j, lv in enumerate(levels) if lv in conc]
        ax1.bar(
            xs, [conc[lv]["requests_per_s"] for lv in levels if lv in conc], width, color=color, label=label
        )
        for stat, style in (("p50", "-o"), ("p99", "--x")):
            present = [lv for lv in levels if lv in conc]
            ax2.plot(
                [int(lv) for lv in present],
                [conc[lv][stat] for lv in present],
                style,
                color=color,
                label=f"{label}, {stat}",
            )
    ax1.set_xticks(range(len(levels)), [f"{lv} clients" for lv in levels])
    ax1.set(ylabel="requests/s", title="Zipf stream throughput")
    ax1.grid(True, axis="y", alpha=0.3)
    ax2.set(xlabel="requests in flight", ylabel="TTFT (ms)", yscale="log", title="Zipf stream TTFT")
    if levels:
        ax2.set_xscale("log", base=2)
        ax2.set_xticks([int(lv) for lv in levels], levels)
    ax2.grid(True, which="both", alpha=0.3)
    for ax in (ax1, ax2):
        if names:
            ax.legend(fontsize=7)


def _plot_itl(itl: dict, ax: Axes) -> None:
    """Mean ITL per kind of prompt, chunk cache off / on, each request a dot."""
    samples = itl.get("samples") or []
    for k, kind in enumerate(("ordinary", "chunked")):
        for c, config in enumerate(("prefix", "chunk")):
            ys = [s["itl_ms"] for s in samples if s["kind"] == kind and s["config"] == config and s["itl_ms"]]
            x = 2.5 * k + c
            if ys:
                name = "chunk cache off" if config == "prefix" else "chunk cache on"
                ax.bar(
                    x,
                    statistics.fmean(ys),
                    0.8,
                    color=COLORS[config],
                    alpha=0.5,
                    label=name if k == 0 else None,
                )
                ax.plot([x] * len(ys), ys, ".", color="black", markersize=3)
    ax.set_xticks([0.5, 3.0], ["ordinary prompts", "chunked prompts"])
    ax.set(
        ylabel="ITL (ms, vLLM's histogram, per request)",
        title=f"decode cost ({itl.get('tokens', '?')} tokens streamed)",
    )
    ax.grid(True, axis="y", alpha=0.3)
    if samples:
        ax.legend(fontsize=7)
