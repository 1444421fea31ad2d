"""The recovery modes' grammar (`VLLM_CHUNK_CACHE_RECOVERY`, and per request `chunk_cache_recovery`):
`none`, `last[:K]`, `qattn:R[/M]`, `cover:TAU[/RMAX[/RMIN]]` (`docs/design/design.md`, Recovery)."""

from __future__ import annotations

import dataclasses
import math

SELECT_RUNS = 16
"""Runs a `qattn:R` request computes its selected tokens in, unless it names another (`qattn:R/M`)."""
MAX_SELECT_RUNS = 256
COVER_CEILING = 0.2
"""The most of the document region a `cover:TAU` request recomputes before it falls back to
computing every document, unless it names another (`cover:TAU/RMAX`)."""
RECOVERY_ACCEPTED = (
    f"none, last (= last:1), last:K with K >= 1, qattn:R[/M] with 0 < R <= 1 and "
    f"1 <= M <= {MAX_SELECT_RUNS}, or cover:TAU[/RMAX[/RMIN]] with 0 < TAU <= 1 and "
    f"0 <= RMIN <= RMAX <= 1 (RMAX default {COVER_CEILING:g}, RMIN default 0)"
)
"""Recovery modes (`frontend.recovery`): `last:K` computes the last K documents with the question;
`qattn:R` the fraction R of the document tokens the question attends to most, in M runs;
`cover:TAU` the fewest windows that cover the fraction TAU of the question's attention over the
documents, between RMIN and RMAX of the region, or every document where RMAX does not reach it."""


@dataclasses.dataclass(frozen=True)
class Recovery:
    """A recovery mode: the last `docs` documents computed with the question (`last:K`), or the
    `fraction` of the document tokens the question attends to most, computed in at most
    `runs` runs (`qattn:R[/M]`), or the fewest windows that cover the fraction `cover` of the
    question's attention over the documents, between `floor` and `fraction` of the region
    (`cover:TAU[/RMAX[/RMIN]]`; `docs/design/design.md`, Recovery)."""

    docs: int = 0
    fraction: float = 0.0
    runs: int = 0
    cover: float = 0.0
    floor: float = 0.0

    @property
    def name(self) -> str:
        if self.cover:
            bounds = [self.fraction] + ([self.floor] if self.floor else [])
            shown = "" if bounds == [COVER_CEILING] else "".join(f"/{b:g}" for b in bounds)
            return f"cover:{self.cover:g}{shown}"
        if self.fraction:
            return f"qattn:{self.fraction:g}" + ("" if self.runs == SELECT_RUNS else f"/{self.runs}")
        return "none" if self.docs == 0 else "last" if self.docs == 1 else f"last:{self.docs}"


def recovery_of(mode: str) -> Recovery | None:
    """The recovery mode `mode` names (`RECOVERY_ACCEPTED`, any case), or None."""
    word = mode.strip().lower()
    if word in ("none", "last"):
        return Recovery(docs=int(word == "last"))
    head, _, arg = word.partition(":")
    if head == "last":
        return Recovery(docs=int(arg)) if arg.isdecimal() and int(arg) >= 1 else None
    if head == "cover":
        return _cover_of(arg)
    if head != "qattn":
        return None
    text, slash, runs = arg.partition("/")
    try:
        fraction = float(text)
    except ValueError:
        return None
    runs = runs if slash else str(SELECT_RUNS)
    if not 0 < fraction <= 1 or not (runs.isdecimal() and 1 <= int(runs) <= MAX_SELECT_RUNS):
        return None
    return Recovery(fraction=fraction, runs=int(runs))


def _fractions(text: str) -> list[float] | None:
    """The numbers of `text` separated by `/` (None if one is not a finite number)."""
    try:
        values = [float(part) for part in text.split("/")]
    except ValueError:
        return None
    return values if all(math.isfinite(v) for v in values) else None


def _cover_of(arg: str) -> Recovery | None:
    """`cover:TAU[/RMAX[/RMIN]]` (`arg` after the colon), or None."""
    values = _fractions(arg)
    if values is None or len(values) > 3:
        return None
    tau, ceiling, floor = [*values, *(COVER_CEILING, 0.0)[len(values) - 1 :]]
    if not (0 < tau <= 1 and 0 <= floor <= ceiling <= 1):
        return None
    return Recovery(fraction=ceiling, runs=SELECT_RUNS, cover=tau, floor=floor)
