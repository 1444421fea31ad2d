"""The fuzz's requests: its settings, and case i of a run as a function of (seed, i) alone.

Random chunked prompts (`SYSTEM # # DOC_1 # # ... # # QUESTION`, parts drawn from a small corpus
so documents repeat and evict each other, random delimiters and whitespace, empty parts, unusual
Unicode, sizes around the pool and max_model_len), plain prompts, completions and chat, with
random options; streamed or not, some streams closed early; a recovery mode per request
(`chunk_cache_recovery` in `vllm_xargs`), drawn from a random stream of its own so that the
modes offered change nothing else.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.rag_workload import document

MODEL_NAME = "tiny-llama"
PAGE_TOKENS = 16
KV_BYTES_PER_TOKEN = 1024  # tiny Llama: 2 layers x (K, V) x 2 KV heads x 32 x float32

UNICODE = [
    "日本語の文書を検索する",
    "中文文档检索",
    "😀🚀👍🏽👨‍👩‍👧",
    "e\u0301 a\u0308 n\u0303 \u0338",
    "שלום עולם",
    "مرحبا بالعالم",
    "\u202eevil\u202c",
    "line\u2028sep\u2029para",
    "nul\x00in",
    "esc \x1b[31mred\x1b[0m",
    "zero\u200bwidth\ufeff",
    "\u3000ideographic\u00a0space",
    "Straße café",
]
DELIMITERS = [" # # ", "# #", "\n# #\n", "\t# #  ", "\u2028# #\u3000", "\u00a0# #\u2029"]
NOT_DELIMITERS = ["##", "#  #", "# ##", "#\u200b#"]
HASH_TEXT = ["Issue # # 5 is open.", "C# # F# # G are notes", "a # # b", "# #"]
SYSTEMS = [
    "You are a careful assistant. Answer from the documents.",
    "",
    "Sys \u00e9\u0301 日本",
    "You are a careful assistant. Answer from the documents. " * 6,
    "\x00",
    "S",
]
QUESTIONS = [
    "Which ferry?",
    "What is the answer?",
    "?",
    "",
    " \u2028\t",
    "日本語で答えて",
    "😀?",
    "Why # not?",
    "Explain the second document in detail, please.",
]
RECOVERY_MODES = (
    "default",
    "none",
    "last:1",
    "last:2",
    "last:4",
    "qattn:0.1/4",
    "qattn:0.3",
    "qattn:1/2",
    "cover:0.6/0.2",
    "cover:0.9/0.1",
)
"""The recovery modes a case draws from (`default`: no `chunk_cache_recovery`, the server's mode)."""
RECOVERY_KEY = "chunk_cache_recovery"
JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["answer"],
}


@dataclass
class FuzzSettings:
    """What the fuzz sends and to which server."""

    seed: int = 0
    requests: int = 2000
    concurrency: int = 8
    timeout: float = 120.0
    max_model_len: int = 1024
    pool_pages: int = 48
    scheduling_policy: str = "priority"
    prompt_logprobs: bool = True
    max_deaths: int = 3
    ignore: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    only: list[int] | None = None
    first: int = 0
    """The run's cases are `first` .. `first + requests - 1` (unless `only` names them)."""
    recovery: tuple[str, ...] = RECOVERY_MODES
    """The recovery modes drawn from (`RECOVERY_MODES` names them; `("default",)`: none sent)."""

    @property
    def pool_gb(self) -> float:
        """`pool_pages` in GiB of the tiny Llama's KV."""
        return self.pool_pages * PAGE_TOKENS * KV_BYTES_PER_TOKEN / 2**30


