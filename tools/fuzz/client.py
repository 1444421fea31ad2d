"""Sending one fuzz case to the server over HTTP and reading its answer (`send`), and asking
`/health` after it on the same connection (`after_request`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import httpx

from tools.fuzz.cases import Case


@dataclass
class Outcome:
    """What the server answered: status (None: no answer), message, token ids per choice."""

    status: int | None
    message: str = ""
    token_ids: list[list[int]] | None = None
    stream_error_code: int | None = None
    kind: str = ""  # "", "timeout", "connection"
    seconds: float = 0.0


def error_message(text: str) -> str:
    """The message of an error body (vLLM: {"error": {"message": ...}}; FastAPI: {"detail": ...})."""
    try:
        data = json.loads(text)
    except ValueError:
        return ""
    if isinstance(data, dict):
        err = data.get("error", data)
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        return str(msg or "")
    return ""


def choice_tokens(choices: list[dict], into: dict[int, list[int]]) -> None:
    """Add the choices' token ids to `into`, by choice index."""
    for choice in choices:
        into.setdefault(choice.get("index", 0), []).extend(choice.get("token_ids") or [])


async def sse_lines(resp: httpx.Response):
    """The lines of an event stream, split at LF, CR LF or CR alone as the SSE format says, not at
    the other line breaks `str.splitlines` (and httpx's `aiter_lines`) also split at: an event's
    JSON may hold U+2028 or U+0085 unescaped."""
    pending = ""
    async for text in resp.aiter_text():
        *lines, pending = re.split(r"\r\n|\n|\r", pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending


async def read_stream(resp: httpx.Response, case: Case, out: Outcome) -> None:
    """Read a stream's events: token ids per choice, an error event; hang up early if asked."""
    tokens: dict[int, list[int]] = {}
    events = 0
    async for line in sse_lines(resp):
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            out.stream_error_code = int(event["error"].get("code") or 0)
            out.message = str(event["error"].get("message") or "")
            break
        choice_tokens(event.get("choices") or [], tokens)
        events += 1
        if case.disconnect_after is not None and events >= case.disconnect_after:
            return
    out.token_ids = [tokens[i] for i in sorted(tokens)]


async def exchange(http: httpx.AsyncClient, url: str, case: Case, out: Outcome) -> None:
    """POST `case` and read the whole answer (or the stream up to the hang-up) into `out`."""
    async with http.stream("POST", url + case.endpoint, json=case.body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.message = error_message((await resp.aread()).decode(errors="replace"))
        elif case.body.get("stream"):
            await read_stream(resp, case, out)
        else:
            tokens: dict[int, list[int]] = {}
            choice_tokens(json.loads(await resp.aread()).get("choices") or [], tokens)
            out.token_ids = [tokens[i] for i in sorted(tokens)]


async def send(http: httpx.AsyncClient, url: str, case: Case, timeout: float) -> Outcome:
    """Send `case` within `timeout` seconds; a timeout or a dropped connection is the outcome's kind."""
    start = time.monotonic()
    out = Outcome(status=None)
    try:
        await asyncio.wait_for(exchange(http, url, case, out), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        out.kind = "timeout"
    except (httpx.HTTPError, ValueError) as err:
        out.kind = "connection"
        out.message = f"{type(err).__name__}: {err}"
    out.seconds = time.monotonic() - start
    return out


async def health(http: httpx.AsyncClient, url: str) -> str:
    """ "" if `/health` answers 200 within 30 s, else what it answered."""
    try:
        status = (await http.get(url + "/health", timeout=30)).status_code
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"
    return "" if status == 200 else f"HTTP {status}"


async def after_request(http: httpx.AsyncClient, url: str) -> tuple[str, str]:
    """`/health` on the connection the request used, then, if that fails, on a new one: (what the
    first answered, what the new one answered); ("x", "") means the server closed the
    request's keep-alive connection after its answer, ("x", "y") that the server is down."""
    first = await health(http, url)
    if not first:
        return "", ""
    async with httpx.AsyncClient() as fresh:
        return first, await health(fresh, url)
