"""Chunked prompts through a real `vllm serve` process and the `openai` client."""

from __future__ import annotations

import re

import pytest

SYS = "You are a careful assistant."
DOCS = ["The tea house opens at seven.", "Ferries leave hourly, except Sundays. 日本語 😀"]
QUESTION = "When does the ferry leave?"
PROMPT = " # # ".join([SYS, *DOCS, QUESTION])


def split_ids(raw_tok, text: str, first_special: bool) -> list[int]:
    parts = re.split(r"\s*# #\s*", text)
    ids = raw_tok.encode(parts[0], add_special_tokens=first_special).ids
    for p in parts[1:]:
        ids += raw_tok.encode(p, add_special_tokens=False).ids
    return ids


def test_completions(client, raw_tok):
    resp = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert resp.choices[0].prompt_token_ids == split_ids(raw_tok, PROMPT, first_special=True)


def test_ordinary_completion_is_untouched(client, raw_tok):
    text = "An ordinary prompt with one # # delimiter."
    resp = client.completions.create(
        model="tiny-llama", prompt=text, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert resp.choices[0].prompt_token_ids == raw_tok.encode(text).ids


def test_chat_completions(client, raw_tok, models_dir):
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": SYS},
        {"role": "user", "content": " # # ".join(["Context:", *DOCS, QUESTION])},
    ]
    rendered = AutoTokenizer.from_pretrained(models_dir / "tiny-llama").apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    resp = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert resp.prompt_token_ids == split_ids(raw_tok, rendered, first_special=False)


def test_empty_question_is_a_400_and_the_server_keeps_serving(client):
    import openai

    def answer():
        resp = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, temperature=0)
        assert resp.usage.completion_tokens == 2 and resp.choices[0].finish_reason == "length"
        return resp.choices[0].text

    before = answer()
    with pytest.raises(openai.BadRequestError, match="empty question"):
        client.completions.create(model="tiny-llama", prompt=SYS + " # # doc # # ", max_tokens=4)
    assert answer() == before