@dataclass
class Case:
    """One request: where it goes, its JSON body, and after how many stream events to hang up."""

    index: int
    endpoint: str
    body: dict
    disconnect_after: int | None = None

    @property
    def deterministic(self) -> bool:
        """Decoding that must give the same tokens whenever the request is asked."""
        if self.disconnect_after is not None:
            return False
        return self.body.get("temperature") == 0 or self.body.get("seed") is not None

    @property
    def recovery(self) -> str:
        """The case's `chunk_cache_recovery`, `default` when it sends none."""
        return (self.body.get("vllm_xargs") or {}).get(RECOVERY_KEY, "default")

    def options(self) -> list[str]:
        """The option names this case exercises (for the counts)."""
        skip = ("model", "prompt", "messages", "return_token_ids", "vllm_xargs")
        names = [k for k in self.body if k not in skip]
        names.append("chat" if "messages" in self.body else "completion")
        names.append(f"recovery={self.recovery}")
        if self.disconnect_after is not None:
            names.append("disconnect")
        return names


def corpus(seed: int) -> list[str]:
    """Documents of 1 to ~400 tokens (the pool holds ~750), some in unusual Unicode; the first
    ones, which `chunked_prompt` picks most often, are the shortest, so they stay in the pool."""
    rng = random.Random(seed)
    sizes = sorted(rng.choice([1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 400]) for _ in range(20))
    docs = [document(7000 + seed * 100 + i, size) for i, size in enumerate(sizes)]
    docs += [u * rng.randint(1, 20) for u in UNICODE]
    return docs + ["", "   ", "\u2028"]


def noisy(rng: random.Random, text: str, rate: float = 1.0) -> str:
    """`text` with random whitespace around it, sometimes a Unicode insert (less of both with a
    lower `rate`: a prompt's leading whitespace is part of SYSTEM, hence of every chunk key)."""
    ws = ["", " ", "\n", "\t", "\u2028", "\u3000", "  \n "]
    if rng.random() < 0.1 * rate:
        cut = rng.randint(0, len(text))
        text = text[:cut] + rng.choice(UNICODE) + text[cut:]
    lead = rng.choice(ws) if rng.random() < rate else ""
    return lead + text + rng.choice(ws)


