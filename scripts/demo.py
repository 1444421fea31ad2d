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
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    import vllm_ascend_chunk

    t0 = time.perf_counter()
    llm = LLM(str(args.model), dtype="float32", max_model_len=4096, seed=0)
    print(f"\nengine ready in {time.perf_counter() - t0:.1f} s "
          f"(vllm_ascend_chunk {vllm_ascend_chunk.__version__})")
    t0 = time.perf_counter()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))[0]
    elapsed = time.perf_counter() - t0
    print(f"prompt:  {PROMPT!r}")
    print(f"tokens:  {len(out.prompt_token_ids)} prompt, {len(out.outputs[0].token_ids)} generated "
          f"in {elapsed * 1000:.0f} ms")
    print(f"answer:  {out.outputs[0].text!r}  (random weights: the text is noise)")


if __name__ == "__main__":
    main()
