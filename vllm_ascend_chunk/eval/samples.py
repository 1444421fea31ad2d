"""The samples an evaluation measures, and the text of their prompts.

**A samples file** is JSON Lines, one sample an object:

    {"id": "q1", "system": "...", "documents": ["...", "..."], "question": "...", "answers": ["..."]}

`system`, `id` and `answers` are optional (`answers` a list or one string: without it the sample
scores only against full attention). MuSiQue's forms are read too: CacheBlend's `musique_s.json`
rows (`question`, `answers`, `ctxs`: [{"title", "text"}], lists possibly as their Python text)
and MuSiQue's own (`question`, `answer`, `answer_aliases`, `paragraphs`: [{"title",
"paragraph_text"}]); a file that is one JSON array is read as one sample per item. A line that
is not a sample is reported by its line number and skipped: the others go on.

**The built-in set** (`generated`), when no file is given: deterministic for a seed, needing no
data and no download. Each sample's documents are sentences of generated prose, about
`doc_words` words each; one fact ("The secret code of the blue lighthouse is 4721.") is planted
in one document and a distractor of the same kind (another object, another value) in another;
the question asks about the planted fact, whose value is the gold answer. The facts are those of
the project's synthetic set (`benchmarks/quality_data.py`, whose documents are Paul Graham
essays instead).

**The prompt** of a sample, in the chunk cache's shape: SYSTEM (the chat template's system turn
and the opening of the user turn), each document as `DOC_PREFIX + text + "\\n"`, and the question
as `"Question: " + question + "\\n" + ANSWER_HINT` and the template's end of the user turn
(`client.Server.prompt_parts`, `measure.build`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents. "
    "Reply with the answer only, in a few words."
)
ANSWER_HINT = "Answer in a few words."
DOC_PREFIX = "Document: "

COLOURS = [
    "blue",
    "red",
    "green",
    "yellow",
    "purple",
    "orange",
    "silver",
    "golden",
    "white",
    "black",
    "crimson",
    "amber",
]
OBJECTS = [
    "lighthouse",
    "bridge",
    "tower",
    "garden",
    "library",
    "harbor",
    "windmill",
    "castle",
    "observatory",
    "fountain",
    "museum",
    "monastery",
]
FIRST_NAMES = [
    "Talia",
    "Oren",
    "Mirela",
    "Bastian",
    "Ingrid",
    "Caspar",
    "Noemi",
    "Lucan",
    "Freya",
    "Dorian",
    "Elsbeth",
    "Tobias",
]
LAST_NAMES = [
    "Brennock",
    "Valdrick",
    "Osterhaus",
    "Quillan",
    "Marwood",
    "Thessaly",
    "Corvane",
    "Halloway",
    "Pemberly",
    "Ashgrove",
    "Kestrel",
    "Duvall",
]
TOWNS = [
    "Varnholm",
    "Kestrow",
    "Belmire",
    "Dunhallow",
    "Orrisdale",
    "Whitcombe",
    "Larkspur Falls",
    "Tamsworth",
    "Ebberly",
    "Fenwick Cross",
    "Marrowgate",
    "Silverbrook",
]

FACTS = [
    # (statement, question, kind of value)
    ("The secret code of the {key} is {value}.", "What is the secret code of the {key}?", "code"),
    ("The {key} was designed by an architect named {value}.", "Who designed the {key}?", "name"),
    ("The {key} stands in the town of {value}.", "In which town does the {key} stand?", "town"),
]


PRIME_QUESTION = "What are these documents about?"
"""The question of a sample's priming request (its documents in reverse order, 1 token)."""


class SampleError(ValueError):
    """A line of a samples file that is not a sample."""


@dataclass
class Sample:
    sid: str
    documents: list[str]
    question: str
    answers: list[str] = field(default_factory=list)
    system: str | None = None
    line: int | None = None
    """The line of the samples file (the item of a JSON array), None for the built-in set."""


def value_of(kind: str, rng: random.Random) -> str:
    """A random value of a fact of `kind` ("code", "name" or "town")."""
    if kind == "code":
        return str(rng.randint(1000, 9999))
    if kind == "name":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    return rng.choice(TOWNS)


def planted_facts(q: int, distractors: int, rng: random.Random) -> tuple[str, list[str], list[str]]:
    """Question `q`'s fact kind: (its question, its facts' statements, their values), the first
    fact the asked one, the others distractors about other objects with other values."""
    statement, question, kind = FACTS[q % len(FACTS)]
    keys = rng.sample([f"{c} {o}" for c in COLOURS for o in OBJECTS], 1 + distractors)
    values: list[str] = []
    while len(values) < 1 + distractors:  # distinct values, so a distractor is never right
        v = value_of(kind, rng)
        if v not in values:
            values.append(v)
    facts = [statement.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    return question.format(key=keys[0]), facts, values


SUBJECTS = [
    "The council",
    "A traveller",
    "The old miller",
    "Her brother",
    "The committee",
    "A merchant",
    "The teacher",
    "The fisherman",
    "A young clerk",
    "The gardener",
    "The captain",
    "A scholar",
]
VERBS = [
    "repaired",
    "described",
    "visited",
    "painted",
    "measured",
    "sold",
    "studied",
    "remembered",
    "discussed",
    "crossed",
    "opened",
    "counted",
]
THINGS = [
    "the river road",
    "a wooden cart",
    "the northern field",
    "the winter market",
    "an empty barn",
    "the stone wall",
    "a bundle of letters",
    "the village well",
    "the harvest ledger",
    "a copper kettle",
    "the east gate",
    "the long table",
]
WHEN = [
    "before dawn",
    "in the spring",
    "after the storm",
    "every Sunday",
    "late in the evening",
    "during the fair",
    "in silence",
    "with great care",
    "for the third time",
    "at noon",
]


def prose(words: int, rng: random.Random) -> list[str]:
    """Sentences of generated prose, about `words` words in all."""
    out: list[str] = []
    count = 0
    while count < words:
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(THINGS)} {rng.choice(WHEN)}."
        out.append(sentence)
        count += len(sentence.split())
    return out


