"""The Job page: its facts, Cancel and Retry, attempts and members, logs, telemetry delivery,
decision log and state history, server-rendered from values.

Rules: as :mod:`.pages` (a page is a function of values, every value escaped, no inline
script); the buttons show for who may press them, as the store would decide it, and the server
decides again when one is pressed. The log is followed by ``/static/console.js`` through the
log's server-sent events from the ``data-next-offset`` the page was rendered with.
"""

from __future__ import annotations

from urllib.parse import quote

import attrs

from tuneplane.proto.contract.derivation_source import InitFromSource

from ..derivation import how_fetched
from ..job_access import may_change
from ..lifecycle.states import RETRYABLE, TERMINAL_JOB_STATES
from ..values.decisions import DecisionRow
from ..values.jobs import Job
from ..values.lifecycle import LogPage
from ..values.metrics import Delivery
from ..values.users import User
from .pages import esc, layout, table, when


@attrs.frozen
class JobShown:
    """What a Job page shows: the Job, its telemetry delivery, its newest decisions (and
    whether older ones exist), one read of a member's log (None: no attempt yet, or the
    read was refused: ``logs_refused`` says why) and its Derivation's source."""

    job: Job
    delivery: list[Delivery]
    decisions: tuple[list[DecisionRow], bool]
    logs: LogPage | None
    logs_refused: str = ""
    # The Derivation's source as the resolved JobSpec carries it; None without one.
    derivation: InitFromSource | None = None


def _button_form(
    run_id: str, action: str, csrf: str, fields: str, label: str, shown_in: str = ""
) -> str:
    """A form with one button that POSTs ``action``; with ``shown_in`` (states, space
    separated) it starts hidden, and ``console.js`` shows it once the Job is in one of them."""
    later = f' hidden data-shown-in="{esc(shown_in)}"' if shown_in else ""
    return (
        f'<form method="post" action="/jobs/{quote(run_id, safe="")}/{action}" '
        f'id="{action}-form" class="filters"{later}>'
        f'<input type="hidden" name="csrf_token" value="{esc(csrf)}">{fields}'
        f'<button type="submit" id="{action}-button">{esc(label)}</button></form>'
    )


def _logs(job: Job, page: LogPage | None, refused: str) -> str:
    if refused:
        back = f'<a href="/jobs/{quote(job.run_id, safe="")}">the latest attempt\'s member 0</a>'
        return f'<p class="refusal" role="alert">{esc(refused)}</p><p>Show {back}.</p>'
    if page is None:
        return "<p>No logs yet: the Job has no attempt (it waits in the queue).</p>"
    (attempt,) = [a for a in job.attempts if a.number == page.attempt] or [job.attempts[-1]]

    def options(values: list[str], chosen: str) -> str:
        return "".join(
            f'<option value="{esc(v)}"{" selected" if v == chosen else ""}>{esc(v)}</option>'
            for v in values
        )

    numbers = [str(a.number) for a in job.attempts]
    members = [str(m.index) for m in attempt.members] or [str(page.member_index)]
    form = (
        f'<form method="get" action="/jobs/{quote(job.run_id, safe="")}" class="filters">'
        '<label for="log-attempt">Attempt</label> <select id="log-attempt" name="attempt">'
        f"{options(numbers, str(page.attempt))}</select> "
        '<label for="log-member">Member</label> <select id="log-member" name="member">'
        f"{options(members, str(page.member_index))}</select> "
        '<label for="log-stream">Stream</label> <select id="log-stream" name="stream">'
        f"{options(['stdout', 'stderr'], page.stream)}</select> "
        '<button type="submit">Show</button></form>'
    )
    text = "".join(
        (f"[{p.dropped_before} bytes dropped here]\n" if p.dropped_before else "")
        + p.data.decode("utf-8", "replace")
        for p in page.pieces
    )
    status = "complete" if page.complete else f"member {page.member_state}; following"
    return (
        form
        + f'<p id="log-status" aria-live="polite">{esc(status)}</p>'
        + f'<pre id="log" class="log" role="log" tabindex="0" data-run-id="{esc(job.run_id)}" '
        f'data-attempt="{page.attempt}" data-member="{page.member_index}" '
        f'data-stream="{esc(page.stream)}" data-next-offset="{page.next_offset}" '
        f'data-complete="{"yes" if page.complete else "no"}" '
        f'aria-label="Log of attempt {page.attempt} member {page.member_index}, '
        f'{esc(page.stream)}">{esc(text)}</pre>'
    )


def _derivation(job: Job, source: InitFromSource | None) -> str:
    """What ``tp job show`` says of the Derivation (the run it began from, linked to its page),
    and what the resolved JobSpec holds of its source: which attempt's member, its files,
    bytes, output directory and manifest digest, and where the Nodes get it."""
    if not job.init_from:
        return "none"
    run = (
        f'<a href="/jobs/{quote(job.init_from, safe="")}" id="derivation-source">'
        f"{esc(job.init_from)}</a>"
    )
    if source is None:
        return f"began from run {run}"
    return (
        f"began from run {run}, attempt {source.attempt}, member {source.member_index}: "
        f"{source.files} files, {source.bytes} bytes from <code>{esc(source.out_dir)}</code> "
        f"(manifest sha256 <code>{esc(source.manifest_sha256)}</code>), "
        f"{esc(how_fetched(source))}; each rank finds them at "
        "<code>$TUNEPLANE_INIT_FROM_DIR</code>"
    )


