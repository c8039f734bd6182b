"""``tp job cancel``, ``tp job retry`` and ``tp logs``: change a Job's course and read its output.

Rules: the same exit codes and error sentences as the rest of ``tp`` (errors propagate to
``tp.main``); ``--json`` prints stable JSON and nothing else on stdout. ``tp logs`` writes the
member's bytes to stdout as they were written, with one ``[... N bytes dropped ...]`` line where
the coordinator no longer keeps older output; ``--follow`` polls until the stream is complete.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from ..values import lifecycle as lm
from ..values.lifecycle import CancelOutcome, LogPage, RetryOutcome
from . import render
from .ops import HasEndpoint, call, json_option

if TYPE_CHECKING:
    from .api_client import ApiClient

#: A member that ended but whose Node sends nothing more for this long: stop following.
FOLLOW_GIVE_UP_S = 30.0
_ENDED = frozenset({"exited", "aborted", "lost"})


@click.command("cancel")
@click.argument("run_id")
@click.option("--reason", default="", help="Why; recorded in the Job's history.")
@json_option
@click.pass_obj
def job_cancel(options: HasEndpoint, run_id: str, reason: str, as_json: bool) -> None:
    """Cancel a Job: its members get SIGTERM, then SIGKILL after the JobSpec's grace period.

    A queued Job is cancelled at once; repeating the command is harmless.
    """

    async def work(api: ApiClient) -> CancelOutcome:
        return await api.cancel_job(run_id, reason)

    done = call(options, work)
    if as_json:
        click.echo(render.to_json(done))
        return
    click.echo(_cancel_sentence(run_id, done))
    if done.outcome in (lm.CANCELLING, lm.ALREADY_CANCELLING):
        click.echo(f"Follow it with: tp job show {run_id} --watch")


def _cancel_sentence(run_id: str, done: CancelOutcome) -> str:
    if done.outcome == lm.CANCELLING:
        return (
            f"Cancelling Job {run_id}: its members were told to stop (SIGTERM, then SIGKILL "
            "after the grace period); it is cancelled once every member has ended."
        )
    if done.outcome == lm.CANCELLED:
        return f"Cancelled Job {run_id}; nothing of it had started, and its GPUs are free again."
    if done.outcome == lm.ALREADY_CANCELLING:
        return f"Job {run_id} is already being cancelled; its members were told to stop again."
    if done.outcome == lm.ALREADY_CANCELLED:
        return f"Job {run_id} was already cancelled."
    return f"Job {run_id} already ended ({done.job.state}); there is nothing to cancel."


@click.command("retry")
@click.argument("run_id")
@json_option
@click.pass_obj
def job_retry(options: HasEndpoint, run_id: str, as_json: bool) -> None:
    """Run an ended Job again (failed, cancelled or aborted): a new attempt, same JobSpec."""

    async def work(api: ApiClient) -> RetryOutcome:
        return await api.retry_job(run_id)

    done = call(options, work)
    if as_json:
        click.echo(render.to_json(done))
        return
    click.echo(
        f"Queued attempt {done.attempt} of Job {run_id} with the same JobSpec; it is placed "
        "when GPUs are free."
    )
    click.echo(f"Follow it with: tp job show {run_id} --watch")


def _text(page: LogPage) -> Iterator[bytes]:
    for piece in page.pieces:
        if piece.dropped_before:
            yield f"[... {piece.dropped_before} bytes dropped ...]\n".encode()
        yield piece.data


def _write(chunks: Iterator[bytes]) -> None:
    out = sys.stdout.buffer
    for chunk in chunks:
        out.write(chunk)
    out.flush()


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


@click.command("logs")
@click.argument("run_id")
@click.option(
    "--member",
    "member_index",
    type=click.IntRange(min=0),
    help="Member index (default: 0, or the member that failed first when the Job failed).",
)
@click.option("--attempt", type=click.IntRange(min=1), help="Attempt number (default: latest).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the member's output ends.")
@click.option("--tail", type=click.IntRange(min=0), help="Only the last N lines kept so far.")
@click.option(
    "--stderr/--stdout",
    "use_stderr",
    default=None,
    help="Which stream (default: stdout, or stderr of the member that failed first).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=0.5,
    show_default=True,
    help="Seconds between polls with --follow.",
)
@click.pass_obj
def logs_command(
    options: HasEndpoint,
    run_id: str,
    member_index: int | None,
    attempt: int | None,
    follow: bool,
    tail: int | None,
    use_stderr: bool | None,
    interval: float,
) -> None:
    """Print a member's stdout (or --stderr) as its Node shipped it.

    Of a failed Job, without --member: the member that failed first (as `tp job show` names
    it) and, without --stdout, its stderr; one line on stderr says so. The coordinator keeps
    the last 1 MiB of each stream; where older output was dropped, a line says how many bytes.
    With --follow, new output appears as it arrives, a coordinator that stops answering is
    retried from the same offset, and the command ends when the member has ended and all its
    output arrived (Ctrl-C stops following sooner).
    """

    async def start(api: ApiClient) -> LogPage:
        """The member and stream, and everything kept so far: printed only once all of it was
        read, so a retry after a failed call prints nothing twice."""
        member, stderr, note = member_index, bool(use_stderr), ""
        if member is None:
            member, stderr, note = await _default_member(api, run_id, attempt, use_stderr)
        stream = "stderr" if stderr else "stdout"
        data, page = await _read_all(api, run_id, member, attempt or 0, stream, tail)
        if note:
            click.echo(note, err=True)
        _write(iter([data]))
        return page

    async def work(api: ApiClient) -> None:
        if not follow:
            await start(api)
            return
        import anyio

        from .watch import Outage

        # Like --watch, --follow waits for a coordinator that does not answer yet.
        outage = Outage(interval)
        said = False
        while (page := await outage.poll(lambda: start(api))) is None:
            if not said:
                click.echo(f"tp: {outage.problem}", err=True)
                said = True
            await anyio.sleep(interval)
        await _follow(api, run_id, page, interval)

    try:
        call(options, work)
    except KeyboardInterrupt:
        return


async def _default_member(
    api: ApiClient, run_id: str, attempt: int | None, use_stderr: bool | None
) -> tuple[int, bool, str]:
    """Member 0's stdout, or for a failed Job the first failed member's stderr with the line
    that says so; the third value is that line ("" for member 0).

    An explicit ``--attempt`` other than the one that failed keeps member 0.
    """
    job = await api.get_job(run_id)
    failed = job.first_failure
    if failed is None or (attempt is not None and attempt != failed.attempt):
        return 0, bool(use_stderr), ""
    stderr = True if use_stderr is None else use_stderr
    stream = "stderr" if stderr else "stdout"
    note = (
        f"tp: Job {run_id} failed; showing the {stream} of member {failed.member_index}, which "
        f"failed first ({failed.what}). Choose another with --member and --stdout/--stderr."
    )
    return failed.member_index, stderr, note


async def _follow(api: ApiClient, run_id: str, page: LogPage, interval: float) -> None:
    """Print what arrives after ``page`` until the stream is complete, through outages."""
    import anyio

    from .watch import Outage

    outage = Outage(interval)
    said = ""
    last_progress = time.monotonic()
    while not page.complete:
        await anyio.sleep(interval)
        before = page.next_offset
        fetch = functools.partial(
            api.get_logs, run_id, page.member_index, page.attempt, page.stream, from_offset=before
        )
        more = await outage.poll(fetch)
        if more is None:
            if not said:
                click.echo(f"tp: {outage.problem} Waiting to go on from byte {before}.", err=True)
            said = outage.problem
            # An outage is not the member's silence: the give-up clock waits with us.
            last_progress = time.monotonic()
            continue
        if said:
            click.echo(f"tp: the coordinator answers again; going on from byte {before}.", err=True)
            said = ""
        page = more
        _write(_text(page))
        if page.next_offset != before:
            last_progress = time.monotonic()
        elif page.member_state in _ENDED and time.monotonic() - last_progress > FOLLOW_GIVE_UP_S:
            click.echo(
                f"tp: member {page.member_index} of {run_id} ended, but its Node has sent no more "
                f"output for {FOLLOW_GIVE_UP_S:g} s; stopped following.",
                err=True,
            )
            return


async def _read_all(
    api: ApiClient,
    run_id: str,
    member_index: int,
    attempt: int,
    stream: str,
    tail: int | None,
) -> tuple[bytes, LogPage]:
    """Everything kept so far (or its last ``tail`` lines), and the last page read."""
    page = await api.get_logs(run_id, member_index, attempt, stream)
    gathered = [b"".join(_text(page))]
    while page.pieces:
        more = await api.get_logs(
            run_id, member_index, page.attempt, stream, from_offset=page.next_offset
        )
        if more.next_offset == page.next_offset:
            page = more
            break
        page = more
        gathered.append(b"".join(_text(page)))
    data = b"".join(gathered)
    return (data if tail is None else _tail(data, tail)), page
