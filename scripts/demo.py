#!/usr/bin/env python3
"""Demo: start the patched vLLM engine on the tiny model and answer a chunked RAG prompt.

    python scripts/demo.py [--model DIR]

The prompt has the Chunk Cache shape `SYSTEM # # DOC_1 # # DOC_2 # # QUESTION`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))

PROMPT = (
    "You are a helpful assistant. Answer from the documents. # # "
    "Document one: the tea house on the hill opens at seven and closes at noon. # # "
    "Document two: the ferry leaves the harbour every hour, except on Sundays. # # "
    "Question: when does the ferry leave?"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=MODELS / "tiny-llama")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV memory ...
    os.environ.setdefault("VLLM_CHUNK_CACHE_SIZE_GB", "0.5")  # ... of which the chunk pool takes this

    from vllm import LLM, SamplingParams

    import vllm_ascend_chunk

    t0 = time.perf_counter()
    llm = LLM(str(args.model), dtype="float32", max_model_len=4096, seed=0)
    print(f"\nengine ready in {time.perf_counter() - t0:.1f} s "
          f"(vllm_ascend_chunk {vllm_ascend_chunk.__version__})")
    reordered = " # # ".join([PROMPT.split(" # # ")[i] for i in (0, 2, 1, 3)])
    for label, prompt in (("cold", PROMPT), ("warm", PROMPT), ("reordered", reordered)):
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                           use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        print(f"{label:>9}: {len(out.prompt_token_ids)} prompt tokens, "
              f"{len(out.outputs[0].token_ids)} generated in {elapsed * 1000:.0f} ms: "
              f"{out.outputs[0].text!r}")
    print("(random weights: the text is noise. In the overlap layout every document sits at the same "
          "positions, so reordering them changes nothing but float summation order.)")


if __name__ == "__main__":
    main()
