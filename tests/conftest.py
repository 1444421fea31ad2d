"""Shared fixtures. Engines are session-scoped: one start costs ~40 s on a 2-core CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))

# The CPU backend reserves this many GiB for the paged KV cache; keep engines small.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The tiny models, generated if missing (scripts/setup_env.sh normally made them)."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_models.py"), "--out", str(MODELS)],
                   check=True, capture_output=True)
    return MODELS


@pytest.fixture(scope="session")
def tiny_llama_llm(models_dir: Path):
    """A real patched vLLM engine on the tiny Llama model (float32, greedy-friendly)."""
    from vllm import LLM

    llm = LLM(str(models_dir / "tiny-llama"), dtype="float32", max_model_len=4096, seed=0)
    yield llm
    del llm
