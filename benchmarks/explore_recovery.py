#!/usr/bin/env python3
"""Which recovery mode wins answers back? Candidate modes measured with HF transformers.

Runs the HF forms of `harness/hf_recovery.py` (the chunk layouts and candidate recovery modes as
explicit load/compute plans; fp32, eager attention) on a real model and a question set, and
reports per configuration (layout x mode): agreement with full attention (identical greedy
answer), the exact KL divergence of the first answer token's distribution from full attention's
(whole vocabulary), F1 / exact match / gold-contained against the gold answers, and the warm
recompute fraction (prompt tokens computed / prompt tokens, when every document is cached).

    .venv/bin/python -m benchmarks.explore_recovery --synthetic 40 --docs 5 --doc-tokens 150 \\
        --max-tokens 20 --out results/quality/recovery_hf_synthetic.json
    .venv/bin/python -m benchmarks.explore_recovery --data musique_s.json --limit 12 \\
        --docs 4 --doc-tokens 256 --max-tokens 20 --configs overlap/plain sequential/plain \\
        sequential/suffix:last sequential/epic:8 sequential/epic:32 sequential/defer-epic:32 \\
        sequential/defer-blend:0.15 --out results/quality/recovery_hf_musique.json

`--configs` takes `layout/mode` (modes: `harness/hf_recovery.py`); the word `curves` stands for
`CURVE_CONFIGS` (issue 25: each budgeted selection rule at 5-30 % of the document tokens, APE-like
scaling, `last`, `last:2`). Plans run in one masked forward (`run(..., one_pass=True)`, equal to
the run-by-run loop). The JSON is rewritten after every question. Curves of its summary:
`benchmarks/plot_recompute_curves.py`. `selection` stands for `SELECTION_CONFIGS` (issue 35: the
engine's `qattn:r/16` against candidate selection rules, at 5-20 %); `selection-wide` adds more
rules, `two-stage` puts `qattn:r/16,two-stage` beside `qattn:r/16`, `documents` computes whole
documents (`DOCUMENT_CONFIGS`).

    .venv/bin/python -m benchmarks.explore_recovery --synthetic 40 --docs 5 --doc-tokens 150 \
        --max-tokens 20 --configs curves --out results/quality/recompute_curves_synthetic.json

A run split over processes (`--shard K/N`: every N-th question from the K-th; `--resume` skips
the questions an earlier run of the same `--out` finished), on a GPU (`--device cuda`: the same
fp32 plans, eager attention, TF32 off), merged into one JSON with its summary recomputed:

    .venv/bin/python -m benchmarks.explore_recovery --synthetic 40 --docs 10 --doc-tokens 150 \
        --configs selection --device cuda --shard 0/4 --out s10_0.json     # ... 1/4, 2/4, 3/4
    .venv/bin/python -m benchmarks.explore_recovery --merge s10_*.json --out merged.json

`--skip-done FILE...` leaves out the questions that earlier results of the same configurations
hold (a later loan goes on where an earlier one stopped; merge both).

Prompts, question sets and scores: `benchmarks/quality_data.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from benchmarks import quality_data as qd
from harness.serve_util import portable

REPO = Path(__file__).resolve().parent.parent

DEFAULT_CONFIGS = [
    "overlap/plain",
    "sequential/plain",
    "overlap/suffix:64",
    "overlap/suffix:last",
    "sequential/suffix:16",
    "sequential/suffix:64",
    "sequential/suffix:last",
    "sequential/epic:8",
    "sequential/epic:32",
]
"""`blend:r` (e.g. `sequential/blend:0.15`) is available too (one masked forward, as every plan)."""

BUDGETS = [0.05, 0.1, 0.15, 0.2, 0.3]
APE_SETTINGS = ["0.9,0.9", "0.7,0.8", "0.5,1.0"]
CURVE_CONFIGS = [
    "overlap/plain",
    "sequential/plain",
    "sequential/suffix:last",
    "sequential/suffix:last:2",
    *[f"sequential/{rule}:{r}" for rule in ("blend", "qattn", "epicr") for r in BUDGETS],
    *[f"sequential/ape:{ts}" for ts in APE_SETTINGS],
    "overlap/qattn:0.2",
]
CURVE_CONFIGS_SHORT = [
    "overlap/plain",
    "sequential/plain",
    "sequential/suffix:last",
    "sequential/suffix:last:2",
    *[f"sequential/{rule}:{r}" for rule in ("blend", "qattn", "epicr") for r in (0.1, 0.2)],
    "sequential/ape:0.9,0.9",
]
SELECTION_BUDGETS = [0.05, 0.1, 0.15, 0.2]
SELECTION_RULES = [
    "qattn:{r}/16",
    "qattn:{r}/16@8+15+22",
    "qattn:{r}/16,sink:8",
    "qattn:{r}/16,floor",
    "qattn:{r}/16,grow",
    "qattn:{r}/16@8+15+22,sink:8,floor",
]
SELECTION_CONFIGS = [
    "sequential/plain",
    *[f"sequential/{rule.format(r=r)}" for rule in SELECTION_RULES for r in SELECTION_BUDGETS],
]
"""Issue 35, item 1 (`selection`): the engine's `qattn:r/16` against candidate selection rules at
5-20 % of the document tokens, their parameters fixed before any run: the scores summed over
layers 8, 15 and 22 of 30; the first 8 tokens of every document but the first always computed;
every document's best window first; windows grown by score mass; the first three together.
"""
WIDE_RULES = [
    "qattn:{r}/16@15+22",
    "qattn:{r}/16@15+19+23+27",
    "qattn:{r}/16,sink:4",
]
SELECTION_WIDE_CONFIGS = [
    *SELECTION_CONFIGS,
    "sequential/suffix:last:2",
    *[f"sequential/{rule.format(r=r)}" for rule in WIDE_RULES for r in SELECTION_BUDGETS],
    *[f"sequential/cover:{t}/0.2" for t in (0.6, 0.65, 0.7)],
]
"""`selection-wide` (issue 35, items 1 and 2, the GPU run): `selection`, `last:2`, and the rules the
CPU run left out, fixed before any run: layers without an early one (15 + 22; 15, 19, 23 and 27,
middle to late), sink repair with 4 tokens; `cover` at three targets under a 20 % ceiling."""
"""Issue 25's sweep: `blend:r` (CacheBlend, oracle check layer), `qattn:r` (the question's
attention at the middle layer), `epicr:r` (EPIC heads sized to the budget), `ape:T,S`;
`curves-short` (`CURVE_CONFIGS_SHORT`): the budgets 10 and 20 % only, for long prompts."""


DOCUMENT_CONFIGS = [
    "sequential/plain",
    "sequential/gold",
    "sequential/gold-rest",
    "sequential/qdoc:1",
    "sequential/qdoc:2",
]
"""`documents` (issue 35, item 1): whole documents computed, chosen by the question's attention
(`qdoc:k`); and two oracles: the one that holds the answer (`gold`: does choosing the right
document win the answer back?), every other one (`gold-rest`: or do the other documents' cached KV
lose it?)."""


TWO_STAGE_CONFIGS = [
    "sequential/plain",
    *[f"sequential/qattn:{r}/16{rule}" for rule in ("", ",two-stage") for r in SELECTION_BUDGETS],
]
"""`two-stage` (issue 35, item 1, the rule ProphetKV's selection suggested): the engine's
`qattn:r/16` and its windows chosen in two stages (the better half, then the rest by the question
scored again over the partly recomputed cache), at 5-20 % of the document tokens."""


COVERAGE_BUCKETS = [0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
"""Lower bounds of the coverage buckets of `by_coverage` (the last one holds coverage 1 only)."""


def gold_mode(mode: str, item: qd.QAItem) -> str:
    """Oracles (synthetic set only): `gold`, the chunk that holds the answer computed whole;
    `gold-rest`, every chunk but that one computed whole."""
    if mode not in ("gold", "gold-rest"):
        return mode
    if "needle_doc" not in item.meta:
        raise SystemExit(f"{mode} needs a synthetic question (the index of the document with the answer)")
    needle = item.meta["needle_doc"]
    chosen = [needle] if mode == "gold" else [i for i in range(len(item.docs)) if i != needle]
    return "plain" if not chosen else "chunks:" + "+".join(map(str, chosen))


def ceiling_coverage(mode: str, attention, chunk_lens: list[int]) -> tuple[float, bool] | None:
    """A `qattn:r/m` or `cover:...` mode's coverage (`hr.cover_choice`: C_1's and the computed
    windows' share of the question's attention over the documents; `qattn:r/16`'s windows are
    `cover:1/r`'s at the ceiling) and whether `cover` falls back; None for other modes."""
    from harness import hf_recovery as hr

    name, _, arg = mode.partition(":")
    if name == "qattn" and arg.endswith("/16") and "@" not in arg and "," not in arg:
        return hr.cover_choice(attention, chunk_lens, f"1/{arg.partition('/')[0]}")[1], False
    if name == "cover":
        return hr.cover_choice(attention, chunk_lens, arg)[1:]
    return None


def by_coverage(rows: list[dict]) -> list[dict]:
    """Agreement with full attention and gold-in-answer per coverage bucket (`COVERAGE_BUCKETS`)."""
    table = []
    for lo, hi in zip(COVERAGE_BUCKETS, [*COVERAGE_BUCKETS[1:], 1.0 + 1e-9], strict=True):
        inside = [r for r in rows if lo <= r["coverage"] < hi]
        table.append(
            {
                "coverage": [lo, hi if hi <= 1 else 1.0],
                "n": len(inside),
                "agreement": statistics.fmean(r["agree"] for r in inside) if inside else None,
                "contains": statistics.fmean(r["contains"] for r in inside) if inside else None,
            }
        )
    return table


def summarize(rows: list[dict]) -> dict:
    def mean(key):
        return statistics.fmean(r[key] for r in rows) if rows else None

    kls = [r["kl"] for r in rows]
    return {
        "n": len(rows),
        "f1": mean("f1"),
        "em": mean("em"),
        "contains": mean("contains"),
        "agreement": mean("agree"),
        "kl_mean": mean("kl"),
        "kl_median": statistics.median(kls) if kls else None,
        "recompute_fraction": mean("recompute"),
        "doc_recompute_fraction": mean("doc_recompute"),
        **(
            {"fallback_rate": mean("fallback"), "by_coverage": by_coverage(rows)}
            if rows and "coverage" in rows[0]
            else {}
        ),
    }


def settings_of(args) -> dict:
    """The run's arguments as JSON values, paths (alone or in lists, as `--skip-done`'s) portable."""

    def value(v):
        if isinstance(v, list):
            return [value(x) for x in v]
        return portable(v) if isinstance(v, (str, Path)) else v

    return {k: value(v) for k, v in vars(args).items() if k not in ("device_name", "merge")}


def write(args, samples: list[dict], start: float, torch_version: str, seconds: float = 0.0) -> dict:
    """Write the JSON (after every sample, so a long run can be read while it goes on).

    `seconds`: time spent by the earlier run that `--resume` continues."""
    configs = ["full", *args.configs]
    summary = {c: summarize([s["configs"][c] for s in samples]) for c in configs}
    result = {
        "command": portable(" ".join(sys.argv)),
        "model": portable(args.model),
        "machine": platform.platform(),
        "device": args.device_name,
        "torch": torch_version,
        "seconds": round(seconds + time.time() - start, 1),
        "settings": settings_of(args),
        "summary": summary,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return summary


def shard_of(items: list, shard: str | None) -> list:
    """`K/N`: every N-th item from the K-th (None: all of them)."""
    if not shard:
        return items
    k, n = (int(x) for x in shard.split("/"))
    if not 0 <= k < n:
        raise SystemExit(f"--shard {shard!r}: K/N with 0 <= K < N")
    return items[k::n]


def questions_done(paths: list[Path], configs: list[str]) -> set[int]:
    """The question indices that these results (of the same configurations) hold."""
    done: set[int] = set()
    for path in paths:
        run = json.loads(path.read_text())
        if run["settings"]["configs"] != configs:
            raise SystemExit(f"--skip-done {path}: other configurations than this run's")
        done.update(sample["index"] for sample in run["samples"])
    return done


def merge(paths: list[Path], out: Path) -> dict:
    """One result from runs over disjoint questions (shards, or `--start` ranges) of one set, with
    the same configurations: samples in question order, the summary recomputed."""
    runs = [json.loads(path.read_text()) for path in paths]
    configs = runs[0]["settings"]["configs"]
    for path, run in zip(paths, runs, strict=True):
        if run["settings"]["configs"] != configs:
            raise SystemExit(f"{path}: other configurations than {paths[0]}")
    samples = {}
    for run in runs:
        for sample in run["samples"]:
            samples.setdefault(sample.get("index", sample["qid"]), sample)
    ordered = [samples[key] for key in sorted(samples)]
    settings = {k: v for k, v in runs[0]["settings"].items() if k not in ("shard", "resume", "out")}
    result = {
        "command": " ; ".join(run["command"] for run in runs),
        "model": runs[0]["model"],
        "machine": _each(runs, "machine"),
        "device": _each(runs, "device"),
        "torch": _each(runs, "torch"),
        "seconds": max(run["seconds"] for run in runs),
        "seconds_all_processes": round(sum(run["seconds"] for run in runs), 1),
        "settings": {**settings, "out": portable(out), "merged": [portable(path) for path in paths]},
        "summary": {c: summarize([s["configs"][c] for s in ordered]) for c in ["full", *configs]},
        "samples": ordered,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"merged {len(paths)} runs, {len(ordered)} questions: wrote {out}")
    return result


def _each(runs: list[dict], key: str) -> str | None:
    """`key` of the runs, each value once (a set finished on another machine names both)."""
    values = list(dict.fromkeys(run[key] for run in runs if run.get(key) is not None))
    return " + ".join(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".models" / "smollm2-135m"))
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic questions")
    ap.add_argument("--data", help="musique_s.json")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--start", type=int, default=0, help="skip the first START questions (a run split over processes)"
    )
    ap.add_argument("--shard", help="K/N: every N-th question from the K-th (a run split over processes)")
    ap.add_argument("--resume", action="store_true", help="keep the questions --out has, run the rest")
    ap.add_argument(
        "--skip-done",
        nargs="+",
        type=Path,
        default=[],
        help="results of the same configurations (an earlier loan's, merged): skip their questions",
    )
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument(
        "--configs", nargs="+", default=DEFAULT_CONFIGS, help="layout/mode, e.g. sequential/suffix:64"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine, more threads spin, 5-10x slower)",
    )
    ap.add_argument("--device", default="cpu", help="torch device of the model and the plans (cuda: a GPU)")
    ap.add_argument("--merge", nargs="+", type=Path, help="merge these result files into --out, and stop")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    presets = {
        "curves": CURVE_CONFIGS,
        "curves-short": CURVE_CONFIGS_SHORT,
        "selection": SELECTION_CONFIGS,
        "selection-wide": SELECTION_WIDE_CONFIGS,
        "two-stage": TWO_STAGE_CONFIGS,
        "documents": DOCUMENT_CONFIGS,
    }
    args.configs = [c for config in args.configs for c in presets.get(config, [config])]

    if args.data:
        items = qd.musique_set(args.data, limit=args.limit, docs=args.docs)
        cut = args.doc_tokens
    else:
        items = qd.synthetic_set(args.synthetic, docs=args.docs, doc_tokens=args.doc_tokens, seed=args.seed)
        items = items[: args.limit] if args.limit else items
        cut = None
    done_before = questions_done(args.skip_done, args.configs)
    todo = [(i, item) for i, item in list(enumerate(items))[args.start :] if i not in done_before]
    indexed = shard_of(todo, args.shard)
    samples, seconds = [], 0.0
    if args.resume and args.out.is_file():
        earlier = json.loads(args.out.read_text())
        if earlier["settings"]["configs"] != args.configs:
            raise SystemExit(f"--resume: {args.out} has other configurations")
        samples, seconds = earlier["samples"], earlier["seconds"]
        done = {s["index"] for s in samples}
        indexed = [(i, item) for i, item in indexed if i not in done]
        print(f"resume: {len(done)} questions in {args.out}, {len(indexed)} to run", flush=True)
    if not indexed:  # e.g. a shard of a set that earlier loans finished: no model, no file
        print(f"no question left to run for {args.out}", flush=True)
        return

    import torch
    from transformers import AutoTokenizer

    from harness import hf_recovery as hr
    from harness.hf_reference import load

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = load(args.model).to(args.device)
    # fp32 plans on a GPU too: no TF32, every new tensor of the plans on the model's device.
    torch.set_float32_matmul_precision("highest")
    torch.set_default_device(args.device)
    args.device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    eos = tok.eos_token_id
    start = time.time()
    for n, (index, item) in enumerate(indexed):
        p = qd.build_prompt(tok, item, doc_tokens=cut)
        full, full_keys = hr.run_full(model, p.ids, args.max_tokens, eos)
        kv = hr.chunk_kv(model, p.ids, p.sys_len, p.chunk_lens)
        full_text = tok.decode(full.tokens, skip_special_tokens=True).strip()
        text = {} if args.data else {"question": item.question, "answers": item.answers}  # no MuSiQue text
        sample = {
            "qid": item.qid,
            "index": index,
            **text,
            "prompt_tokens": len(p.ids),
            "sys_len": p.sys_len,
            "chunk_lens": p.chunk_lens,
            "configs": {
                "full": {
                    "answer": full_text,
                    "tokens": full.tokens,
                    "kl": 0.0,
                    "agree": 1.0,
                    "recompute": 1.0,
                    "doc_recompute": 1.0,
                }
            },
        }
        deviation, attention = {}, {}
        for config in args.configs:
            layout, mode = config.split("/", 1)
            mode = gold_mode(mode, item)
            if "blend" in mode and layout not in deviation:
                deviation[layout] = hr.key_deviation(model, kv, full_keys, p.sys_len, p.chunk_lens, layout)
            layer = hr.qattn_layer(model, mode)
            drop_last = "/" in mode or mode.startswith("cover") or "qdoc" in mode  # as the engine scores
            scored = any(rule in mode for rule in ("qattn", "cover", "qdoc"))
            if scored and (layout, layer, drop_last) not in attention:
                attention[layout, layer, drop_last] = hr.question_attention(
                    model, p.ids, p.sys_len, p.chunk_lens, layout, kv, layer, drop_last
                )
            # `,two-stage`: the same scores over the cache with `compute` (its one argument) computed
            rescore = partial(
                hr.question_attention, model, p.ids, p.sys_len, p.chunk_lens, layout, kv, layer, drop_last
            )
            compute = hr.recompute_set(
                mode,
                p.sys_len,
                p.chunk_lens,
                deviation.get(layout),
                attention.get((layout, layer, drop_last)),
                rescore,
            )
            out = hr.run(
                model,
                p.ids,
                p.sys_len,
                p.chunk_lens,
                layout,
                compute,
                kv,
                args.max_tokens,
                eos,
                defer=mode.startswith("defer-"),
                one_pass=True,
                ape=hr.ape_setting(mode),
            )
            sample["configs"][config] = {
                "answer": tok.decode(out.tokens, skip_special_tokens=True).strip(),
                "tokens": out.tokens,
                "kl": hr.kl(full.first_logprobs, out.first_logprobs),
                "agree": float(out.tokens == full.tokens),
                "recompute": out.computed / len(p.ids),
                "doc_recompute": len(compute) / sum(p.chunk_lens),
            }
            covered = ceiling_coverage(mode, attention.get((layout, layer, drop_last)), p.chunk_lens)
            if covered is not None:
                sample["configs"][config].update(coverage=covered[0], fallback=float(covered[1]))
        for row in sample["configs"].values():
            row["f1"] = qd.best(qd.f1, row["answer"], item.answers)
            row["em"] = qd.best(qd.exact_match, row["answer"], item.answers)
            row["contains"] = qd.best(qd.contains, row["answer"], item.answers)
        samples.append(sample)
        write(args, samples, start, torch.__version__, seconds)
        agree = " ".join(
            f"{c[:3]}/{c.partition('/')[2]}={int(sample['configs'][c]['agree'])}" for c in args.configs
        )
        print(
            f"[{n + 1}/{len(indexed)}] {time.time() - start:.0f}s gold={item.answers[0]!r} "
            f"full={full_text!r} "
            f"{agree}",
            flush=True,
        )
    configs = ["full", *args.configs]
    summary = write(args, samples, start, torch.__version__, seconds)
    print(
        f"{'config':28s} {'n':>4s} {'agree':>6s} {'KL mean':>8s} {'KL med':>7s} {'F1':>6s} {'EM':>6s} "
        f"{'contains':>8s} {'recompute':>9s}"
    )
    for c in configs:
        s = summary[c]
        print(
            f"{c:28s} {s['n']:4d} {s['agreement']:6.3f} {s['kl_mean']:8.4f} {s['kl_median']:7.4f} "
            f"{s['f1']:6.3f} "
            f"{s['em']:6.3f} {s['contains']:8.3f} {s['recompute_fraction']:9.3f}"
        )
    for c in configs:
        for row in summary[c].get("by_coverage", []):
            lo, hi = row["coverage"]
            agree = "-" if row["agreement"] is None else f"{row['agreement']:.2f}"
            print(f"{c:28s} coverage [{lo:.1f}, {hi:.1f}) n={row['n']:3d} agree={agree}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
