"""Deterministic RAG workloads: synthetic documents, questions and chunked prompts.

Shared by the tests (`harness/chunk_cases.py`), the benchmark (`benchmarks/bench_rag.py`) and the
demo. Everything is seeded: the same arguments give the same text on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scripts.make_tiny_models import synthetic_corpus

DELIMITER = " # # "
SYSTEM = "You are a careful assistant. Answer the question from the documents."


def document(seed: int, approx_tokens: int) -> str:
    """A deterministic document of roughly `approx_tokens` tokens (about 3 characters per token)."""
    rng = random.Random(seed)
    lines = synthetic_corpus(seed=1000 + seed, n_lines=max(2, approx_tokens // 4))
    text = " ".join(rng.sample(lines, len(lines))).replace("#", "")  # no delimiters inside
    return " ".join(text[: max(8, approx_tokens * 3)].split())


def chunked(sys: str, docs: list[str], question: str) -> str:
    """`SYSTEM # # DOC_1 # # ... # # DOC_n # # QUESTION`."""
    return DELIMITER.join([sys, *docs, question])


def question(seed: int, approx_tokens: int = 32) -> str:
    """A deterministic question of roughly `approx_tokens` tokens."""
    return "Question: " + document(10_000_000 + seed, max(4, approx_tokens * 2 // 3)) + "?"


def reorderings(docs: list[int], count: int, rng: random.Random) -> list[list[int]]:
    """`count` orders of `docs`: in order r, docs[j] sits at position pi((j + r) % n), pi random.

    Order 0 is `docs` shuffled. Across up to n orders a document never comes back to a position
    it held, and (n > 1) no two orders start with the same document, so a prefix cache shares
    nothing but SYSTEM between them. Beyond n orders they repeat.
    """
    n = len(docs)
    pi = rng.sample(range(n), n)
    orders = []
    for r in range(count):
        out = [0] * n
        for j, d in enumerate(docs):
            out[pi[(j + r) % n]] = d
        orders.append(out)
    return orders


def zipf_sample(rng: random.Random, n_items: int, k: int, s: float) -> list[int]:
    """`k` distinct indices of range(n_items), index i drawn with weight 1 / (i + 1) ** s."""
    weights = [1.0 / (i + 1) ** s for i in range(n_items)]
    chosen: list[int] = []
    for _ in range(min(k, n_items)):
        pool = [i for i in range(n_items) if i not in chosen]
        chosen.append(rng.choices(pool, weights=[weights[i] for i in pool])[0])
    return chosen


@dataclass
class RagRequest:
    phase: str  # which part of the workload: "warmup", "sweep", "repeat", "cold", "stream", "shuffled"
    doc_ids: list[int]  # document seeds, in prompt order
    question_seed: int
    label: str = ""  # "cold" (no document seen before in this run) / "warm" / "" (mixed)
    meta: dict = field(default_factory=dict)


@dataclass
class RagWorkload:
    """A corpus of documents (by seed) and the requests over it, in the order they are sent."""

    doc_tokens: int = 512
    question_tokens: int = 32
    system: str = SYSTEM
    requests: list[RagRequest] = field(default_factory=list)
    _docs: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)

    def doc(self, seed: int, tokens: int | None = None) -> str:
        """Document `seed` of ~`tokens` tokens (default `doc_tokens`)."""
        key = (seed, tokens or self.doc_tokens)
        if key not in self._docs:
            self._docs[key] = document(*key)
        return self._docs[key]

    def prompt(self, req: RagRequest) -> str:
        """The request's chunked prompt (its documents of `meta["doc_tokens"]`, if it says)."""
        tokens = req.meta.get("doc_tokens")
        docs = [self.doc(d, tokens) for d in req.doc_ids]
        return chunked(self.system, docs, question(req.question_seed, self.question_tokens))


def zipf_stream(
    rng: random.Random,
    n_requests: int,
    *,
    corpus_size: int = 48,
    docs_per_request: tuple[int, ...] = (4, 5, 6, 7, 8),
    zipf_s: float = 1.0,
    question_seeds=None,
    phase: str = "stream",
    seen: set[int] | None = None,
) -> list[RagRequest]:
    """`n_requests` requests of `docs_per_request` documents (chosen per request) drawn from a
    corpus of `corpus_size` (seeds from STREAM_SEEDS) with Zipf(`zipf_s`) popularity, each set in
    shuffled order. Labels: "cold" (no document seen before in `seen`), "warm" (all seen), ""."""
    q = iter(question_seeds) if question_seeds is not None else iter(range(1_000_000))
    seen = set() if seen is None else seen
    out = []
    for _ in range(n_requests):
        k = rng.choice(docs_per_request)
        docs = [STREAM_SEEDS + i for i in zipf_sample(rng, corpus_size, k, zipf_s)]
        rng.shuffle(docs)
        label = "cold" if seen.isdisjoint(docs) else "warm" if seen.issuperset(docs) else ""
        seen.update(docs)
        out.append(RagRequest(phase, docs, next(q), label))
    return out


