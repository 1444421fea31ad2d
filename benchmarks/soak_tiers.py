#!/usr/bin/env python3
"""Tier soak: two `vllm serve` instances sharing a real Mooncake Store, under faults.

    python -m benchmarks.soak_tiers                     # 1,000 requests, ~10 min on 2 CPU cores
    python -m benchmarks.soak_tiers --requests 200      # a shorter run, same checks

Both instances serve the tiny Llama (float32) with a device pool of `--pool-pages` pages, a
host tier as large as the pool and the shared store; a Zipf stream of chunked prompts
(`--docs` documents of ~`--doc-tokens` tokens from a corpus `--corpus-factor` times what the
pool holds) goes to one instance or the other at random, `--concurrency` requests in flight, so
entries are evicted to host memory and out of it all the time and each instance reads what the
other wrote. Objects are stored in parts of `--part-kb` (`VLLM_CHUNK_CACHE_REMOTE_PART_MB`), so
each document's object has several. Faults, in the middle of the stream: the master is killed
and started again (its index, so every object, is lost) at 1/3; the store process is paused for
`--pause-s` at 1/2; the second part of about half of the objects is removed
(`remove_by_regex`), as Mooncake may evict one part alone, at 2/3.

Checked, and written to the JSON with the counts:
- every greedy answer equals the independent HF reference of the chunk semantics
  (`harness/hf_reference.py`, explicit 4D mask and positions): 0 differences expected;
- both engines still serve at the end (0 engine deaths);
- no pinned entries and no requests left once idle (0 leaked pins);
- per instance, device hits + host hits + remote hits + misses = the document occurrences sent
  (the counters add up), and the remote counters (reads, failures, errors, corrupt).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import rag_workload
from harness.machine import machine_info
from harness.mooncake_store import MooncakeProcs
from harness.serve_util import MODELS, VllmServer, openai_client, portable, tiny_serve_args
from harness.store_faults import FaultInjector, FaultSettings, fault_plan

NAME = "tiny-llama"
SYS = "You are a careful assistant. Answer from the documents."
COUNTERS = {
    "device": "vllm:chunk_cache_hits_total",
    "host": "vllm:chunk_cache_host_hits_total",
    "remote": "vllm:chunk_cache_remote_hits_total",
    "miss": "vllm:chunk_cache_misses_total",
}
REMOTE_COUNTERS = (
    "vllm:chunk_cache_remote_reads_total",
    "vllm:chunk_cache_remote_read_failures_total",
    "vllm:chunk_cache_remote_errors_total",
    "vllm:chunk_cache_remote_corrupt_total",
    "vllm:chunk_cache_remote_write_drops_total",
    "vllm:chunk_cache_host_evictions_total",
    "vllm:chunk_cache_evictions_total",
)
IDLE_GAUGES = ("vllm:chunk_cache_pinned_entries", "vllm:num_requests_running", "vllm:num_requests_waiting")


def token_bytes(model: Path) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4  # float32


def start_server(args, store: MooncakeProcs, log: Path) -> VllmServer:
    pool_gb = args.pool_pages * 16 * token_bytes(args.model) / 2**30
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CHUNK_CACHE_SIZE_GB": f"{pool_gb:.9f}",
        "VLLM_CHUNK_CACHE_HOST_GB": f"{pool_gb:.9f}",
        **store.server_env(timeout_s=2, part_mb=args.part_kb / 1024),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    }
    cli = tiny_serve_args(NAME)
    return VllmServer(args.model, cli, env=env, log_path=log).start()


def stream(args) -> list[tuple[str, list[int]]]:
    """(prompt, document ids) per request: a Zipf stream over the corpus, a new question each."""
    rng = random.Random(args.seed)
    reqs = rag_workload.zipf_stream(
        rng, args.requests, corpus_size=args.corpus, docs_per_request=(args.docs,), zipf_s=1.0
    )
    docs = {d: rag_workload.document(d, args.doc_tokens) for r in reqs for d in r.doc_ids}
    return [
        (
            rag_workload.chunked(SYS, [docs[d] for d in r.doc_ids], f"Question {i}: which one first?"),
            r.doc_ids,
        )
        for i, r in enumerate(reqs)
    ]


def references(args, prompts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    from harness import chunk_cases, hf_reference

    model = hf_reference.load(args.model)
    raw_tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    return [chunk_cases.reference(model, raw_tok, p, args.max_tokens)[1].tokens for p in prompts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "tiny-llama")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--docs", type=int, default=3, help="documents per request")
    ap.add_argument("--doc-tokens", type=int, default=60)
    ap.add_argument(
        "--pool-pages", type=int, default=32, help="device pool (16-token pages); host tier the same"
    )
    ap.add_argument("--corpus-factor", type=float, default=4.0, help="corpus size / what the pool holds")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--pause-s", type=float, default=4.0)
    ap.add_argument("--part-kb", type=float, default=24.0, help="remote object part size (KiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/tiers/soak_tiers_cpu.json"))
    args = ap.parse_args()
    pages_per_doc = -(-int(args.doc_tokens * 1.2) // 16)  # ~3 characters per token, some slack
    args.corpus = max(args.docs + 1, round(args.corpus_factor * args.pool_pages / pages_per_doc))

    requests = stream(args)
    print(f"soak: {len(requests)} requests over {args.corpus} documents; references ...", flush=True)
    expected = references(args, [p for p, _ in requests])
    log_dir = Path(tempfile.mkdtemp(prefix="soak-tiers-"))
    store = MooncakeProcs(log_dir).start()
    servers = [start_server(args, store, log_dir / f"server-{x}.log") for x in "ab"]
    clients = [openai_client(s.url, timeout=120) for s in servers]
    rng = random.Random(args.seed + 1)
    target = [rng.randrange(2) for _ in requests]
    sent = [0, 0]  # document occurrences per server
    results: list[dict | None] = [None] * len(requests)
    answered = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        prompt, doc_ids = requests[i]
        s = target[i]
        try:
            resp = clients[s].completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            tokens = list(resp.choices[0].token_ids or [])
            results[i] = {"server": s, "tokens": tokens, "ok": tokens == expected[i]}
        except Exception as err:  # counted: an error answer is a failure of the soak
            results[i] = {"server": s, "error": f"{type(err).__name__}: {err}"[:300], "ok": False}
        with lock:
            sent[s] += len(doc_ids)
            answered[0] += 1

    n = len(requests)
    plan = fault_plan(n, {"master": 1 / 3, "pause": 1 / 2, "parts": 2 / 3})
    settings = FaultSettings(pause_s=args.pause_s)
    start = time.perf_counter()
    injector = FaultInjector(
        store, plan, lambda: answered[0], settings, log=lambda m: print(f"soak: {m}", flush=True)
    )
    with injector, ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(n)))
    faults = injector.records
    wall = time.perf_counter() - start
    time.sleep(2.0)  # counters follow engine steps
    report_servers = []
    for s, server in enumerate(servers):
        alive = server.proc is not None and server.proc.poll() is None
        m = server.metrics() if alive else {}
        occurrences = {t: m.get(c, 0.0) for t, c in COUNTERS.items()}
        report_servers.append(
            {
                "alive": alive,
                "occurrences": occurrences,
                "documents_sent": sent[s],
                "counters_add_up": sum(occurrences.values()) == sent[s],
                "remote": {c.removeprefix("vllm:chunk_cache_"): m.get(c) for c in REMOTE_COUNTERS},
                "idle": {g: m.get(g) for g in IDLE_GAUGES},
            }
        )
    for server in servers:
        server.stop()
    store.stop()

    wrong = [i for i, r in enumerate(results) if not (r and r["ok"])]
    report = {
        "command": portable(
            " ".join([Path(sys.executable).name, "-m", "benchmarks.soak_tiers", *sys.argv[1:]])
        ),
        "settings": {k: portable(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
        "wall_s": wall,
        "faults": faults,
        "parts_removed": next((f["parts_removed"] for f in faults if f["kind"] == "parts"), None),
        "answers": {
            "requests": n,
            "different_or_failed": len(wrong),
            "first": [results[i] for i in wrong[:10]],
        },
        "servers": report_servers,
        "pass": {
            "answers_equal_reference": not wrong,
            "no_engine_death": all(s["alive"] for s in report_servers),
            "no_leaked_pins": all(
                s["idle"]["vllm:chunk_cache_pinned_entries"] == 0
                and s["idle"]["vllm:num_requests_running"] == 0
                and s["idle"]["vllm:num_requests_waiting"] == 0
                for s in report_servers
            ),
            "counters_add_up": all(s["counters_add_up"] for s in report_servers),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"wall_s": round(wall), "faults": faults, "pass": report["pass"]}, indent=1))
    for s in report_servers:
        print(f"  {s['occurrences']} sent {s['documents_sent']} remote {s['remote']}")
    print(f"wrote {args.out}")
    return 0 if all(report["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
