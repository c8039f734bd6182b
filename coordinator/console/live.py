"""The console's live streams (server-sent events): a Job, the Jobs list, a member's log and a
Charts page's tags, each followed by polling the same reads its page makes.

Rules: a stream is bounded three ways, by :func:`LiveHandlers.open_stream` alone: at most
``max_streams`` at once (``[console] max_streams``; beyond it a 429 with a sentence), one poll
(a bounded store read) per :data:`STREAM_POLL_S` each, for at most :data:`STREAM_MAX_S` (the
browser's EventSource reconnects). A slot is taken when the check passes, with no await
between, and given back when the response has been answered to its end, whether the stream
finished, the client left or the server stopped it. Each poll authenticates the
session's token again and reads as that user, so a revoked token or a lost right ends the stream.
A stream is refused (with a sentence) before it opens when its first read is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import attrs
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..clock import now_ms
from ..lifecycle.states import TERMINAL_JOB_STATES
from ..values.users import User
from .api_handlers import ConsoleHandlers
from .errors import ConsoleError, http_errors
from .http_parts import (
    LOG_READ_BYTES,
    STREAM_MAX_S,
    STREAM_POLL_S,
    Caller,
    chart_runs,
    job_filter,
    job_states,
    log_query,
    sse_event,
)
from .views import job_json, log_page_json

#: One poll: read as the user, and answer the frames to send and whether the stream is done.
Poll = Callable[[User], Awaitable[tuple[list[str], bool]]]
_KEEPALIVE = ": still here\n\n"


class _Slotted(StreamingResponse):
    """An event stream holding one of the console's slots until it has been answered."""

    def __init__(self, frames: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(frames, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


@attrs.define(eq=False)
class LiveHandlers(ConsoleHandlers):
    """The JSON API's event streams."""

    def open_stream(self, c: Caller, first: list[str], done: bool, poll: Poll) -> Response:
        """``first`` at once, then ``poll`` once per :data:`STREAM_POLL_S` until it says done."""
        if self.streams >= self.max_streams:
            raise ConsoleError(
                429,
                f"the console already serves {self.max_streams} live streams, its most at once "
                "([console] max_streams). Reload the page later.",
            )
        self.streams += 1

        def release() -> None:
            self.streams -= 1

        return _Slotted(self._stream(c, first, done, poll), release)

    async def _stream(
        self, c: Caller, first: list[str], done: bool, poll: Poll
    ) -> AsyncIterator[str]:
        for frame in first:
            yield frame
        with anyio.move_on_after(STREAM_MAX_S):
            while not done:
                with anyio.move_on_after(STREAM_POLL_S):
                    await self.closing.wait()
                if self.closing.is_set():
                    return
                if self.book.find(c.session.session_id, now_ms()) is None:
                    return
                try:
                    with http_errors():
                        user = await self.reads.user(c.session.token_hash)
                        frames, done = await poll(user)
                except ConsoleError:
                    return
                for frame in frames or [_KEEPALIVE]:
                    yield frame

    async def job_events(self, request: Request, c: Caller) -> Response:
        """A ``job`` event with the Job at first and whenever its or its members' states
        change; done when the Job has ended."""
        run_id = request.path_params["run_id"]
        first = job_json(await self.reads.job(c.user, run_id))
        last = [job_states(first)]

        async def poll(user: User) -> tuple[list[str], bool]:
            job = job_json(await self.reads.job(user, run_id))
            done = job["state"] in TERMINAL_JOB_STATES
            if job_states(job) == last[0]:
                return [], done
            last[0] = job_states(job)
            return [sse_event("job", job)], done

        done = first["state"] in TERMINAL_JOB_STATES
        return self.open_stream(c, [sse_event("job", first)], done, poll)

    async def jobs_events(self, request: Request, c: Caller) -> Response:
        """A ``jobs`` event with the filtered list at first and whenever a Job enters, leaves
        or changes state in it."""
        where = job_filter(request)

        async def read(user: User) -> tuple[dict[str, Any], Any]:
            jobs = [job_json(j) for j in await self.reads.jobs(user, where)]
            return {"jobs": jobs}, [(j["run_id"], j["state"], j["state_reason"]) for j in jobs]

        first, key = await read(c.user)
        last = [key]

        async def poll(user: User) -> tuple[list[str], bool]:
            now, key = await read(user)
            if key == last[0]:
                return [], False
            last[0] = key
            return [sse_event("jobs", now)], False

        return self.open_stream(c, [sse_event("jobs", first)], False, poll)

    async def logs_events(self, request: Request, c: Caller) -> Response:
        """A ``log`` event per read that found bytes (each at most :data:`LOG_READ_BYTES`),
        from ``from`` on; done, with a last ``log`` event saying ``complete``, when the member's
        stream has ended."""
        run_id = request.path_params["run_id"]
        q = log_query(request)
        member = (q.attempt, q.member)

        async def read(user: User, offset: int) -> tuple[dict[str, Any], bool]:
            page = await self.reads.logs(user, run_id, member, q.stream, offset, LOG_READ_BYTES)
            return log_page_json(page), bool(page.pieces) or page.complete

        first, _ = await read(c.user, q.offset)
        at = [first["next_offset"]]

        async def poll(user: User) -> tuple[list[str], bool]:
            page, news = await read(user, at[0])
            at[0] = page["next_offset"]
            return ([sse_event("log", page)] if news else []), page["complete"]

        return self.open_stream(c, [sse_event("log", first)], first["complete"], poll)

    async def metrics_events(self, request: Request, c: Caller) -> Response:
        """A ``metrics`` event with each run's tags (points and last step) at first and
        whenever any run's points grow: the Charts page reads its charts again then."""
        runs = chart_runs(request.path_params["run_id"], request.query_params.getlist("run"))

        async def read(user: User) -> dict[str, Any]:
            found: dict[str, Any] = {}
            for run in runs:
                _, tags = await self.reads.tags(user, run, 0)
                found[run] = {t.tag: {"points": t.points, "last_step": t.last_step} for t in tags}
            return found

        first = await read(c.user)
        last = [first]

        async def poll(user: User) -> tuple[list[str], bool]:
            now = await read(user)
            if now == last[0]:
                return [], False
            last[0] = now
            return [sse_event("metrics", {"runs": now})], False

        return self.open_stream(c, [sse_event("metrics", {"runs": first})], False, poll)
