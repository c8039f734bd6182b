"""The console's callers (who a request is, from its session cookie) and its JSON API under
``/api/v1``: the handlers :class:`~tuneplane.coordinator.console.app.Console` builds its pages on.

Rules: every handler reads through :class:`~tuneplane.coordinator.console.reads.ConsoleReads`,
the same store reads and authorization as the gRPC Api; a state-changing call checks the
session's CSRF token first; a live stream is bounded in number and in time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import anyio
import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..clock import now_ms
from ..config.values import DEFAULT_CONSOLE_STREAMS
from .errors import ConsoleError, http_errors
from .http_parts import (
    DEFAULT_BUCKETS,
    LOG_READ_BYTES,
    Caller,
    int_or,
    int_query,
    job_filter,
    log_query,
    natural,
    read_body,
    safe_name,
)
from .openapi import CSRF_HEADER, PREFIX, SESSION_COOKIE, openapi_document
from .reads import ConsoleReads
from .sessions import SessionBook
from .views import (
    cancel_json,
    decision_json,
    delivery_json,
    fleet_json,
    job_json,
    log_page_json,
    node_json,
    retry_json,
    series_csv,
    series_json,
    tags_json,
    user_json,
)

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class ConsoleHandlers:
    """The callers and the JSON API, over the console's reads and its sessions."""

    reads: ConsoleReads
    book: SessionBook
    closing: anyio.Event = attrs.field(factory=anyio.Event)
    # Live streams open now, and the most at once (``[console] max_streams``).
    streams: int = 0
    max_streams: int = DEFAULT_CONSOLE_STREAMS

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
        jobs = await self.reads.jobs(c.user, job_filter(request))
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
        body = await read_body(request)
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

    async def retry(self, request: Request, c: Caller) -> Response:
        self.check_csrf(c, request.headers.get(CSRF_HEADER, ""))
        outcome = await self.reads.retry(c.user, request.path_params["run_id"])
        return JSONResponse(retry_json(outcome))

    async def decisions(self, request: Request, c: Caller) -> Response:
        rows, older = await self.reads.decisions(c.user, request.path_params["run_id"])
        return JSONResponse({"decisions": [decision_json(r) for r in rows], "older": older})

    async def logs(self, request: Request, c: Caller) -> Response:
        q = log_query(request)
        max_bytes = natural(request, "max_bytes", LOG_READ_BYTES)
        if not 1 <= max_bytes <= LOG_READ_BYTES:
            raise ConsoleError(
                400, f"max_bytes is {max_bytes}; ask for 1 to {LOG_READ_BYTES} and read on from "
                "next_offset.",
            )  # fmt: skip
        page = await self.reads.logs(
            c.user, request.path_params["run_id"], (q.attempt, q.member), q.stream, q.offset,
            max_bytes,
        )  # fmt: skip
        return JSONResponse(log_page_json(page))

    async def metrics(self, request: Request, c: Caller) -> Response:
        run_id = request.path_params["run_id"]
        attempt = int_or(request, "attempt", 0)
        found, tags = await self.reads.tags(c.user, run_id, attempt)
        return JSONResponse(tags_json(run_id, found, tags))

    async def series(self, request: Request, c: Caller) -> Response:
        run_id = request.path_params["run_id"]
        q = request.query_params
        kind = q.get("format", "json")
        if kind not in ("json", "csv"):
            raise ConsoleError(400, f"format is {kind!r}; ask for json (the default) or csv.")
        first = int_query(request, "from")
        last = int_query(request, "to")
        steps = None
        if first is not None or last is not None:
            steps = (-(2**63) if first is None else first, 2**63 - 1 if last is None else last)
        result = await self.reads.series(
            c.user,
            run_id,
            q.get("tag", ""),
            int_or(request, "attempt", 0),
            int_or(request, "buckets", DEFAULT_BUCKETS),
            steps,
        )
        if kind == "csv":
            name = f"{run_id}-{result.tag}".replace("/", "_")
            return Response(
                series_csv(result),
                media_type="text/csv",
                headers={"Content-Disposition": f'attachment; filename="{safe_name(name)}.csv"'},
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
