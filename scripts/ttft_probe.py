#!/usr/bin/env python3
"""Quick TTFT probe (until the full benchmark lands): one chunked RAG prompt, cold then warm.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/ttft_probe.py
    VLLM_ENABLE_CHUNK_CACHE=false VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/ttft_probe.py

bench-llama, 8 documents of ~512 tokens and a ~32-token question, prefix caching off; TTFT is
the wall time of `generate(max_tokens=1)`. Warm runs alternate the document order.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CHUNK_CACHE_SIZE_GB", "1")
    sys.path.insert(0, str(REPO / "tests"))
    import chunk_cases as cc
    from vllm import LLM, SamplingParams

    llm = LLM(str(REPO / ".models" / "bench-llama"), dtype="float32", max_model_len=8192, seed=0,
              enable_prefix_caching=False)
    docs = [cc.document(900 + i, 512) for i in range(8)]
    question = " ".join(["What do these documents say about the ferries and the tea houses?"] * 2)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(prompt: str) -> float:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    ttft("warm up the engine")
    cold = ttft(cc.chunked(cc.SYS, docs, question))
    warm = [ttft(cc.chunked(cc.SYS, docs[::-1] if i % 2 else docs, question)) for i in range(3)]
    print(json.dumps({"chunk_cache": os.environ.get("VLLM_ENABLE_CHUNK_CACHE", "true"),
                      "cold_s": round(cold, 3), "warm_s": [round(w, 3) for w in warm]}))


if __name__ == "__main__":
    main()