def chunked_prompt(rng: random.Random, docs: list[str], max_model_len: int) -> str:
    """SYSTEM, 0-10 documents (popular ones first), a question, random delimiters between them."""
    k = rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8, 10])
    picks = [
        docs[min(int(rng.paretovariate(1.0)) - 1, len(docs) - 1)] if rng.random() < 0.6 else rng.choice(docs)
        for _ in range(k)
    ]
    question = rng.choice(QUESTIONS)
    if rng.random() < 0.05:
        question = document(rng.randint(0, 10**6), rng.choice([max_model_len // 2, max_model_len]))
    parts = [rng.choice(SYSTEMS), *picks, question]
    out = noisy(rng, parts[0], rate=0.2)
    for part in parts[1:]:
        delim = rng.choice(NOT_DELIMITERS) if rng.random() < 0.03 else rng.choice(DELIMITERS)
        out += delim + noisy(rng, part)
    return out


def plain_prompt(rng: random.Random, docs: list[str], max_model_len: int) -> str:
    """An ordinary prompt: text, perhaps with one `# #` or `# #` in ordinary words."""
    text = rng.choice(
        [
            rng.choice(docs),
            rng.choice(HASH_TEXT),
            rng.choice(QUESTIONS) or "Hi",
            document(rng.randint(0, 10**6), rng.choice([50, max_model_len])),
        ]
    )
    if rng.random() < 0.5:
        text += " " + rng.choice(HASH_TEXT)
    return text


def messages(rng: random.Random, prompt: str) -> list[dict]:
    """The prompt as one user message, or split into a system and a user message."""
    if rng.random() < 0.7 or "# #" not in prompt:
        return [{"role": "user", "content": prompt}]
    head, _, tail = prompt.partition("# #")
    return [{"role": "system", "content": head + "# #"}, {"role": "user", "content": tail}]


def sampling_options(rng: random.Random, body: dict) -> None:
    """temperature, seed, n, best_of, beam search, max/min tokens, stop, ignore_eos."""
    body["temperature"] = rng.choice([0, 0, 0, 0.7, 1.5, None])
    if rng.random() < 0.35:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.15:
        body["n"] = rng.randint(2, 3)
        if body.get("temperature") == 0 and rng.random() < 0.7:  # n > 1 needs sampling (vLLM)
            body["temperature"] = 1.0
    if rng.random() < 0.05:
        body["best_of"] = body.get("n", 1) + rng.randint(0, 2)
    if rng.random() < 0.02:
        body["use_beam_search"] = True
    body["max_tokens"] = (
        rng.choice([1, 2, 4, 4, 8, 8, 16, 16, 32, None]) if rng.random() < 0.94 else rng.choice([0, 4096])
    )
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(0, min(10, body.get("max_tokens") or 16) + rng.choice([0, 0, 0, 4]))
    if rng.random() < 0.2:
        stops = [".", ["\n", "ou"], ["a", "e", " "], "日本", "」", [""] if rng.random() < 0.2 else "?"]
        body["stop"] = rng.choice(stops)
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    for key in [k for k, v in body.items() if v is None]:
        del body[key]


def logprob_options(rng: random.Random, body: dict, chat: bool, prompt_logprobs: bool) -> None:
    """echo, logprobs, prompt_logprobs. Without `prompt_logprobs`, no prompt logprobs are asked
    (no `prompt_logprobs`, no `echo` with `logprobs`); the same random draws either way."""
    if rng.random() < 0.2:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.12:
        body["echo"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.choice([0, 1, 3, -1])
    if rng.random() < 0.05:
        body["return_tokens_as_token_ids"] = True
    if not prompt_logprobs:  # chat's echo asks for prompt logprobs (top_logprobs, default 0)
        body.pop("prompt_logprobs", None)
        if chat:
            body.pop("echo", None)
        elif body.get("echo"):
            body.pop("logprobs", None)


def other_options(rng: random.Random, body: dict, settings: FuzzSettings) -> None:
    """truncate_prompt_tokens, response_format, priority."""
    if rng.random() < 0.1:
        body["truncate_prompt_tokens"] = rng.choice([-1, 1, 8, 64, 512, settings.max_model_len])
    if rng.random() < 0.08:
        body["response_format"] = rng.choice(
            [
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "answer", "schema": JSON_SCHEMA}},
            ]
        )
    if rng.random() < 0.15:
        body["priority"] = rng.randint(-5, 5)


def make_case(settings: FuzzSettings, docs: list[str], index: int) -> Case:
    """Case `index` of the run with `settings.seed`: a function of (seed, index) alone (and of the
    options left out: `settings.skip`, `prompt_logprobs`, the recovery modes offered)."""
    rng = random.Random(f"{settings.seed}:{index}")
    chat = rng.random() < 0.3
    build = plain_prompt if rng.random() < 0.12 else chunked_prompt
    prompt = build(rng, docs, settings.max_model_len)
    body: dict = {"model": MODEL_NAME, "return_token_ids": True}
    body.update({"messages": messages(rng, prompt)} if chat else {"prompt": prompt})
    sampling_options(rng, body)
    logprob_options(rng, body, chat, settings.prompt_logprobs)
    other_options(rng, body, settings)
    mode = random.Random(f"{settings.seed}:{index}:recovery").choice(settings.recovery)
    if mode != "default":
        body["vllm_xargs"] = {RECOVERY_KEY: mode}
    for key in settings.skip:
        body.pop(key, None)
    disconnect = None
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            disconnect = rng.randint(0, 3)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    return Case(index, endpoint, body, disconnect)


def make_cases(settings: FuzzSettings) -> list[Case]:
    """The run's cases: `settings.only`, or all `settings.requests` of them from `settings.first`."""
    docs = corpus(settings.seed)
    indices = (
        settings.only
        if settings.only is not None
        else range(settings.first, settings.first + settings.requests)
    )
    return [make_case(settings, docs, i) for i in indices]
