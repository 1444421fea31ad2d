"""Data parallelism with a shared store (issue 29): `vllm serve --data-parallel-size 2` whose two
engine cores, each with its own pool, share documents through a real Mooncake Store. Documents
computed by one engine are read by the other instead of computed again; a concurrent Zipf stream
is answered as the independent HF reference answers, and the counters add up."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import chunk_cases as cc
from harness.mooncake_store import MooncakeProcs, wait_for
from harness.serve_util import scrape
from tests.engine.test_model_parallel import BIND, needs_two_cores
from tests.helpers import server_utils
from tests.store.test_parallel_tiers import objects
from tests.store.test_shared_engines import remote_env

MAX_TOKENS = 6
pytestmark = needs_two_cores


def zipf_stream(docs: list[str], n: int, seed: int = 0) -> list[str]:
    """`n` prompts of two distinct documents each, drawn with Zipf weights (1/rank)."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(docs))]
    prompts = []
    for i in range(n):
        first = rng.choices(range(len(docs)), weights)[0]
        second = rng.choices(
            [d for d in range(len(docs)) if d != first], [w for d, w in enumerate(weights) if d != first]
        )[0]
        prompts.append(cc.chunked(cc.SYS, [docs[first], docs[second]], f"Zipf {i}?"))
    return prompts


def test_dp2_engines_share_documents_through_the_store(
    mooncake: MooncakeProcs, models_dir: Path, tmp_path: Path
):
    docs = [cc.document(960 + i, 50) for i in range(6)]
    warm = [cc.chunked(cc.SYS, [doc], f"Warm {i}?") for i, doc in enumerate(docs)]
    stream = zipf_stream(docs, 24)
    env = {**BIND, "VLLM_CPU_KVCACHE_SPACE": "1", **remote_env(mooncake), **server_utils.OWN_PROCESS}
    args = ["--data-parallel-size", "2"]
    with server_utils.vllm_server(models_dir / "tiny-llama", tmp_path / "serve.log", env, args) as url:
        client = server_utils.client(url)
        answers = []
        for i, prompt in enumerate(warm):
            answers.append(server_utils.greedy(client, prompt, MAX_TOKENS))
            # Writes are asynchronous: the next request may go to the other engine before this
            # one's objects land, and would then compute them again (correctly, but not what this
            # test is about).
            wait_for(
                lambda i=i: len(objects(mooncake)) == 2 + i, 30, f"SYS and documents 0..{i} in the store"
            )
        computed = server_utils.wait_metrics(url, lambda m: m.chunk_prefills >= len(docs), 30).chunk_prefills
        with ThreadPoolExecutor(6) as pool:
            answers += pool.map(lambda p: server_utils.greedy(client, p, MAX_TOKENS), stream)
        occurrences = len(warm) + 2 * len(stream)
        m = server_utils.wait_metrics(
            url, lambda m: m.hit_count + m.miss_count + m.remote_hits >= occurrences, 30
        )
        text = scrape(url)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    for prompt, choice in zip(warm + stream, answers, strict=True):
        exp, ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS)
        assert choice.prompt_token_ids == exp.token_ids
        cc.assert_matches(
            choice.token_ids, choice.logprobs.token_logprobs, ref, f"DP=2 + store: {prompt[-12:]}"
        )
    assert m.hit_count + m.miss_count + m.host_hits + m.remote_hits == occurrences
    why = f"a document in the store was computed again (read misses by reason: {m.remote_reasons})"
    assert m.chunk_prefills == computed <= 1 + len(docs), why
    # Every entry (SYS and each document) failed one read, when it was new; no other read failed.
    assert m.remote_hits > 0 and m.remote_read_failures == 1 + len(docs), m
    reads = dict(re.findall(r'^vllm:chunk_cache_remote_hits_total\{engine="(\d)"[^}]*\} (\S+)', text, re.M))
    assert set(reads) == {"0", "1"} and any(float(v) > 0 for v in reads.values()), text
    assert m.pinned_entries == 0 and m.remote_up
