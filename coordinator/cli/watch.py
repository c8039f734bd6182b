"""``tp job show RUN_ID --watch``: follow a Job until it is terminal.

Rules:
- On a terminal the view is a rich ``Live`` display redrawn in place; anywhere else (a pipe, a
  log file) the view is printed again only when the Job changed, so the output stays readable.
  With ``--json`` every change is one JSON object on one line.
- The watch only reads: Ctrl-C stops watching, restores the terminal and leaves the Job alone.
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
from .api_errors import ApiError, RequestRefused
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
            self.problem = f"{exc} Retrying every {self.interval_s:g} s."
            log.debug("poll failed why=%s", exc)
            return None
        self.problem = ""
        return value


def _fingerprint(job: Job) -> str:
    """What counts as a change worth printing again (not the clock)."""
    return render.to_json(job)


async def _follow(endpoint: Endpoint, run_id: str, as_json: bool, interval_s: float) -> Job:
    from .api_client import ApiClient

    out = render.console()
    live_mode = out.is_terminal and not as_json
    last = ""
    job: Job | None = None
    outage = Outage(interval_s)
    async with ApiClient(endpoint) as api:
        live = Live(Text(f"Fetching Job {run_id}..."), console=out, auto_refresh=False)
        with live if live_mode else _NoLive():
            while True:
                job = await outage.poll(lambda: api.get_job(run_id)) or job
                problem = outage.problem
                if job is not None:
                    print_now = _fingerprint(job) + problem
                    if live_mode:
                        parts: list[RenderableType] = list(render.job_view(job))
                        if problem:
                            parts.append(Text(problem, style="yellow"))
                        parts.append(Text("Watching; Ctrl-C stops watching (the Job continues)."))
                        live.update(Group(*parts), refresh=True)
                    elif print_now != last:
                        _print(job, as_json, problem)
                    last = print_now
                    if job.state in lifecycle.TERMINAL_JOB_STATES:
                        return job
                elif problem and not live_mode:
                    print(problem, file=sys.stderr, flush=True)
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
