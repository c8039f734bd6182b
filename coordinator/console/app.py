"""The console's Starlette app: sign-in, the pages, the JSON API and its OpenAPI document.

Rules:
- Who is calling comes only from the session cookie: its session (:mod:`.sessions`) names a
  token hash, which the store authenticates again on every request (:mod:`.reads`), so a
  revoked token or a changed role applies at once. No session: a page redirects to the sign-in
  page, the API answers 401; nothing else is read first.
- Every state-changing request (sign-in, sign-out, cancel, retry) needs a CSRF token checked
  here, on the server: the session's own token in a form field or the ``X-CSRF-Token``
  header; sign-in (before there is a session) a double-submit token whose cookie the sign-in
  page set. The
  cookies are also ``SameSite=Strict``, so another site cannot even send them.
- The session cookie is ``HttpOnly``, ``Secure``, ``SameSite=Strict``, ``Path=/`` and expires
  with its session; a refused sign-in sets no cookie at all.
- A request body is read only up to :data:`MAX_BODY_BYTES`. Live streams are bounded: at most
  ``[console] max_streams`` at once, one store read per :data:`STREAM_POLL_S` each, for at
  most :data:`STREAM_MAX_S` (the browser's EventSource reconnects): :mod:`.live`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from importlib import resources

import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..auth import USER_PREFIX, hash_credential
from ..clock import now_ms
from ..config.values import DEFAULT_CONSOLE_STREAMS
from . import job_page, pages
from .errors import ConsoleError, http_errors
from .http_parts import (
    LOG_READ_BYTES,
    MAX_TOKEN_CHARS,
    SIGN_IN_COOKIE,
    SIGN_IN_COOKIE_S,
    Caller,
    chart_runs,
    job_filter,
    log_query,
    read_form,
    refused_sign_in,
    set_cookie,
)
from .live import LiveHandlers
from .openapi import API, PREFIX, SESSION_COOKIE
from .reads import ConsoleReads
from .sessions import SessionBook

log = logging.getLogger(__name__)

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


@attrs.define(eq=False)
class Console(LiveHandlers):
    """The pages and the sign-in, over the console's reads and its sessions (the callers and
    the JSON API are :class:`~tuneplane.coordinator.console.api_handlers.ConsoleHandlers`,
    its live streams :class:`~tuneplane.coordinator.console.live.LiveHandlers`)."""

    async def sign_in_form(self, request: Request) -> Response:
        if await self.caller(request) is not None:
            return RedirectResponse("/fleets", 303)
        token = secrets.token_urlsafe(32)
        response = HTMLResponse(pages.sign_in_page(token))
        set_cookie(response, SIGN_IN_COOKIE, token, SIGN_IN_COOKIE_S)
        return response

    async def sign_in(self, request: Request) -> Response:
        form = await read_form(request)
        expected = request.cookies.get(SIGN_IN_COOKIE, "")
        presented = form.get("csrf_token", "")
        if not expected or not secrets.compare_digest(expected.encode(), presented.encode()):
            return refused_sign_in(
                403,
                "This sign-in did not come from this console's sign-in page (its CSRF token is "
                "missing or wrong). Open the sign-in page again and sign in there.",
            )
        token = form.get("token", "").strip()
        if not token.startswith(USER_PREFIX) or len(token) > MAX_TOKEN_CHARS:
            return refused_sign_in(
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
            return refused_sign_in(401, exc.message[:1].upper() + exc.message[1:])
        session = self.book.open(user.name, token_hash, now_ms())
        log.info("console sign-in user=%s sessions=%d", user.name, len(self.book))
        response = RedirectResponse("/fleets", 303)
        set_cookie(response, SESSION_COOKIE, session.session_id, self.book.lifetime_ms // 1000)
        response.delete_cookie(SIGN_IN_COOKIE, path="/", secure=True, httponly=True,
                               samesite="strict")  # fmt: skip
        return response

    async def sign_out(self, request: Request) -> Response:
        caller = await self.caller(request)
        if caller is not None:
            form = await read_form(request)
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
        where = job_filter(request)

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
            decisions = await self.reads.decisions(c.user, run_id)
            logs, said = None, ""
            try:
                with http_errors():
                    q = log_query(request)
                    if job.attempts:
                        member = (q.attempt, q.member)
                        logs = await self.reads.logs(
                            c.user, run_id, member, q.stream, q.offset, LOG_READ_BYTES
                        )
            except ConsoleError as exc:
                if exc.status not in (400, 404):
                    raise
                said = exc.message[:1].upper() + exc.message[1:]  # the rest of the page stands
            # Only a derived Job has a source to read from its resolved JobSpec.
            source = await self.reads.derivation(c.user, run_id) if job.init_from else None
            shown = job_page.JobShown(job, delivery, decisions, logs, said, source)
            return job_page.job_page(shown, c.user, c.session.csrf_token)

        return await self.page(request, render)

    async def change_form(
        self, request: Request, change: Callable[[Caller, dict[str, str]], Awaitable[object]]
    ) -> Response:
        """A Job page's button: the session's CSRF token, then ``change`` (the same call the
        API makes), then back to the Job page; a refusal is a page that says why."""
        run_id = request.path_params["run_id"]

        async def render(c: Caller) -> str:
            form = await read_form(request)
            self.check_csrf(c, form.get("csrf_token", ""))
            await change(c, form)
            return ""

        response = await self.page(request, render)
        if response.status_code == 200:
            return RedirectResponse(f"/jobs/{run_id}", 303)
        return response

    async def cancel_form(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]

        async def cancel(c: Caller, form: dict[str, str]) -> object:
            return await self.reads.cancel(c.user, run_id, form.get("reason", ""))

        return await self.change_form(request, cancel)

    async def retry_form(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]

        async def retry(c: Caller, form: dict[str, str]) -> object:
            return await self.reads.retry(c.user, run_id)

        return await self.change_form(request, retry)

    async def charts_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        runs = chart_runs(run_id, request.query_params.getlist("run"))

        async def render(c: Caller) -> str:
            found: list[tuple[str, list[str]]] = []
            for run in runs:
                _, tags = await self.reads.tags(c.user, run, 0)
                found.append((run, [t.tag for t in tags]))
            picked = request.query_params.getlist("tag")
            return pages.charts_page(run_id, found, picked, c.user, c.session.csrf_token)

        return await self.page(request, render)

    # ----- the JSON API -----------------------------------------------------------------------


def console_app(
    reads: ConsoleReads, book: SessionBook, max_streams: int = DEFAULT_CONSOLE_STREAMS
) -> tuple[ASGIApp, Console]:
    """The console's ASGI app, and its handlers' owner (to close live streams on shutdown);
    it serves at most ``max_streams`` live streams at once."""
    console = Console(reads, book, max_streams=max_streams)
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
            return refused_sign_in(exc.status, exc.message[:1].upper() + exc.message[1:])

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
        Route("/jobs/{run_id}/retry", console.retry_form, methods=["POST"]),
        Route("/jobs/{run_id}/charts", console.charts_page),
        Route("/static/{name}", static),
    ]
    for route in API:
        handler = getattr(console, route.handler)
        endpoint = handler if route.public else console.api(handler)
        routes.append(Route(PREFIX + route.path, endpoint, methods=[route.method.upper()]))
    return _SecurityHeaders(Starlette(routes=routes)), console
