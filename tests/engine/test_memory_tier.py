"""A third tier backend inside a real engine: the test-only memory tier (`tests/helpers/memory_tier/`),
registered by one line and built by the package's factory on the scheduler's and the worker's
side, with nothing of it in the package. A pool far smaller than the documents: evicted entries
are kept by the memory tier and filled back across steps (`Fill.LATER`) instead of computed.
Answers are checked against the independent HF reference."""

from __future__ import annotations

from pathlib import Path

from tests.engine.test_chunk_engines import SMALL
from tests.engine.test_host_tier import POOL_PAGES, check_corpus_rounds, corpus_rounds
from tests.helpers.engine_runner import run_engine


def test_a_registered_backend_serves_evicted_documents_in_an_engine(models_dir: Path):
    rounds = corpus_rounds(500)
    result = run_engine(models_dir / "tiny-llama", rounds, env=SMALL, memory_tier=True)
    check_corpus_rounds(models_dir, rounds, result, "the memory tier")

    cold, warm, batched = result["states"]
    assert cold["misses"] == 12 and cold["evictions"] > 0 and cold["memory_entries"] > 0
    # Only the last set's documents can still be in the pool: the others come from the memory
    # tier, none of them computed again (a chunk prefill per document computed, SYS included).
    assert warm["misses"] == 12 and warm["chunk_prefills"] == cold["chunk_prefills"]
    assert batched["misses"] == 12 and batched["chunk_prefills"] == cold["chunk_prefills"]
    for state in result["states"]:
        assert state["pinned_entries"] == 0 and state["pending_entries"] == 0
        assert state["used_pages"] == state["entry_pages"] <= POOL_PAGES
