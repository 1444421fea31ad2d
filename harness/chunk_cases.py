"""Chunked-prompt workloads and their independent expectations (raw `tokenizers` + HF reference)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

from harness import hf_reference
from harness.rag_workload import chunked as chunked  # (re-exported for the tests)
from harness.rag_workload import document as document

DELIMITER = re.compile(r"\s*# #\s*")
SYS = "You are a careful assistant. Answer from the documents."
DEFAULT_LAYOUT = "sequential"
"""The documented layout of an engine with `VLLM_CHUNK_CACHE_LAYOUT` unset."""
UNICODE_DOC = "Les cafés naïfs de la Straße: 日本語の文書を検索 😀🚀 λόγος, мир!"


@dataclass
class Expected:
    token_ids: list[int]
    sys_len: int
    chunk_lens: list[int]


def expected_structure(raw_tok, text: str, add_special_tokens: bool = True) -> Expected:
    """Token ids and spans of a chunked prompt, by splitting and tokenizing each part alone."""
    parts = DELIMITER.split(text)
    if len(parts) < 3:
        ids = raw_tok.encode(text, add_special_tokens=add_special_tokens).ids
        return Expected(ids, len(ids), [])
    system, *chunks, question = parts
    sys_ids = raw_tok.encode(system, add_special_tokens=add_special_tokens).ids
    chunk_ids = [raw_tok.encode(c, add_special_tokens=False).ids for c in chunks if c]
    q_ids = raw_tok.encode(question, add_special_tokens=False).ids
    return Expected(
        sys_ids + [t for c in chunk_ids for t in c] + q_ids, len(sys_ids), [len(c) for c in chunk_ids]
    )


def reference(
    model, raw_tok, text: str, max_tokens: int, layout: str = DEFAULT_LAYOUT, recovery_docs: int = 0
):
    """The expected structure of `text` and the HF reference answer. `recovery_docs=K`: the last
    K documents are computed with the question, i.e. they belong to the question's segment."""
    exp = expected_structure(raw_tok, text)
    chunk_lens = exp.chunk_lens[: max(0, len(exp.chunk_lens) - recovery_docs)]
    return exp, hf_reference.greedy(
        model, exp.token_ids, max_tokens, sys_len=exp.sys_len, chunk_lens=chunk_lens, layout=layout
    )


_qattn_references: dict[tuple, tuple] = {}


def qattn_reference(model, raw_tok, text: str, max_tokens: int, mode: str, layout: str = DEFAULT_LAYOUT):
    """The expected structure of `text` and the HF reference answer of the `qattn:r/m` recovery
    mode (`harness/hf_recovery.py`): the tokens, the log-probability of the first one, and
    the region tokens the plan computes. `raw_tok` is the model's own tokenizer; computed once per
    model and arguments (a copy of that)."""
    key = (model.name_or_path, text, max_tokens, mode, layout)
    if key not in _qattn_references:
        _qattn_references[key] = _qattn_reference(model, raw_tok, text, max_tokens, mode, layout)
    return copy.deepcopy(_qattn_references[key])


def _qattn_reference(model, raw_tok, text: str, max_tokens: int, mode: str, layout: str):
    from harness import hf_recovery as hr

    exp = expected_structure(raw_tok, text)
    ids, sys_len, lens = exp.token_ids, exp.sys_len, exp.chunk_lens
    kv = hr.chunk_kv(model, ids, sys_len, lens)
    layer = hr.qattn_layer(model, mode)
    attention = hr.question_attention(model, ids, sys_len, lens, layout, kv, layer, drop_last=True)
    compute = hr.recompute_set(mode, sys_len, lens, attention=attention)
    out = hr.run(model, ids, sys_len, lens, layout, compute, kv, max_tokens)
    return exp, out, compute


def assert_output_matches(out, model, raw_tok, text: str, what: str, recovery_docs: int = 0) -> None:
    """An offline greedy `RequestOutput` of `text` (default layout, `logprobs=1`): its prompt ids and
    its answer against the HF reference."""
    gen = out.outputs[0]
    exp, ref = reference(model, raw_tok, text, len(gen.token_ids), DEFAULT_LAYOUT, recovery_docs)
    assert out.prompt_token_ids == exp.token_ids
    assert_matches(
        gen.token_ids, [s[t].logprob for s, t in zip(gen.logprobs, gen.token_ids, strict=True)], ref, what
    )


def assert_matches(out_tokens, out_logprobs, ref, what: str) -> None:
    assert list(out_tokens) == ref.tokens, f"{what}: tokens differ"
    for step, (got, want) in enumerate(zip(out_logprobs, ref.logprobs, strict=True)):
        assert abs(got - want) < 2e-3, f"{what}: logprob of step {step} differs: {got} vs {want}"


def reference_tools(models_dir: Path, name: str):
    """The HF reference model and the raw `tokenizers` tokenizer of the tiny model `name`."""
    from tokenizers import Tokenizer

    return (
        hf_reference.load(models_dir / name),
        Tokenizer.from_file(str(models_dir / name / "tokenizer.json")),
    )


def next_to_a_block_store() -> tuple[list[str], list[str]]:
    """Chunked and ordinary prompts for the chunk cache next to another KV connector: documents of
    150+ tokens, so `SYS + C_i` fills whole 128-token blocks that a block store keeps."""
    docs = [document(500 + i, 150 + 20 * i) for i in range(3)]
    chunked_prompts = [
        chunked(SYS, docs[:2], "What is first?"),
        chunked(SYS, [docs[2], docs[0]], "And the other one?"),
    ]
    return chunked_prompts, [document(600, 400), document(601, 300) + " What is it about?"]
