"""`VLLM_ENABLE_CHUNK_CACHE=false`: a patched engine behaves exactly as unpatched vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=1024, seed=0)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen, add = [], scheduler.add_request
    scheduler.add_request = lambda r, *a, **k: (seen.append(r), add(r, *a, **k))[1]
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=1, temperature=0))
    print("RESULT", json.dumps({"ids": [o.prompt_token_ids for o in outs],
                                "info": [r.chunk_cache for r in seen]}))
"""


def test_switch_off_gives_unpatched_tokenization(models_dir: Path):
    from tokenizers import Tokenizer

    prompts = ["SYS # # doc one # # doc two # # question?", "An ordinary prompt."]
    env = {**os.environ, "VLLM_ENABLE_CHUNK_CACHE": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(models_dir / "tiny-llama"), json.dumps(prompts)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    raw = Tokenizer.from_file(str(models_dir / "tiny-llama" / "tokenizer.json"))
    assert result["ids"] == [raw.encode(p).ids for p in prompts]
    assert result["info"] == [None, None]
    assert "Chunk Cache disabled" in run.stdout + run.stderr
