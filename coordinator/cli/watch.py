"""``tp job show RUN_ID --watch``: follow a Job until it is terminal.

Rules:
- On a terminal the view is a rich ``Live`` display redrawn in place; anywhere else (a pipe, a
  log file) the view is printed again only when the Job changed, so the output stays readable.
  With ``--json`` every change is one JSON object on one line.
- The watch only reads: Ctrl-C stops watching, restores the terminal and leaves the Job alone.
- Changes come on one WatchJob stream; against a coordinator without it (UNIMPLEMENTED: older
  than this ``tp``) the Job is polled with GetJob every ``--interval`` seconds instead, silently.
- A coordinator that stops answering is shown and retried; it does not end the watch.
  :class:`Outage` is that retry, also used by ``tp logs --follow``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from .. import lifecycle
from ..values.jobs import Job
from . import render
from .api_errors import ApiError, NotServed, RequestRefused
from .connection import Endpoint

log = logging.getLogger(__name__)
T = TypeVar("T")


@attrs.define
class Outage:
    """Polls through a coordinator that stops answering: a refusal still ends the caller, any
    other failure (unreachable, TLS, time ran out) is kept as :attr:`problem`, a sentence, and
    the poll returns None so the caller keeps what it had and tries again after ``interval_s``.
    """

    interval_s: float
    # Empty while the coordinator answers; else why it did not, ending in "Retrying every N s."
    problem: str = ""

    async def poll(self, fetch: Callable[[], Awaitable[T]]) -> T | None:
        try:
            value = await fetch()
        except RequestRefused:
            raise
        except ApiError as exc:
            self.failed(exc)
            return None
        self.problem = ""
        return value

    def failed(self, exc: ApiError) -> None:
        """Keep why the coordinator did not answer (``exc``, not a refusal) as :attr:`problem`."""
        self.problem = f"{exc} Retrying every {self.interval_s:g} s."
        log.debug("poll failed why=%s", exc)


def _fingerprint(job: Job) -> str:
    """What counts as a change worth printing again (not the clock)."""
    return render.to_json(job)


@attrs.define
class _View:
    """Shows the Job being watched: redrawn in place (``live``), or printed again on a change."""

    live: Live | None
    as_json: bool
    last: str = ""

    def show(self, job: Job | None, problem: str) -> None:
        if job is None:
            if problem and self.live is None:
                print(problem, file=sys.stderr, flush=True)
            return
        print_now = _fingerprint(job) + problem
        if self.live is not None:
            parts: list[RenderableType] = list(render.job_view(job))
            if problem:
                parts.append(Text(problem, style="yellow"))
            parts.append(Text("Watching; Ctrl-C stops watching (the Job continues)."))
            self.live.update(Group(*parts), refresh=True)
        elif print_now != self.last:
            _print(job, self.as_json, problem)
        self.last = print_now


async def _follow(endpoint: Endpoint, run_id: str, as_json: bool, interval_s: float) -> Job:
    """Follow ``run_id`` through WatchJob until it is terminal; a coordinator without WatchJob
    (older than this ``tp``) is polled with GetJob every ``interval_s`` instead. Either way an
    outage is shown and the watch tries again every ``interval_s``."""
    from .api_client import ApiClient

    out = render.console()
    live_mode = out.is_terminal and not as_json
    job: Job | None = None
    outage = Outage(interval_s)
    streaming = True
    async with ApiClient(endpoint) as api:
        live = Live(Text(f"Fetching Job {run_id}..."), console=out, auto_refresh=False)
        with live if live_mode else _NoLive():
            view = _View(live if live_mode else None, as_json)
            while True:
                if streaming:
                    try:
                        # The stream ends by itself after a terminal Job.
                        async for job in api.watch_job(run_id):
                            outage.problem = ""
                            view.show(job, "")
                    except NotServed:
                        log.debug("watch falls back to polling GetJob run_id=%s", run_id)
                        streaming = False
                        continue
                    except RequestRefused:
                        raise
                    except ApiError as exc:
                        outage.failed(exc)
                        view.show(job, outage.problem)
                    if job is not None and job.state in lifecycle.TERMINAL_JOB_STATES:
                        return job
                else:
                    job = await outage.poll(lambda: api.get_job(run_id)) or job
                    view.show(job, outage.problem)
                    if job is not None and job.state in lifecycle.TERMINAL_JOB_STATES:
                        return job
                await asyncio.sleep(interval_s)


class _NoLive:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _print(job: Job, as_json: bool, problem: str) -> None:
    if as_json:
        print(json.dumps(json.loads(render.to_json(job)), sort_keys=True), flush=True)
        return
    out = render.console()
    for part in render.job_view(job):
        out.print(part)
    if problem:
        print(problem, file=sys.stderr, flush=True)
    out.print(Text(""))
    sys.stdout.flush()


def watch_job(endpoint: Endpoint, run_id: str, as_json: bool, interval_s: float) -> int:
    """Follow ``run_id`` until it is terminal; returns the exit status (0, or 130 on Ctrl-C)."""
    try:
        job = asyncio.run(_follow(endpoint, run_id, as_json, interval_s))
    except KeyboardInterrupt:
        print(f"Stopped watching {run_id}; the Job is not affected.", file=sys.stderr)
        return 130
    if not as_json:
        print(f"Job {run_id} is {job.state}.", flush=True)
    return 0