# Disjoint seed ranges per phase, so a phase's "cold" documents were never seen before.
WARMUP_SEEDS, SWEEP_SEEDS, COLD_SEEDS, STREAM_SEEDS, SHUFFLED_SEEDS = (
    100_000,
    200_000,
    300_000,
    400_000,
    500_000,
)


def build_workload(
    *,
    seed: int = 0,
    doc_tokens: int = 512,
    question_tokens: int = 32,
    sweep_sizes: tuple[int, ...] = (1, 2, 4, 8),
    sweep_sets: tuple[tuple[int, int], ...] = (),
    sweep_warm_repeats: int = 3,
    recovery_variants: tuple[str, ...] = (),
    cold_requests: int = 3,
    cold_docs: int = 8,
    corpus_size: int = 48,
    stream_requests: int = 30,
    docs_per_request: tuple[int, ...] = (4, 5, 6, 7, 8),
    zipf_s: float = 1.0,
    shuffled_sets: int = 3,
    shuffled_docs: int = 8,
    shuffled_repeats: int = 4,
    warmup_requests: int = 1,
    exact_repeats: bool = False,
) -> RagWorkload:
    """The benchmark's request sequence (the same for every configuration).

    - warmup: `warmup_requests` times 4 new documents, then the same reordered (first-request
      costs, and the first load from the pool, out of the numbers);
    - sweep: for n in `sweep_sizes`, one request on n new documents ("cold"), then
      `sweep_warm_repeats` on the same documents with every one moved ("warm", a new question);
      with `exact_repeats`, each warm one is sent again as it is (phase "repeat": for prefix
      caching an exact-prefix hit, the floor of what any cache can do for that prompt); then
      `sweep_sets`, (n, tokens) pairs: the same for n new documents of ~tokens tokens each
      (`meta["doc_tokens"]`); with `recovery_variants`, each warm request of the sweep is
      followed by one per mode (phase "variant", `meta["recovery"]`): the same documents in
      another new order, a new question;
    - cold: `cold_requests` requests of `cold_docs` new documents each (all misses);
    - stream: `stream_requests` requests of `docs_per_request` documents (chosen per request)
      drawn from a corpus of `corpus_size` with Zipf(`zipf_s`) popularity, in shuffled order;
    - shuffled: `shuffled_sets` sets of `shuffled_docs` documents, each sent once, then
      `shuffled_repeats` more times per set (sets interleaved) in orders where no document keeps
      its position (see `reorderings`).
    """
    rng = random.Random(seed)
    w = RagWorkload(doc_tokens=doc_tokens, question_tokens=question_tokens)
    q = iter(range(1_000_000))
    add = w.requests.append

    for i in range(warmup_requests):  # the first load from the pool pays one-off costs too
        for r, docs in enumerate(reorderings([WARMUP_SEEDS + 8 * i + j for j in range(4)], 2, rng)):
            add(RagRequest("warmup", docs, next(q), "warm" if r else "cold"))

    base = SWEEP_SEEDS
    per_warm = 1 + len(recovery_variants)
    for n, tokens in [(n, None) for n in sweep_sizes] + list(sweep_sets):
        meta = {} if tokens is None else {"doc_tokens": tokens}
        if recovery_variants and 1 < n < 1 + sweep_warm_repeats * per_warm:
            raise ValueError(f"{n} documents have too few orders for the repeats and variants")
        orders = reorderings(list(range(base, base + n)), 1 + sweep_warm_repeats * per_warm, rng)
        base += n
        add(RagRequest("sweep", orders[0], next(q), "cold", dict(meta)))
        for r in range(sweep_warm_repeats):
            group = orders[1 + r * per_warm : 1 + (r + 1) * per_warm]
            add(RagRequest("sweep", group[0], next(q), "warm", dict(meta)))
            if exact_repeats:
                add(RagRequest("repeat", group[0], w.requests[-1].question_seed, "warm", dict(meta)))
            for mode, docs in zip(recovery_variants, group[1:], strict=True):
                add(RagRequest("variant", docs, next(q), "warm", {**meta, "recovery": mode}))

    for i in range(cold_requests):
        add(RagRequest("cold", [COLD_SEEDS + cold_docs * i + j for j in range(cold_docs)], next(q), "cold"))

    for req in zipf_stream(
        rng,
        stream_requests,
        corpus_size=corpus_size,
        docs_per_request=docs_per_request,
        zipf_s=zipf_s,
        question_seeds=q,
    ):
        add(req)

    sets = [
        reorderings(
            [SHUFFLED_SEEDS + shuffled_docs * s + j for j in range(shuffled_docs)], 1 + shuffled_repeats, rng
        )
        for s in range(shuffled_sets)
    ]
    for r in range(1 + shuffled_repeats):
        for s, orders in enumerate(sets):
            add(RagRequest("shuffled", orders[r], next(q), "warm" if r else "cold", {"set": s}))
    return w
