"""ChunkParser: examples of the contract and properties on random texts."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ascend_chunk.frontend.parser import ChunkParser, ChunkPromptError

PARSER = ChunkParser()


def test_basic_shape():
    p = PARSER.split("SYS text # # doc one # # doc two # # the question?")
    assert (p.system, p.chunks, p.question) == ("SYS text", ["doc one", "doc two"], "the question?")


def test_unicode_whitespace_around_delimiters_is_eaten():
    p = PARSER.split("sys\u3000\u00a0# #\n\tdoc\u2003# #  q  ")
    assert (p.system, p.chunks, p.question) == ("sys", ["doc"], "q  ")


@pytest.mark.parametrize("text", ["plain prompt", "one # # delimiter only", "", "# #", "#  # spaced"])
def test_fewer_than_two_delimiters_is_an_ordinary_prompt(text):
    assert PARSER.split(text) is None


def test_empty_chunks_are_dropped():
    p = PARSER.split("sys # # # # a # #   # # b # # q")
    assert p.chunks == ["a", "b"]
    assert PARSER.split("sys # # # # q").chunks == []


@pytest.mark.parametrize("text", ["sys # # doc # #", "sys # # doc # #   \n", "# # # #", "# # # # # #"])
def test_empty_question_is_a_clear_error(text):
    with pytest.raises(ChunkPromptError, match="empty question"):
        PARSER.split(text)


def test_empty_system_is_allowed():
    p = PARSER.split("# # doc # # q")
    assert (p.system, p.chunks, p.question) == ("", ["doc"], "q")


def test_configurable_delimiter_is_literal():
    parser = ChunkParser("[DOC]")
    p = parser.split("s [DOC] a.b [DOC] q")
    assert (p.system, p.chunks, p.question) == ("s", ["a.b"], "q")
    assert parser.split("s # # a # # q") is None
    with pytest.raises(ValueError):
        ChunkParser("  ")


ALPHABET = st.sampled_from(list("ab #\n\t\u3000\u00a0é日😀"))
texts = st.lists(ALPHABET, max_size=60).map("".join)


@settings(max_examples=400, deadline=None)
@given(st.lists(texts, min_size=1, max_size=8), st.sampled_from(["# #", "##", "<d>"]))
def test_properties_on_random_texts(pieces, delimiter):
    parser = ChunkParser(delimiter)
    text = f" {delimiter} ".join(pieces)
    sep = re.compile(r"(?:\s*" + re.escape(delimiter) + r"\s*)+")
    n_delimiters = len(re.findall(r"\s*" + re.escape(delimiter) + r"\s*", text))
    try:
        p = parser.split(text)
    except ChunkPromptError:  # only when nothing but whitespace follows the last delimiter
        assert n_delimiters >= 2 and re.search(re.escape(delimiter) + r"\s*$", text)
        return
    if p is None:
        assert n_delimiters < 2
        return
    ranges = [p.system_range, *p.chunk_ranges, p.question_range]
    # Ranges are ordered, non-overlapping, and cover the text with only delimiters in between.
    assert ranges[0][0] == 0 and ranges[-1][1] == len(text)
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end <= start and sep.fullmatch(text[end:start])
    # No part contains the delimiter; chunks and question are non-empty; join round-trips.
    for part in (p.system, *p.chunks, p.question):
        assert delimiter not in part
    assert all(p.chunks) and p.question
    gaps = [text[end:start] for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False)]
    rebuilt = p.system + "".join(g + part for g, part in zip(gaps, [*p.chunks, p.question], strict=True))
    assert rebuilt == text


def test_lone_surrogates_are_a_clear_error():
    with pytest.raises(ChunkPromptError, match=r"not valid Unicode: '\\ud800' at character 9"):
        PARSER.split("sys # # a\ud800b # # q")
    assert PARSER.split("plain \udfff prompt") is None  # ordinary prompts are left to vLLM
