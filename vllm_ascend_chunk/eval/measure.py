"""One sample's requests: its prompt's token ids, then full attention, a priming request and each
recovery mode on the warm documents (the order of `benchmarks/quality_serve.py`).

The ids come from the server's `/tokenize`, piece by piece as the chunk cache tokenizes a chunked
prompt: SYSTEM with special tokens, each document and the question alone without. With a chat
template, SYSTEM is the template's head (system turn, opening of the user turn) and the
question ends with its tail (`Server.prompt_parts`). Full attention gets these ids as one
ordinary prompt; the modes get them with `chunk_spans`.

At concurrency 1 each request's share of the prompt computed and its fallback come from the
change of the server's counters over the request: `vllm:prompt_tokens_by_source{local_compute}`
(tokens the engine prefilled: the question, the documents a mode computes with it) plus
`vllm:chunk_cache_selected_tokens_total` (document tokens recomputed in place by `qattn` and
`cover`), over the prompt's tokens; `vllm:chunk_cache_cover_fallbacks_total` for a `cover`
request served with every document computed. With several requests in flight the counters
cannot be attributed to one request, and the row has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_ascend_chunk.eval import client as cl
from vllm_ascend_chunk.eval import scores
from vllm_ascend_chunk.eval.samples import ANSWER_HINT, DOC_PREFIX, PRIME_QUESTION, SYSTEM_PROMPT, Sample


@dataclass
class Prompt:
    ids: list[int]
    spans: dict
    prime_ids: list[int]
    prime_spans: dict


class Builder:
    """Token ids of samples' prompts through the server's tokenizer."""

    def __init__(self, server: cl.Server, chat: bool = True, system: str = SYSTEM_PROMPT, doc_tokens=None):
        self.server, self.chat, self.system, self.doc_tokens = server, chat, system, doc_tokens
        self._parts: dict[str, tuple[list[int], list[int]]] = {}
        self.chat_template: bool | None = None

    def parts(self, system: str | None) -> tuple[list[int], list[int]]:
        """(SYSTEM's ids, the ids closing the question) for this system message."""
        system = self.system if system is None else system
        if system not in self._parts:
            parts = self.server.prompt_parts(system, self.chat)
            self.chat_template = parts is not None
            if parts is None:  # no chat template: the system text as it is, the question alone
                parts = (self.server.tokenize(system + "\n", special=True), [])
            self._parts[system] = parts
        return self._parts[system]

    def document(self, text: str) -> list[int]:
        ids = self.server.tokenize(DOC_PREFIX + text + "\n", special=False)
        if self.doc_tokens is not None and len(ids) > self.doc_tokens:
            ids = ids[: self.doc_tokens - 1] + self.server.tokenize("\n", special=False)
        return ids

    def question(self, text: str, tail: list[int]) -> list[int]:
        return self.server.tokenize(f"Question: {text}\n{ANSWER_HINT}", special=False) + tail

    def prompt(self, sample: Sample) -> Prompt:
        head, tail = self.parts(sample.system)
        docs = [self.document(d) for d in sample.documents]
        ids = [t for part in (head, *docs, self.question(sample.question, tail)) for t in part]
        prime = [t for part in (head, *docs[::-1], self.question(PRIME_QUESTION, tail)) for t in part]
        lens = [len(d) for d in docs]
        return Prompt(
            ids=ids,
            spans={"sys_len": len(head), "chunk_lens": lens},
            prime_ids=prime,
            prime_spans={"sys_len": len(head), "chunk_lens": lens[::-1]},
        )


def answer_row(answer: cl.Answer) -> dict:
    return {"text": answer.text, "ttft_s": answer.ttft_s, "latency_s": answer.latency_s}


def measure(
    server: cl.Server, sample: Sample, prompt: Prompt, modes: list[str], max_tokens: int, attribute: bool
) -> dict:
    """Full attention, the priming request, each mode: the sample's row of answers and scores."""
    n = len(prompt.ids)
    row: dict = {"sid": sample.sid, "line": sample.line, "prompt_tokens": n, "answers": sample.answers}
    before = server.metrics() if attribute else None

    def timed(ids, tokens, xargs):
        nonlocal before
        answer = server.complete(ids, tokens, xargs)
        out = answer_row(answer)
        if attribute:
            after = server.settled(before)
            delta = {
                k: after.get(k, 0.0) - before.get(k, 0.0) for k in (cl.COMPUTED, cl.SELECTED, cl.FALLBACKS)
            }
            out["computed"] = (delta[cl.COMPUTED] + delta[cl.SELECTED]) / len(ids)
            out["fallback"] = delta[cl.FALLBACKS] > 0
            before = after
        return out

    row["full"] = timed(prompt.ids, max_tokens, None)
    timed(prompt.prime_ids, 1, {"chunk_spans": prompt.prime_spans, "chunk_cache_recovery": "none"})
    for mode in modes:
        row[mode] = timed(prompt.ids, max_tokens, {"chunk_spans": prompt.spans, "chunk_cache_recovery": mode})
    for setting in ["full", *modes]:
        score(row[setting], row["full"]["text"], sample.answers)
    return row


def score(answer: dict, full_text: str, golds: list[str]) -> dict:
    """Agreement and token F1 against full attention's answer; contains-the-gold where given."""
    answer["agree"] = float(answer["text"] == full_text)
    answer["f1"] = scores.f1(answer["text"], full_text)
    answer["contains"] = scores.best(scores.contains, answer["text"], golds) if golds else None
    return answer


def guarded(row: dict, a: str, b: str) -> dict:
    """The client-side guard on a measured row: B's answer where A's and B's agree, else full
    attention's. Its TTFT is the later of A's and B's whole answers (the client compares them
    before it sends one), plus full attention's TTFT where it falls back; its computed share is
    A's and B's, plus the whole prompt where it falls back."""
    fallback = row[a]["text"] != row[b]["text"]
    served = row["full"] if fallback else row[b]
    out = {
        "text": served["text"],
        "ttft_s": max(row[a]["latency_s"], row[b]["latency_s"])
        + (row["full"]["ttft_s"] if fallback else 0.0),
        "fallback": fallback,
    }
    if "computed" in row[a] and "computed" in row[b]:
        out["computed"] = row[a]["computed"] + row[b]["computed"] + (1.0 if fallback else 0.0)
    return score(out, row["full"]["text"], row["answers"])
