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


def run_script(script: str, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -c script args...` in its own process; its `RESULT {json}` line, parsed."""
    run = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(run.stdout.split("RESULT ", 1)[1])


def test_switch_off_gives_unpatched_tokenization(models_dir: Path):
    from tokenizers import Tokenizer

    prompts = ["SYS # # doc one # # doc two # # question?", "An ordinary prompt."]
    env = {**os.environ, "VLLM_ENABLE_CHUNK_CACHE": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run, result = run_script(SCRIPT, env, str(models_dir / "tiny-llama"), json.dumps(prompts))
    raw = Tokenizer.from_file(str(models_dir / "tiny-llama" / "tokenizer.json"))
    assert result["ids"] == [raw.encode(p).ids for p in prompts]
    assert result["info"] == [None, None]
    assert "Chunk Cache disabled" in run.stdout + run.stderr


TWO_ENGINES = """
import gc, json, sys
from vllm import LLM, SamplingParams

def recorded(llm):
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen, add = [], scheduler.add_request
    scheduler.add_request = lambda r, *a, **k: (seen.append(r), add(r, *a, **k))[1]
    return seen

if __name__ == "__main__":
    model, prompt, spans = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    pooling = LLM(model, runner="pooling", dtype="float32", max_model_len=1024, seed=0)
    seen = recorded(pooling)
    outs = pooling.embed([prompt, spans], use_tqdm=False)
    result = {"pooling_ids": [o.prompt_token_ids for o in outs],
              "pooling_info": [getattr(r.chunk_cache, "chunk_lens", None) for r in seen]}
    del pooling, seen
    gc.collect()
    llm = LLM(model, dtype="float32", max_model_len=1024, seed=0)
    seen = recorded(llm)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    result |= {"generate_ids": out.prompt_token_ids, "generate_info": seen[0].chunk_cache.chunk_lens}
    print("RESULT", json.dumps(result))
"""


def test_engine_it_does_not_apply_to_leaves_the_next_engine_chunking(models_dir: Path):
    """The chunk cache is on or off per engine, in the frontend too: a pooling engine (not
    applicable) tokenizes `# #` as text and drops explicit spans; a generative engine started
    after it in the same process still chunks."""
    from tokenizers import Tokenizer

    from harness import chunk_cases as cc

    prompt = "SYS # # doc one # # doc two # # question?"
    raw = Tokenizer.from_file(str(models_dir / "tiny-llama" / "tokenizer.json"))
    exp = cc.expected_structure(raw, prompt)
    spans = {
        "prompt_token_ids": exp.token_ids,
        "chunk_spans": {"sys_len": exp.sys_len, "chunk_lens": exp.chunk_lens},
    }
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run, result = run_script(TWO_ENGINES, env, str(models_dir / "tiny-llama"), prompt, json.dumps(spans))
    assert "Chunk Cache is off for this engine: runner type 'pooling'" in run.stdout + run.stderr
    assert result["pooling_ids"] == [raw.encode(prompt).ids, exp.token_ids]
    assert result["pooling_info"] == [None, None]
    assert result["generate_ids"] == exp.token_ids
    assert result["generate_info"] == exp.chunk_lens
