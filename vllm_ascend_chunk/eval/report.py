"""What an evaluation reports: per setting its scores with 95 % intervals, the recommendation, a
terminal table, the JSON (written whole after every sample) and a PNG (if matplotlib is there).

The recommendation is the cheapest candidate (lowest warm TTFT p50; the computed share breaks a
tie) whose agreement with full attention has a Wilson lower bound at or above
`--min-agreement`; the candidates are the recovery modes and the guard. When none qualifies it
says to serve full attention for this workload.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from vllm_ascend_chunk.eval import scores

NONE_MEETS = "none meets it: serve full attention for this workload"


def proportion(values: list[float]) -> dict:
    k = sum(values)
    low, high = scores.wilson(k, len(values))
    return {"mean": k / len(values), "low": low, "high": high, "count": k}


def mean(values: list[float]) -> dict:
    low, high = scores.bootstrap(values)
    return {"mean": statistics.fmean(values), "low": low, "high": high}


def quantile_ms(values: list[float], q: float) -> dict:
    ms = [v * 1e3 for v in values]
    low, high = scores.bootstrap(ms, lambda xs: scores.percentile(xs, q))
    return {"value": scores.percentile(ms, q), "low": low, "high": high}


def summarize(answers: list[dict]) -> dict:
    """One setting's summary over its rows' answers."""
    out = {
        "n": len(answers),
        "agreement": proportion([a["agree"] for a in answers]),
        "f1": mean([a["f1"] for a in answers]),
        "ttft_p50_ms": quantile_ms([a["ttft_s"] for a in answers], 0.5),
        "ttft_p90_ms": quantile_ms([a["ttft_s"] for a in answers], 0.9),
        "contains": None,
        "computed": None,
        "fallbacks": None,
    }
    golds = [a["contains"] for a in answers if a.get("contains") is not None]
    if golds:
        out["contains"] = proportion(golds)
    if all("computed" in a for a in answers):
        out["computed"] = mean([a["computed"] for a in answers])
    if all("fallback" in a for a in answers):
        out["fallbacks"] = proportion([float(a["fallback"]) for a in answers])
    return out


def recommend(summary: dict, candidates: list[str], min_agreement: float) -> dict:
    """The cheapest candidate whose agreement's lower bound meets `min_agreement`."""
    meets = [c for c in candidates if summary[c]["agreement"]["low"] >= min_agreement]

    def cost(c: str) -> tuple[float, float]:
        computed = summary[c]["computed"]
        return (summary[c]["ttft_p50_ms"]["value"], computed["mean"] if computed else 0.0)

    n = summary["full"]["n"]
    best_bound = scores.wilson(n, n)[0]
    if not meets:
        text = f"{NONE_MEETS} (no agreement's 95 % lower bound reaches {min_agreement:g}"
        if best_bound < min_agreement:
            text += f"; with {n} samples even 100 % agreement's lower bound is {best_bound:.2f}: measure more"
        return {"setting": None, "text": text + ")", "min_agreement": min_agreement}
    choice = min(meets, key=cost)
    low = summary[choice]["agreement"]["low"]
    return {
        "setting": choice,
        "text": f"{choice}: agreement's 95 % lower bound {low:.2f} >= {min_agreement:g}, "
        f"warm TTFT p50 {summary[choice]['ttft_p50_ms']['value']:.0f} ms",
        "min_agreement": min_agreement,
    }


def _interval(d: dict | None, key: str = "mean", scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if d is None:
        return "-"
    return f"{fmt.format(d[key] * scale)} [{fmt.format(d['low'] * scale)}, {fmt.format(d['high'] * scale)}]"


def table(summary: dict) -> str:
    """The summary as a fixed-width table, one line per setting."""
    head = [
        "setting",
        "agreement",
        "F1 vs full",
        "contains",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "computed",
        "fallbacks",
    ]
    lines = []
    for setting, s in summary.items():
        fallbacks = s["fallbacks"]
        lines.append(
            [
                setting,
                _interval(s["agreement"]),
                _interval(s["f1"]),
                _interval(s["contains"]),
                _interval(s["ttft_p50_ms"], "value", fmt="{:.0f}"),
                _interval(s["ttft_p90_ms"], "value", fmt="{:.0f}"),
                _interval(s["computed"], scale=100, fmt="{:.0f}") + (" %" if s["computed"] else ""),
                "-" if fallbacks is None else f"{fallbacks['count']:.0f} of {s['n']}",
            ]
        )
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *lines])


def write_json(path: Path, doc: dict) -> None:
    """The whole document, atomically: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def plot(summary: dict, path: Path, title: str) -> str | None:
    """Agreement and contains against warm TTFT p50, one marker per setting; None if written,
    else why not."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no PNG"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("agreement", "agreement with full attention")]
    if all(s["contains"] is not None for s in summary.values()):
        keys.append(("contains", "gold answer contained"))
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    markers = "s^vDoPX*<>hd"
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        for (setting, s), marker in zip(summary.items(), markers * 4, strict=False):
            x, y = s["ttft_p50_ms"]["value"], s[key]["mean"]
            ax.errorbar(
                x,
                y,
                yerr=[[max(0.0, y - s[key]["low"])], [max(0.0, s[key]["high"] - y)]],
                marker=marker,
                markersize=8,
                capsize=3,
                label=setting,
            )
            ax.annotate(setting, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("warm TTFT p50, ms (log)")
        ax.set_ylabel(f"{label} (95 % interval)")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
