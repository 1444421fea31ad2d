"""What a configuration variable accepts (`Kind`), and the kinds the table uses: numbers in a
range, one of some words, blank for unset, secrets and their files, Mooncake addresses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

METADATA_SCHEMES = ("http", "https", "etcd", "redis")
MIN_SECRET_BYTES = 16
"""The shortest remote-store secret accepted (`openssl rand -hex 32` makes one of 64)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a variable accepts: `parse` turns its text into the value and raises `ValueError` for
    text outside `accepted`."""

    parse: Callable[[str], Any]
    accepted: str = ""
    """The accepted values, in the words of the error and of the docs table (empty: any text)."""
    strip: bool = True
    """Whether the text is stripped before `parse` (an error then quotes it stripped)."""
    secret: bool = False
    """Whether the text is a secret: an error says its length, never the text."""


def named(value: Any) -> Any:
    """`value`, or `ValueError` when it is None: the text names nothing accepted."""
    if value is None:
        raise ValueError("not an accepted value")
    return value


def number(ok: Callable[[float], bool], accepted: str, unit: int = 0) -> Kind:
    """A finite number that `ok` accepts; with `unit`, a count of units turned into bytes."""

    def parse(text: str) -> float | int:
        value = float(text)
        if not math.isfinite(value) or not ok(value):
            raise ValueError(text)
        return int(value * unit) if unit else value

    return Kind(parse, accepted)


def choice(choices: tuple[str, ...]) -> Kind:
    """One of `choices`, in any case."""
    return Kind(lambda text: named(text.lower() if text.lower() in choices else None), ", ".join(choices))


def unless_blank(kind: Kind) -> Kind:
    """`kind`, or None for blank text (the variable unset)."""
    return Kind(lambda text: kind.parse(text) if text else None, kind.accepted, secret=kind.secret)


def at_least_one(text: str) -> int:
    """A whole number >= 1."""
    return named(int(text) if text.isdecimal() and int(text) >= 1 else None)


def secret_text(raw: bytes) -> bytes:
    """A secret of at least `MIN_SECRET_BYTES` bytes, surrounding whitespace stripped."""
    secret = raw.strip()
    return named(secret if len(secret) >= MIN_SECRET_BYTES else None)


def secret_file(path: str) -> bytes:
    """The secret held by the file at `path` (`secret_text`)."""
    try:
        with open(path, "rb") as f:
            return secret_text(f.read())
    except OSError as e:
        raise ValueError(path) from e


def non_blank(text: str) -> str:
    """Text that is not blank, stripped."""
    return named(text.strip() or None)


def master_address(text: str) -> str:
    """`host:port`, the port in 1-65535."""
    host, _, port = text.rpartition(":")
    return named(text if host and port.isdecimal() and 0 < int(port) < 65536 else None)


def metadata_url(text: str) -> str:
    """A URL of a `METADATA_SCHEMES` scheme, with a host."""
    url = urlsplit(text)
    return named(text if url.scheme in METADATA_SCHEMES and url.hostname else None)
