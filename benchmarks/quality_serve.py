#!/usr/bin/env python3
"""Answer quality against warm TTFT through `vllm serve` (issue 35, item 5): one point per
recovery setting, at 5 and 10 documents, on a real model.

One server (chunk cache on, `sequential`, float32, greedy) answers every setting, so the settings
differ only in the request: per question, in this order,

1. `full`: the prompt's token ids as one ordinary prompt (no `chunk_spans`): full attention, its
   documents computed (SYSTEM from vLLM's prefix cache, as for every request);
2. a priming request (the same documents in reverse order, another question, 1 token, recovery
   off): every document computed into the pool;
3. each setting of `--modes`, the same ids with `chunk_spans` and `chunk_cache_recovery`: warm,
   every document in the pool.

Every request is streamed: TTFT is the client's, from sending to the first token event. Scores
(`benchmarks/quality_data.py`): the gold answer contained in the answer, and agreement with
`full`'s greedy answer (the same text). The JSON keeps every answer and TTFT; the PNG plots
contains and agreement against warm TTFT p50, one marker per setting, one colour per document
count.

    .venv/bin/python -m benchmarks.quality_serve --synthetic 40 --docs 5 10 \\
        --out results/quality/quality_serve_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks import quality_data as qd
from benchmarks.bench_quality import build_samples
from harness.serve_util import VllmServer, openai_client, portable

REPO = Path(__file__).resolve().parent.parent
MODES = ["none", "last:2", "qattn:0.1", "qattn:0.15", "qattn:0.2", "cover:0.7/0.2"]
SERVED = "smollm2"
COUNTERS = ["hits", "misses", "selections", "selected_tokens", "cover_fallbacks"]
"""The server's chunk-cache counters each set records (their change over the set)."""


def stream(client, ids: list[int], max_tokens: int, xargs: dict | None) -> dict:
    """One streamed completion of the token ids: TTFT (client side) and the answer."""
    start = time.perf_counter()
    ttft, text = None, []
    body = {"vllm_xargs": xargs} if xargs else None
    for chunk in client.completions.create(
        model=SERVED, prompt=ids, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body=body
    ):
        if chunk.choices:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            text.append(chunk.choices[0].text or "")
    return {"ttft_s": ttft, "text": "".join(text).strip()}


