"""Text-level parsing of `SYSTEM # # C_1 # # ... # # C_n # # QUESTION` prompts."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from vllm.exceptions import VLLMValidationError


class ChunkPromptError(VLLMValidationError):
    """A chunked prompt the chunk cache cannot serve (surfaced to clients as HTTP 400).

    A `VLLMValidationError`, so the API server answers it with its own 400 handler; a plain
    `ValueError` raised while rendering falls through to the catch-all handler, which logs a
    traceback and closes the client's keep-alive connection.
    """


@dataclass(frozen=True)
class ParsedPrompt:
    """A chunked prompt split into its parts; each range is `[start, end)` in characters of `text`."""

    text: str
    system_range: tuple[int, int]
    chunk_ranges: tuple[tuple[int, int], ...]
    question_range: tuple[int, int]

    @property
    def system(self) -> str:
        return self.text[slice(*self.system_range)]

    @property
    def chunks(self) -> list[str]:
        return [self.text[slice(*s)] for s in self.chunk_ranges]

    @property
    def question(self) -> str:
        return self.text[slice(*self.question_range)]


class ChunkParser:
    """Splits prompt text on `\\s*<delimiter>\\s*` (Unicode whitespace).

    Part 0 is SYSTEM, the last part is QUESTION, the parts between are chunks. Fewer than two
    delimiters: not a chunked prompt (`split` returns None). Empty chunks are dropped. An empty
    QUESTION or text that is not valid Unicode (lone surrogates) raises `ChunkPromptError`.
    """

    def __init__(self, delimiter: str = "# #") -> None:
        if not delimiter.strip():
            raise ValueError("the chunk delimiter must not be blank")
        self.delimiter = delimiter
        self.pattern = re.compile(r"\s*" + re.escape(delimiter) + r"\s*")

    def split(self, text: str) -> ParsedPrompt | None:
        bounds = [m.span() for m in self.pattern.finditer(text)]
        if len(bounds) < 2:
            return None
        starts = [0] + [end for _, end in bounds]
        ends = [start for start, _ in bounds] + [len(text)]
        parts = list(zip(starts, ends, strict=True))
        question = parts[-1]
        if question[0] == question[1]:
            raise ChunkPromptError(
                f"The chunked prompt has an empty question: nothing follows the last "
                f"{self.delimiter!r} delimiter. Put the question after the last document."
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ChunkPromptError(
                f"The chunked prompt is not valid Unicode: {text[err.start]!r} at character "
                f"{err.start} is a lone surrogate. Send UTF-8 text."
            ) from None
        return ParsedPrompt(
            text=text,
            system_range=parts[0],
            chunk_ranges=tuple(p for p in parts[1:-1] if p[0] < p[1]),
            question_range=question,
        )


@functools.cache
def parser_for(delimiter: str) -> ChunkParser:
    return ChunkParser(delimiter)