def generated(
    n: int, docs: int = 5, doc_words: int = 110, seed: int = 0, distractors: int = 1
) -> list[Sample]:
    """The built-in set: `n` samples of `docs` documents of about `doc_words` words."""
    if docs < 2 or distractors >= docs:
        raise ValueError("the built-in set needs --docs >= 2")
    rng = random.Random(seed)
    samples = []
    for q in range(n):
        question, facts, values = planted_facts(q, distractors, rng)
        texts = [prose(doc_words, rng) for _ in range(docs)]
        for i, fact in enumerate(facts):
            texts[i].insert(rng.randint(0, len(texts[i])), fact)
        order = rng.sample(range(docs), docs)
        samples.append(
            Sample(
                sid=f"gen-{seed}-{q}",
                documents=[" ".join(texts[i]) for i in order],
                question=question,
                answers=[values[0]],
            )
        )
    return samples


def _literal(value):
    """A list or dict given as its Python text (CacheBlend's files) as the object; else the value."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        return ast.literal_eval(value)
    return value


def _strings(value, what: str, one: bool = True) -> list[str]:
    """A list of strings (or, if `one`, a single string as a list of it)."""
    value = _literal(value)
    if isinstance(value, str) and one:
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SampleError(f"'{what}' is not a list of strings")
    return value


def parse(obj: object, line: int, docs: int | None = None) -> Sample:
    """One sample from a decoded line (any of the forms the module's docstring names)."""
    if not isinstance(obj, dict):
        raise SampleError("not a JSON object")
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        raise SampleError("no 'question' (a non-empty string)")
    try:
        if "documents" in obj:
            documents = _strings(obj["documents"], "documents", one=False)
        elif "ctxs" in obj:  # CacheBlend's musique_s.json
            documents = [f"{c.get('title') or ''} {c['text']}".strip() for c in _literal(obj["ctxs"])]
        elif "paragraphs" in obj:  # MuSiQue's own
            documents = [f"{p.get('title') or ''} {p['paragraph_text']}".strip() for p in obj["paragraphs"]]
        else:
            raise SampleError("no 'documents' (nor MuSiQue's 'ctxs' or 'paragraphs')")
        answers = []
        if "answers" in obj:
            answers = _strings(obj["answers"], "answers")
        elif "answer" in obj:
            answers = _strings(obj["answer"], "answer") + _strings(
                obj.get("answer_aliases", []), "answer_aliases"
            )
    except (KeyError, TypeError, ValueError, SyntaxError) as exc:
        if isinstance(exc, SampleError):
            raise
        raise SampleError(f"malformed documents or answers ({type(exc).__name__}: {exc})") from None
    documents = [" ".join(d.split()) for d in documents if d.strip()][:docs]
    if len(documents) < 1:
        raise SampleError("no non-empty document")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise SampleError("'system' is not a string")
    sid = str(obj.get("id", obj.get("qid", f"line-{line}")))
    return Sample(sid=sid, documents=documents, question=question, answers=answers, system=system, line=line)


def read(path: Path, docs: int | None = None) -> tuple[list[Sample], list[dict]]:
    """The samples of a file and its lines that are not samples ({"line", "error"}), in order."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # one JSON array (musique_s.json)
        try:
            items = list(enumerate(json.loads(text), 1))
        except ValueError as exc:
            return [], [{"line": 1, "error": f"not JSON: {exc}"}]
        decoded = [(i, obj, None) for i, obj in items]
    else:
        decoded = []
        for i, raw in enumerate(text.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                decoded.append((i, json.loads(raw), None))
            except ValueError as exc:
                decoded.append((i, None, f"not JSON: {exc}"))
    samples, bad = [], []
    seen: set[str] = set()
    for i, obj, error in decoded:
        if error is None:
            try:
                sample = parse(obj, i, docs)
                if sample.sid in seen:
                    raise SampleError(f"id {sample.sid!r} repeats an earlier line's")
                seen.add(sample.sid)
                samples.append(sample)
                continue
            except SampleError as exc:
                error = str(exc)
        bad.append({"line": i, "error": error})
    return samples, bad


def digest(samples: list[Sample]) -> str:
    """A short hash of the samples' content: a resumed run must measure the same samples."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.sid, s.system, s.documents, s.question, s.answers]).encode())
    return h.hexdigest()[:16]
