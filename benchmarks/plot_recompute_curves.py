#!/usr/bin/env python3
"""Curves of selective recompute (issue 25) from `benchmarks/explore_recovery.py` JSONs.

One PNG per JSON, three panels (gold in answer, agreement with full attention, first-token KL)
against the fraction of document tokens recomputed; one line per budgeted rule (`blend:r`,
`qattn:r`, `epicr:r`, `qdoc:k`, sequential layout; one per variant of a rule, e.g.
`qattn:r/16,sink:8`); `suffix:last` / `suffix:last:2`, `plain` and the oracles `gold` /
`gold-rest` as points at their own fraction, `ape:T,S` as points at 0; full attention as a dashed
line (and the 0.95x contains / 0.8 agreement bars of the issue's target).

    .venv/bin/python -m benchmarks.plot_recompute_curves results/quality/recompute_curves_synthetic.json \\
        results/quality/recompute_curves_synthetic10.json results/quality/recompute_curves_musique.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RULES = {
    "blend": "CacheBlend (oracle layer-1 key deviation)",
    "qattn": "question attention (layer 15)",
    "epicr": "EPIC heads",
    "qdoc": "whole documents by question attention",
}
PANELS = [
    ("contains", "gold in answer"),
    ("agreement", "agreement with full"),
    ("kl_mean", "first-token KL (mean)"),
]


def _lines(summary: dict) -> dict[str, list[str]]:
    """The budgeted configurations of the sequential layout, one line per rule: the mode with its
    budget left out (`qattn:0.1/16,sink:8` -> `qattn:r/16,sink:8`)."""
    lines: dict[str, list[str]] = {}
    for config in summary:
        layout, _, mode = config.partition("/")
        name, _, arg = mode.partition(":")
        if layout != "sequential" or name not in RULES:
            continue
        rest = arg.lstrip("0123456789.")
        label = f"{name}:r{rest}" if rest else RULES[name]
        lines.setdefault(label, []).append(config)
    return lines


def plot(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    summary = result["summary"]
    n = summary["full"]["n"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, label) in zip(axes, PANELS, strict=True):
        full = summary["full"][key]
        ax.axhline(full, color="black", ls="--", lw=1, label=f"full ({full:.2f})")
        if key == "contains":
            ax.axhline(0.95 * full, color="grey", ls=":", lw=1, label="0.95x full")
        if key == "agreement":
            ax.axhline(0.8, color="grey", ls=":", lw=1, label="0.8")
        for i, (rule, configs) in enumerate(_lines(summary).items()):
            points = sorted((summary[c]["doc_recompute_fraction"], summary[c][key]) for c in configs)
            plain = summary["sequential/plain"]
            points = [(0.0, plain[key]), *points]
            ax.plot(*zip(*points, strict=True), marker="o", color=f"C{i % 10}", label=rule)
        marks = [
            ("sequential/plain", "s", "C7", "plain"),
            ("overlap/plain", "x", "C7", "overlap plain"),
            ("sequential/suffix:last", "D", "C3", "last"),
            ("sequential/suffix:last:2", "D", "C4", "last:2"),
            ("overlap/qattn:0.2", "v", "C1", "overlap qattn:0.2"),
            ("sequential/gold", "P", "C8", "oracle: the answer's document"),
            ("sequential/gold-rest", "X", "C8", "oracle: every other document"),
        ]
        marks += [(c, "*", "C5", c.split("/")[1]) for c in summary if "/ape:" in c]
        for j, (config, marker, colour, name) in enumerate(marks):
            if config in summary:
                s = summary[config]
                ax.scatter(
                    [s["doc_recompute_fraction"]],
                    [s[key]],
                    marker=marker,
                    s=60,
                    color=colour,
                    alpha=1.0 - 0.25 * (j % 3) if marker == "*" else 1.0,
                    label=name,
                    zorder=3,
                )
        ax.set_xlabel("fraction of document tokens recomputed")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="upper right")
    data = result["settings"].get("data") or f"synthetic, {result['settings']['docs']} docs"
    fig.suptitle(f"{Path(path).stem}: {data}, {n} questions, {Path(result['model']).name}, HF fp32 eager")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.json:
        out = path.with_suffix(".png")
        plot(path, out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
