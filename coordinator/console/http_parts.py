"""What the console reads from requests and writes to responses, and its limits: the
sign-in cookie, body and token sizes, live streams, chart reads; the signed-in caller.

Rules: every limit is a constant here, so a reader finds them in one place; a form body is read
whole only up to :data:`MAX_BODY_BYTES` and parsed with the standard library.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

import attrs
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from ..values.users import User
from . import pages
from .errors import ConsoleError
from .reads import JobFilter
from .sessions import Session

#: The double-submit cookie the sign-in page sets; the sign-in form carries the same value.
SIGN_IN_COOKIE = "tp_console_sign_in"
SIGN_IN_COOKIE_S = 600
MAX_BODY_BYTES = 16 * 1024
STREAM_POLL_S = 1.0
STREAM_MAX_S = 600.0
MAX_TOKEN_CHARS = 200
#: Buckets a series read gives when the caller names none (QuerySeries' own default).
DEFAULT_BUCKETS = 1000
#: Runs one Charts page overlays at most (each is one bounded read per tag).
MAX_CHART_RUNS = 8
#: The most log bytes one read of the console reads (a page, or one poll of a log stream).
LOG_READ_BYTES = 256 * 1024


@attrs.frozen
class Caller:
    """A signed-in request: its session and the user the store says its token belongs to."""

    session: Session
    user: User


def job_states(job: dict[str, Any]) -> tuple[Any, ...]:
    return (
        job["state"],
        job["state_reason"],
        tuple(
            (a["number"], a["state"], tuple((m["index"], m["state"]) for m in a["members"]))
            for a in job["attempts"]
        ),
    )


def sse_event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def job_filter(request: Request) -> JobFilter:
    q = request.query_params
    limit_text = q.get("limit", "")
    if limit_text and not (limit_text.isascii() and limit_text.isdigit() and len(limit_text) < 8):
        limit = -1
    else:
        limit = int(limit_text) if limit_text else JobFilter().limit
    return JobFilter(
        project=q.get("project", "").strip(),
        state=q.get("state", "").strip(),
        owner=q.get("owner", "").strip(),
        limit=limit,
    )


def int_or(request: Request, name: str, default: int) -> int:
    found = int_query(request, name)
    return default if found is None else found


def int_query(request: Request, name: str) -> int | None:
    """The integer query parameter ``name``; None when absent; a sentence when not an
    integer."""
    text = request.query_params.get(name, "").strip()
    if not text:
        return None
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
        raise ConsoleError(400, f"{name} is {text[:40]!r}; it must be a whole number.")
    return int(text)


def natural(request: Request, name: str, default: int) -> int:
    """A whole-number query parameter that may not be negative (``default`` when absent)."""
    found = int_or(request, name, default)
    if found < 0:
        raise ConsoleError(400, f"{name} is {found}; it must be 0 or more.")
    return found


@attrs.frozen
class LogQuery:
    """Which log a request reads: the member (attempt 0: the latest), the stream, the byte
    offset to read from."""

    attempt: int
    member: int
    stream: str
    offset: int


def log_query(request: Request) -> LogQuery:
    return LogQuery(
        attempt=natural(request, "attempt", 0),
        member=natural(request, "member", 0),
        stream=request.query_params.get("stream", "stdout").strip(),
        offset=natural(request, "from", 0),
    )


def chart_runs(run_id: str, more: list[str]) -> list[str]:
    """The runs a Charts page overlays: its own, then ``run`` parameters, once each."""
    runs = [run_id]
    for run in more:
        run = run.strip()
        if run and run not in runs:
            runs.append(run)
    if len(runs) > MAX_CHART_RUNS:
        raise ConsoleError(
            400, f"{len(runs)} runs asked for; a Charts page overlays at most {MAX_CHART_RUNS}."
        )
    return runs


def safe_name(name: str) -> str:
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "-_.") else "_" for ch in name)


def set_cookie(response: Response, name: str, value: str, max_age_s: int) -> None:
    response.set_cookie(
        name, value, max_age=max_age_s, path="/", secure=True, httponly=True, samesite="strict"
    )


def refused_sign_in(status: int, message: str) -> Response:
    return HTMLResponse(pages.sign_in_page("", message), status)


async def read_body(request: Request) -> bytes:
    """The request body, refused past :data:`MAX_BODY_BYTES` without reading the rest."""
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > MAX_BODY_BYTES:
            raise ConsoleError(
                413, f"the request body is over {MAX_BODY_BYTES} bytes. Send a smaller one."
            )
    return bytes(received)


async def read_form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body's fields (the first value of each)."""
    body = await read_body(request)
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}