def run_set(server: VllmServer, tokenizer, docs: int, args) -> dict:
    """Every question of one document count: full, the priming request, then each mode."""
    items = qd.synthetic_set(args.synthetic, docs=docs, doc_tokens=args.doc_tokens, seed=args.seed)
    samples = build_samples(tokenizer, items, None)
    client = openai_client(server.url, timeout=600)
    before = server.metrics()
    # First-request costs out of the numbers: one ordinary request, discarded (the priming ids:
    # they share only SYSTEM with a measured prompt, which must not find its own in the prefix cache).
    stream(client, samples[0]["prime"]["ids"], 1, None)
    rows = []
    for n, (item, sample) in enumerate(zip(items, samples, strict=True)):
        measured, prime = sample["measured"], sample["prime"]
        row = {
            "qid": item.qid,
            "prompt_tokens": len(measured["ids"]),
            "full": stream(client, measured["ids"], args.max_tokens, None),
        }
        stream(client, prime["ids"], 1, {"chunk_spans": prime["spans"], "chunk_cache_recovery": "none"})
        for mode in args.modes:
            xargs = {"chunk_spans": measured["spans"], "chunk_cache_recovery": mode}
            row[mode] = stream(client, measured["ids"], args.max_tokens, xargs)
        for setting in ["full", *args.modes]:
            answer = row[setting]
            answer["contains"] = qd.best(qd.contains, answer["text"], item.answers)
            answer["agree"] = float(answer["text"] == row["full"]["text"])
        rows.append(row)
        print(
            f"[{docs} docs {n + 1}/{len(items)}] "
            + " ".join(
                f"{s}={row[s]['ttft_s'] * 1e3:.0f}ms/{int(row[s]['agree'])}" for s in ["full", *args.modes]
            ),
            flush=True,
        )
    time.sleep(1)  # the counters move with the engine step after a response
    counters = {
        name: server.metrics().get(f"vllm:chunk_cache_{name}_total", 0.0)
        - before.get(f"vllm:chunk_cache_{name}_total", 0.0)
        for name in COUNTERS
    }
    # The settings really ran on the chunk path: its documents were loaded, and the question-driven
    # modes recomputed what they chose.
    if counters["hits"] < len(rows) * docs:  # at least `none`: every document loaded
        raise SystemExit(
            f"{docs} docs: {counters['hits']:.0f} document hits, the settings did not load their documents"
        )
    if any(m.startswith(("qattn", "cover")) for m in args.modes) and not counters["selected_tokens"]:
        raise SystemExit(f"{docs} docs: no document token recomputed by qattn or cover")
    summary = {
        setting: {
            "contains": statistics.fmean(r[setting]["contains"] for r in rows),
            "agreement": statistics.fmean(r[setting]["agree"] for r in rows),
            "ttft_p50_ms": statistics.median(r[setting]["ttft_s"] for r in rows) * 1e3,
        }
        for setting in ["full", *args.modes]
    }
    return {"questions": len(rows), "counters": counters, "summary": summary, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = dict(zip(["full", *result["settings"]["modes"]], "s^vDoPX*", strict=False))
    for (docs, part), colour in zip(
        result["sets"].items(), ["tab:blue", "tab:orange", "tab:green"], strict=False
    ):
        for ax, key in zip(axes, ["contains", "agreement"], strict=True):
            for setting, s in part["summary"].items():
                ax.scatter(s["ttft_p50_ms"], s[key], marker=markers[setting], color=colour, s=60)
                ax.annotate(
                    setting, (s["ttft_p50_ms"], s[key]), fontsize=7, xytext=(4, 3), textcoords="offset points"
                )
            ax.scatter([], [], color=colour, label=f"{docs} documents ({part['questions']} questions)")
    for ax, title in zip(axes, ["gold in answer", "agreement with full attention"], strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("warm TTFT p50, ms (log)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{path.stem}: quality against warm TTFT through vllm serve, {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".models" / "smollm2-135m"))
    ap.add_argument("--synthetic", type=int, default=40, help="questions per document count")
    ap.add_argument("--docs", type=int, nargs="+", default=[5, 10])
    ap.add_argument("--doc-tokens", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--modes", nargs="+", default=MODES, help="chunk_cache_recovery values")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    result = {
        "command": portable(" ".join([Path(sys.executable).name, *sys.argv])),
        "model": portable(args.model),
        "machine": platform.platform(),
        "settings": {k: portable(v) if isinstance(v, (str, Path)) else v for k, v in vars(args).items()},
        "sets": {},
    }
    start = time.time()
    env = {
        "VLLM_ENABLE_CHUNK_CACHE": "1",
        "VLLM_CHUNK_CACHE_LAYOUT": "sequential",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    server_args = f"--served-model-name {SERVED} --dtype float32 --max-model-len 4096 --seed 0".split()
    with VllmServer(args.model, server_args, env=env) as server:
        for docs in args.docs:
            result["sets"][str(docs)] = run_set(server, tokenizer, docs, args)
            result["seconds"] = round(time.time() - start, 1)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for docs, part in result["sets"].items():
        for setting, s in part["summary"].items():
            print(
                f"{docs:>2} docs {setting:14s} contains {s['contains']:.2f} agreement {s['agreement']:.2f} "
                f"TTFT p50 {s['ttft_p50_ms']:.0f} ms"
            )
        print(f"{docs:>2} docs counters: " + ", ".join(f"{k} {v:.0f}" for k, v in part["counters"].items()))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