def _decisions(rows: list[DecisionRow], older: bool) -> str:
    shown = table(
        "Decisions about this Job, oldest first",
        ["At", "Kind", "Attempt", "Member", "Node", "Detail"],
        [
            [
                f'<span class="nowrap">{esc(when(r.at_ms))}</span>',
                esc(r.kind),
                esc("-" if r.attempt is None else r.attempt),
                esc("-" if r.member_index is None else r.member_index),
                esc(r.node_id or "-"),
                esc(r.detail_text()),
            ]
            for r in rows
        ],
        "No decisions recorded for this Job.",
    )
    note = f"<p>Older decisions exist; the newest {len(rows)} are shown.</p>" if older else ""
    return note + shown


def job_page(shown: JobShown, user: User, csrf: str) -> str:
    job, delivery = shown.job, shown.delivery
    may = may_change(job.owner, user.name, user.is_admin)
    facts = (
        '<dl class="facts">'
        f'<dt>State</dt><dd><span id="job-state" class="state">{esc(job.state)}</span> '
        f'<span id="job-state-reason">{esc(job.state_reason)}</span></dd>'
        f"<dt>Owner</dt><dd>{esc(job.owner)}</dd>"
        f"<dt>Project</dt><dd>{esc(job.project)}</dd>"
        f"<dt>Experiment</dt><dd>{esc(job.experiment)}</dd>"
        f"<dt>Fleet</dt><dd>{esc(job.fleet)} ({esc(job.profile)})</dd>"
        f"<dt>Method</dt><dd>{esc(job.method_id)}</dd>"
        f"<dt>Runtime</dt><dd>{esc(job.runtime_id or '-')}</dd>"
        f'<dt>Derivation</dt><dd id="derivation">{_derivation(job, shown.derivation)}</dd>'
        f"<dt>Created</dt><dd>{esc(when(job.created_at_ms))}</dd></dl>"
    )
    changes = ""
    if may and job.state not in TERMINAL_JOB_STATES:
        reason = (
            '<label for="reason">Reason (optional)</label> '
            '<input id="reason" name="reason" maxlength="500" size="40"> '
        )
        changes = _button_form(job.run_id, "cancel", csrf, reason, "Cancel this Job")
        # The Job may end while the page is open: Retry waits, hidden, for the state that
        # allows it (the server decides again when it is pressed).
        retryable = " ".join(sorted(RETRYABLE))
        changes += _button_form(job.run_id, "retry", csrf, "", "Retry this Job", retryable)
    if may and job.state in RETRYABLE:
        changes = _button_form(job.run_id, "retry", csrf, "", "Retry this Job")
    attempts = []
    for attempt in job.attempts:
        rows = [
            [
                esc(m.index),
                esc(m.node_name or m.node_id or "-"),
                ", ".join(str(g) for g in m.gpu_indexes) or "-",
                esc(m.state),
                esc(
                    f"exit {m.exit_code}" + (f", signal {m.signal}" if m.signal else "")
                    if m.has_exit
                    else "-"
                ),
                esc(when(m.ended_at_ms)),
            ]
            for m in attempt.members
        ]
        attempts.append(
            f"<h3>Attempt {attempt.number}: {esc(attempt.state)}</h3>"
            + table(
                f"Members of attempt {attempt.number}",
                ["Member", "Node", "GPUs", "State", "Exit", "Ended"],
                rows,
                "No members yet.",
            )
        )
    delivered = table(
        "Telemetry delivery per member",
        [
            "Attempt",
            "Member",
            "Points stored",
            "Spooled",
            "Drained",
            "Last contact",
            "Data-loss warnings",
        ],
        [
            [
                esc(d.member.attempt),
                esc(d.member.member_index),
                esc(d.points_stored),
                esc(d.spool_points),
                "yes" if d.drained else "no",
                esc(when(d.last_contact_ms)),
                esc(d.data_loss_warnings),
            ]
            for d in delivery
        ],
        "No telemetry has reached the coordinator for this Job.",
    )
    history = table(
        "State history",
        ["State", "At", "Reason"],
        [[esc(h.state), esc(when(h.at_ms)), esc(h.reason)] for h in job.history],
        "No state changes recorded.",
    )
    live = f'<div id="job-live" data-run-id="{esc(job.run_id)}" hidden></div>'
    charts = f'<p><a href="/jobs/{quote(job.run_id, safe="")}/charts">Charts</a></p>'
    body = (
        facts
        + charts
        + changes
        + '<section aria-labelledby="h-attempts" id="attempts"><h2 id="h-attempts">Attempts</h2>'
        + ("".join(attempts) or "<p>No attempt yet (the Job waits in the queue).</p>")
        + "</section>"
        + '<section aria-labelledby="h-delivery"><h2 id="h-delivery">Telemetry delivery</h2>'
        + f"{delivered}</section>"
        + '<section aria-labelledby="h-logs"><h2 id="h-logs">Logs</h2>'
        + f"{_logs(job, shown.logs, shown.logs_refused)}</section>"
        + '<section aria-labelledby="h-decisions"><h2 id="h-decisions">Decision log</h2>'
        + f"{_decisions(*shown.decisions)}</section>"
        + '<section aria-labelledby="h-history"><h2 id="h-history">History</h2>'
        + f"{history}</section>"
        + live
    )
    return layout(f"Job {job.run_id}", body, user, csrf)
