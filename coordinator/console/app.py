"""The console's Starlette app: sign-in, the pages, the JSON API and its OpenAPI document.

Rules:
- Who is calling comes only from the session cookie: its session (:mod:`.sessions`) names a
  token hash, which the store authenticates again on every request (:mod:`.reads`), so a
  revoked token or a changed role applies at once. No session: a page redirects to the sign-in
  page, the API answers 401; nothing else is read first.
- Every state-changing request (sign-in, sign-out, cancel) needs a CSRF token checked here, on
  the server: the session's own token in a form field or the ``X-CSRF-Token`` header; sign-in
  (before there is a session) a double-submit token whose cookie the sign-in page set. The
  cookies are also ``SameSite=Strict``, so another site cannot even send them.
- The session cookie is ``HttpOnly``, ``Secure``, ``SameSite=Strict``, ``Path=/`` and expires
  with its session; a refused sign-in sets no cookie at all.
- A request body is read only up to :data:`MAX_BODY_BYTES`. Live streams are bounded: at most
  :data:`MAX_STREAMS` at once, one store read per :data:`STREAM_POLL_S` each, for at most
  :data:`STREAM_MAX_S` (the browser's EventSource reconnects).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import anyio
import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..auth import USER_PREFIX, hash_credential
from ..clock import now_ms
from ..lifecycle.states import TERMINAL_JOB_STATES
from ..values.users import User
from . import pages
from .errors import ConsoleError, http_errors
from .openapi import API, CSRF_HEADER, PREFIX, SESSION_COOKIE, openapi_document
from .reads import ConsoleReads, JobFilter
from .sessions import Session, SessionBook
from .views import (
    cancel_json,
    delivery_json,
    fleet_json,
    job_json,
    node_json,
    series_csv,
    series_json,
    tags_json,
    user_json,
)

log = logging.getLogger(__name__)

#: The double-submit cookie the sign-in page sets; the sign-in form carries the same value.
SIGN_IN_COOKIE = "tp_console_sign_in"
SIGN_IN_COOKIE_S = 600
MAX_BODY_BYTES = 16 * 1024
MAX_STREAMS = 200
STREAM_POLL_S = 1.0
STREAM_MAX_S = 600.0
MAX_TOKEN_CHARS = 200
#: Buckets a series read gives when the caller names none (QuerySeries' own default).
DEFAULT_BUCKETS = 1000
#: Runs one Charts page overlays at most (each is one bounded read per tag).
MAX_CHART_RUNS = 8
#: The files under static/ the console serves, and their media types; uPlot is vendored there
#: as its built files (docs/console.md says how to refresh it).
STATIC = {
    "console.css": "text/css",
    "console.js": "text/javascript",
    "charts.js": "text/javascript",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
}

_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'; "
    "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Strict-Transport-Security": "max-age=31536000",
    "X-Frame-Options": "DENY",
}


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class _SecurityHeaders:
    """Adds :data:`_HEADERS` to every response the app sends, refusals and 404s included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                have = {k.lower() for k, _ in headers}
                for key, value in _HEADERS.items():
                    if key.lower().encode() not in have:
                        headers.append((key.lower().encode(), value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


@attrs.frozen
class Caller:
    """A signed-in request: its session and the user the store says its token belongs to."""

    session: Session
    user: User


@attrs.define(eq=False)
class Console:
    """The handlers, over the console's reads and its sessions."""

    reads: ConsoleReads
    book: SessionBook
    closing: anyio.Event = attrs.field(factory=anyio.Event)
    streams: int = 0

    # ----- who is calling -------------------------------------------------------------------

    async def caller(self, request: Request) -> Caller | None:
        """The signed-in caller, or None (no cookie, an unknown or expired session, or a token
        the store no longer accepts: that session is closed)."""
        session = self.book.find(request.cookies.get(SESSION_COOKIE, ""), now_ms())
        if session is None:
            return None
        try:
            with http_errors():
                user = await self.reads.user(session.token_hash)
        except ConsoleError as exc:
            if exc.status != 401:
                raise
            self.book.close(session.session_id)
            log.info("console session closed; its token is refused user=%s", session.user)
            return None
        return Caller(session, user)

    async def api_caller(self, request: Request) -> Caller:
        found = await self.caller(request)
        if found is None:
            raise ConsoleError(
                401,
                "this call needs a console session. Sign in at /sign-in with your user token "
                "(the one tp uses), then send the session cookie it sets.",
            )
        return found

    @staticmethod
    def check_csrf(caller: Caller, presented: str) -> None:
        if not caller.session.csrf_matches(presented):
            raise ConsoleError(
                403,
                "this change carries no valid CSRF token, so it was refused and nothing changed. "
                f"Send the csrf_token of GET {PREFIX}/session in the {CSRF_HEADER} header (the "
                "console's own forms do this).",
            )

    # ----- sign-in and sign-out -------------------------------------------------------------

    async def sign_in_form(self, request: Request) -> Response:
        if await self.caller(request) is not None:
            return RedirectResponse("/fleets", 303)
        token = secrets.token_urlsafe(32)
        response = HTMLResponse(pages.sign_in_page(token))
        _set_cookie(response, SIGN_IN_COOKIE, token, SIGN_IN_COOKIE_S)
        return response

    async def sign_in(self, request: Request) -> Response:
        form = await _form(request)
        expected = request.cookies.get(SIGN_IN_COOKIE, "")
        presented = form.get("csrf_token", "")
        if not expected or not secrets.compare_digest(expected.encode(), presented.encode()):
            return _refused_sign_in(
                403,
                "This sign-in did not come from this console's sign-in page (its CSRF token is "
                "missing or wrong). Open the sign-in page again and sign in there.",
            )
        token = form.get("token", "").strip()
        if not token.startswith(USER_PREFIX) or len(token) > MAX_TOKEN_CHARS:
            return _refused_sign_in(
                401,
                f"That is not a user token. Paste a token that starts with {USER_PREFIX}: the one "
                "tp uses, from the token file in your tp context.",
            )
        token_hash = hash_credential(token)
        try:
            with http_errors():
                user = await self.reads.user(token_hash)
        except ConsoleError as exc:
            if exc.status != 401:
                raise
            return _refused_sign_in(401, exc.message[:1].upper() + exc.message[1:])
        session = self.book.open(user.name, token_hash, now_ms())
        log.info("console sign-in user=%s sessions=%d", user.name, len(self.book))
        response = RedirectResponse("/fleets", 303)
        _set_cookie(response, SESSION_COOKIE, session.session_id, self.book.lifetime_ms // 1000)
        response.delete_cookie(SIGN_IN_COOKIE, path="/", secure=True, httponly=True,
                               samesite="strict")  # fmt: skip
        return response

    async def sign_out(self, request: Request) -> Response:
        caller = await self.caller(request)
        if caller is not None:
            form = await _form(request)
            self.check_csrf(caller, form.get("csrf_token", ""))
            self.book.close(caller.session.session_id)
            log.info("console sign-out user=%s", caller.user.name)
        response = RedirectResponse("/sign-in", 303)
        response.delete_cookie(SESSION_COOKIE, path="/", secure=True, httponly=True,
                               samesite="strict")  # fmt: skip
        return response

    # ----- pages ------------------------------------------------------------------------------

    async def page(self, request: Request, render: Callable[[Caller], Awaitable[str]]) -> Response:
        caller = await self.caller(request)
        if caller is None:
            return RedirectResponse("/sign-in", 303)
        try:
            with http_errors():
                return HTMLResponse(await render(caller))
        except ConsoleError as exc:
            body = pages.error_page(
                "Refused" if exc.status in (401, 403) else "Not shown",
                exc.message[:1].upper() + exc.message[1:],
                caller.user,
                caller.session.csrf_token,
            )
            return HTMLResponse(body, exc.status)

    async def home(self, request: Request) -> Response:
        signed_in = await self.caller(request) is not None
        return RedirectResponse("/fleets" if signed_in else "/sign-in", 303)

    async def fleets_page(self, request: Request) -> Response:
        async def render(c: Caller) -> str:
            return pages.fleets_page(await self.reads.fleets(), c.user, c.session.csrf_token)

        return await self.page(request, render)

    async def fleet_page(self, request: Request) -> Response:
        async def render(c: Caller) -> str:
            fleet, nodes = await self.reads.fleet(request.path_params["name"])
            return pages.fleet_page(fleet, nodes, c.user, c.session.csrf_token)

        return await self.page(request, render)

    async def jobs_page(self, request: Request) -> Response:
        where = _job_filter(request)

        async def render(c: Caller) -> str:
            jobs = await self.reads.jobs(c.user, where)
            return pages.jobs_page(
                jobs, where.project, where.state, where.owner, c.user, c.session.csrf_token
            )

        return await self.page(request, render)

    async def job_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]

        async def render(c: Caller) -> str:
            job = await self.reads.job(c.user, run_id)
            delivery = await self.reads.delivery(c.user, run_id)
            return pages.job_page(job, delivery, c.user, c.session.csrf_token)

        return await self.page(request, render)

    async def cancel_form(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]

        async def render(c: Caller) -> str:
            form = await _form(request)
            self.check_csrf(c, form.get("csrf_token", ""))
            await self.reads.cancel(c.user, run_id, form.get("reason", ""))
            return ""

        response = await self.page(request, render)
        if response.status_code == 200:
            return RedirectResponse(f"/jobs/{run_id}", 303)
        return response

    async def charts_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        runs = _chart_runs(run_id, request.query_params.getlist("run"))

        async def render(c: Caller) -> str:
            found: list[tuple[str, list[str]]] = []
            for run in runs:
                _, tags = await self.reads.tags(c.user, run, 0)
                found.append((run, [t.tag for t in tags]))
            picked = request.query_params.getlist("tag")
            return pages.charts_page(run_id, found, picked, c.user, c.session.csrf_token)

        return await self.page(request, render)

    # ----- the JSON API -----------------------------------------------------------------------

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def session(self, request: Request, c: Caller) -> Response:
        return JSONResponse(
            {
                "user": user_json(c.user),
                "csrf_token": c.session.csrf_token,
                "expires_at_ms": c.session.expires_at_ms,
            }
        )

    async def fleets(self, request: Request, c: Caller) -> Response:
        return JSONResponse({"fleets": [fleet_json(f) for f in await self.reads.fleets()]})

    async def fleet(self, request: Request, c: Caller) -> Response:
        fleet, nodes = await self.reads.fleet(request.path_params["name"])
        return JSONResponse({"fleet": fleet_json(fleet), "nodes": [node_json(n) for n in nodes]})

    async def jobs(self, request: Request, c: Caller) -> Response:
        jobs = await self.reads.jobs(c.user, _job_filter(request))
        return JSONResponse({"jobs": [job_json(j) for j in jobs]})

    async def job(self, request: Request, c: Caller) -> Response:
        run_id = request.path_params["run_id"]
        job = await self.reads.job(c.user, run_id)
        delivery = await self.reads.delivery(c.user, run_id)
        return JSONResponse(
            {"job": job_json(job), "delivery": [delivery_json(d) for d in delivery]}
        )

    async def cancel(self, request: Request, c: Caller) -> Response:
        self.check_csrf(c, request.headers.get(CSRF_HEADER, ""))
        body = await _body(request)
        reason = ""
        if body:
            try:
                data = json.loads(body)
            except ValueError:
                data = None
            if not isinstance(data, dict) or not isinstance(data.get("reason", ""), str):
                raise ConsoleError(
                    400, 'the body is not {"reason": "<text>"}. Send JSON like that, or no body.'
                )
            reason = data.get("reason", "")
        outcome = await self.reads.cancel(c.user, request.path_params["run_id"], reason)
        return JSONResponse(cancel_json(outcome))

    async def job_events(self, request: Request, c: Caller) -> Response:
        run_id = request.path_params["run_id"]
        job = await self.reads.job(c.user, run_id)  # refused here, before any stream opens
        if self.streams >= MAX_STREAMS:
            raise ConsoleError(
                429,
                f"the console already serves {MAX_STREAMS} live streams. Reload the page later.",
            )
        return StreamingResponse(
            self._job_stream(c, run_id, job_json(job)), media_type="text/event-stream"
        )

    async def _job_stream(
        self, c: Caller, run_id: str, first: dict[str, Any]
    ) -> AsyncIterator[str]:
        """The Job as an SSE ``job`` event at first and whenever its states change; ends when
        the Job ends, the session or its token stops being accepted, after
        :data:`STREAM_MAX_S`, or when the console closes."""
        self.streams += 1
        try:
            yield _event("job", first)
            last = _states(first)
            with anyio.move_on_after(STREAM_MAX_S):
                while first["state"] not in TERMINAL_JOB_STATES:
                    with anyio.move_on_after(STREAM_POLL_S):
                        await self.closing.wait()
                    if self.closing.is_set():
                        return
                    if self.book.find(c.session.session_id, now_ms()) is None:
                        return
                    try:
                        with http_errors():
                            user = await self.reads.user(c.session.token_hash)
                            first = job_json(await self.reads.job(user, run_id))
                    except ConsoleError:
                        return
                    if _states(first) != last:
                        last = _states(first)
                        yield _event("job", first)
                    else:
                        yield ": still here\n\n"
        finally:
            self.streams -= 1

    async def metrics(self, request: Request, c: Caller) -> Response:
        run_id = request.path_params["run_id"]
        attempt = _int_or(request, "attempt", 0)
        found, tags = await self.reads.tags(c.user, run_id, attempt)
        return JSONResponse(tags_json(run_id, found, tags))

    async def series(self, request: Request, c: Caller) -> Response:
        run_id = request.path_params["run_id"]
        q = request.query_params
        kind = q.get("format", "json")
        if kind not in ("json", "csv"):
            raise ConsoleError(400, f"format is {kind!r}; ask for json (the default) or csv.")
        first = _int_query(request, "from")
        last = _int_query(request, "to")
        steps = None
        if first is not None or last is not None:
            steps = (-(2**63) if first is None else first, 2**63 - 1 if last is None else last)
        result = await self.reads.series(
            c.user,
            run_id,
            q.get("tag", ""),
            _int_or(request, "attempt", 0),
            _int_or(request, "buckets", DEFAULT_BUCKETS),
            steps,
        )
        if kind == "csv":
            name = f"{run_id}-{result.tag}".replace("/", "_")
            return Response(
                series_csv(result),
                media_type="text/csv",
                headers={"Content-Disposition": f'attachment; filename="{_safe_name(name)}.csv"'},
            )
        return JSONResponse(series_json(run_id, result, steps))

    def api(
        self, handler: Callable[[Request, Caller], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` behind the session check and the error translation."""

        async def endpoint(request: Request) -> Response:
            try:
                with http_errors():
                    return await handler(request, await self.api_caller(request))
            except ConsoleError as exc:
                return JSONResponse({"error": exc.message[:1].upper() + exc.message[1:]},
                                    exc.status)  # fmt: skip

        return endpoint


def _states(job: dict[str, Any]) -> tuple[Any, ...]:
    return (
        job["state"],
        job["state_reason"],
        tuple(
            (a["number"], a["state"], tuple((m["index"], m["state"]) for m in a["members"]))
            for a in job["attempts"]
        ),
    )


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _job_filter(request: Request) -> JobFilter:
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


def _int_or(request: Request, name: str, default: int) -> int:
    found = _int_query(request, name)
    return default if found is None else found


def _int_query(request: Request, name: str) -> int | None:
    """The integer query parameter ``name``; None when absent; a sentence when not an
    integer."""
    text = request.query_params.get(name, "").strip()
    if not text:
        return None
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
        raise ConsoleError(400, f"{name} is {text[:40]!r}; it must be a whole number.")
    return int(text)


def _chart_runs(run_id: str, more: list[str]) -> list[str]:
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


def _safe_name(name: str) -> str:
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "-_.") else "_" for ch in name)


def _set_cookie(response: Response, name: str, value: str, max_age_s: int) -> None:
    response.set_cookie(
        name, value, max_age=max_age_s, path="/", secure=True, httponly=True, samesite="strict"
    )


def _refused_sign_in(status: int, message: str) -> Response:
    return HTMLResponse(pages.sign_in_page("", message), status)


async def _body(request: Request) -> bytes:
    """The request body, refused past :data:`MAX_BODY_BYTES` without reading the rest."""
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > MAX_BODY_BYTES:
            raise ConsoleError(
                413, f"the request body is over {MAX_BODY_BYTES} bytes. Send a smaller one."
            )
    return bytes(received)


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body's fields (the first value of each)."""
    body = await _body(request)
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def console_app(reads: ConsoleReads, book: SessionBook) -> tuple[ASGIApp, Console]:
    """The console's ASGI app, and its handlers' owner (to close live streams on shutdown)."""
    console = Console(reads, book)
    files = {name: (_static(name), media) for name, media in STATIC.items()}

    async def static(request: Request) -> Response:
        found = files.get(request.path_params["name"])
        if found is None:
            return Response("Not Found", 404, media_type="text/plain")
        return Response(found[0], media_type=found[1])

    async def openapi(request: Request) -> Response:
        return await console.openapi(request)

    async def sign_in(request: Request) -> Response:
        try:
            return await console.sign_in(request)
        except ConsoleError as exc:
            return _refused_sign_in(exc.status, exc.message[:1].upper() + exc.message[1:])

    async def sign_out(request: Request) -> Response:
        try:
            return await console.sign_out(request)
        except ConsoleError as exc:
            return HTMLResponse(
                pages.error_page("Refused", exc.message[:1].upper() + exc.message[1:], None, ""),
                exc.status,
            )

    routes = [
        Route("/", console.home),
        Route("/sign-in", console.sign_in_form, methods=["GET"]),
        Route("/sign-in", sign_in, methods=["POST"]),
        Route("/sign-out", sign_out, methods=["POST"]),
        Route("/fleets", console.fleets_page),
        Route("/fleets/{name}", console.fleet_page),
        Route("/jobs", console.jobs_page),
        Route("/jobs/{run_id}", console.job_page),
        Route("/jobs/{run_id}/cancel", console.cancel_form, methods=["POST"]),
        Route("/jobs/{run_id}/charts", console.charts_page),
        Route("/static/{name}", static),
    ]
    for route in API:
        handler = getattr(console, route.handler)
        endpoint = handler if route.public else console.api(handler)
        routes.append(Route(PREFIX + route.path, endpoint, methods=[route.method.upper()]))
    return _SecurityHeaders(Starlette(routes=routes)), console
