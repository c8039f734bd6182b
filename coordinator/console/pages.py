"""The console's pages: server-rendered HTML, every value escaped, no inline script.

Rules:
- A page is a function of values; nothing here reads the store or decides who may do what
  (a cancel button shows for who may, as :mod:`~tuneplane.coordinator.store.lifecycle` would
  decide it, and the server decides again when it is pressed).
- Every form that changes something carries the session's CSRF token; every input has a label;
  everything is reachable by keyboard (links, buttons and form controls only).
- Scripts come from ``/static/console.js`` (the Content-Security-Policy allows no inline script).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from html import escape
from urllib.parse import quote, urlencode

from ..job_access import may_change
from ..lifecycle.states import TERMINAL_JOB_STATES
from ..values.fleet import Fleet, Node
from ..values.jobs import Job
from ..values.metrics import Delivery
from ..values.users import User
from .views import node_json


def when(ms: int | None) -> str:
    """Epoch ms as UTC text; a dash when not known."""
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _table(caption: str, head: Iterable[str], rows: Iterable[Iterable[str]], empty: str) -> str:
    """A table of already-escaped cells."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f"<p>{_e(empty)}</p>"
    th = "".join(f'<th scope="col">{_e(h)}</th>' for h in head)
    return (
        f"<table><caption>{_e(caption)}</caption><thead><tr>{th}</tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def layout(
    title: str,
    body: str,
    user: User | None = None,
    csrf: str = "",
    scripts: tuple[str, ...] = (),
    styles: tuple[str, ...] = (),
) -> str:
    """The page around ``body`` (already HTML): header, navigation, sign-out for who is in."""
    nav = ""
    if user is not None:
        nav = (
            '<nav aria-label="Main"><a href="/fleets">Fleets</a> <a href="/jobs">Jobs</a>'
            f'<span class="who">Signed in as {_e(user.name)} ({_e(user.role)})</span>'
            '<form method="post" action="/sign-out" class="inline">'
            f'<input type="hidden" name="csrf_token" value="{_e(csrf)}">'
            '<button type="submit">Sign out</button></form></nav>'
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)} - TunePlane console</title>"
        + "".join(f'<link rel="stylesheet" href="/static/{_e(name)}">' for name in styles)
        + '<link rel="stylesheet" href="/static/console.css">'
        '<script src="/static/console.js" defer></script>'
        + "".join(f'<script src="/static/{_e(name)}" defer></script>' for name in scripts)
        + "</head>"
        f'<body><header><span class="brand">TunePlane</span>{nav}</header>'
        f'<main id="main"><h1>{_e(title)}</h1>{body}</main></body></html>'
    )


def sign_in_page(csrf: str, refusal: str = "") -> str:
    said = f'<p class="refusal" role="alert">{_e(refusal)}</p>' if refusal else ""
    body = (
        f"{said}<p>Paste your TunePlane user token: the one <code>tp</code> uses (the token file "
        "named in your tp context, or the one <code>tuneplane-coordinator user create</code> "
        "printed).</p>"
        '<form method="post" action="/sign-in">'
        f'<input type="hidden" name="csrf_token" value="{_e(csrf)}">'
        '<label for="token">User token</label> '
        '<input id="token" name="token" type="password" autocomplete="off" required '
        'spellcheck="false" size="60"> <button type="submit">Sign in</button></form>'
    )
    return layout("Sign in", body)


def error_page(title: str, message: str, user: User | None, csrf: str) -> str:
    return layout(title, f'<p class="refusal" role="alert">{_e(message)}</p>', user, csrf)


def fleets_page(fleets: list[Fleet], user: User, csrf: str) -> str:
    rows = []
    for f in fleets:
        capacity = ", ".join(
            f"{c.series}: {c.free} free of {c.healthy} healthy ({c.total} in all)"
            for c in f.capacity
        )
        rows.append(
            [
                f'<a href="/fleets/{quote(f.name, safe="")}">{_e(f.name)}</a>',
                _e(f.kind),
                f"{f.connected_nodes} of {f.nodes}",
                _e(f.schedulable_nodes),
                _e(capacity or "-"),
                f"{f.queued_jobs} queued, {f.active_jobs} active",
            ]
        )
    table = _table(
        "Fleets",
        ["Fleet", "Kind", "Connected Nodes", "Schedulable Nodes", "GPUs", "Jobs"],
        rows,
        "There are no Fleets yet.",
    )
    return layout("Fleets", table, user, csrf)


def _gpus(node: Node) -> str:
    items = []
    for gpu in node_json(node)["gpus"]:
        health = "healthy" if gpu["healthy"] else f"unhealthy: {gpu['health_reason'] or '?'}"
        owner = f", held by {gpu['held_by']} ({gpu['owner']})" if gpu["held_by"] else ", free"
        items.append(f"<li>GPU {gpu['index']} {_e(gpu['series'])}: {_e(health)}{_e(owner)}</li>")
    return f"<ul>{''.join(items)}</ul>" if items else "none"


def fleet_page(fleet: Fleet, nodes: list[Node], user: User, csrf: str) -> str:
    rows = [
        [
            _e(n.name or n.id) + f"<br><small>{_e(n.id)}</small>",
            _e(n.hostname),
            "connected"
            if n.connected
            else f"disconnected since {_e(when(n.disconnected_since_ms))}",
            _e(n.scheduling)
            + (f"<br><small>{_e(n.scheduling_reason)}</small>" if n.scheduling_reason else ""),
            _gpus(n),
            _e(when(n.credential_expires_at_ms)) + (" (revoked)" if n.revoked_at_ms else ""),
            _e(when(n.last_heartbeat_ms)),
        ]
        for n in nodes
    ]
    summary = (
        f"<p>Kind {_e(fleet.kind)}; {fleet.connected_nodes} of {fleet.nodes} Nodes connected, "
        f"{fleet.schedulable_nodes} schedulable; {fleet.queued_jobs} Jobs queued, "
        f"{fleet.active_jobs} active.</p>"
    )
    table = _table(
        f"Nodes of the Fleet {fleet.name}",
        [
            "Node",
            "Host",
            "Connectivity",
            "Scheduling",
            "GPUs",
            "Credential expires",
            "Last heartbeat",
        ],
        rows,
        "This Fleet has no Nodes yet.",
    )
    return layout(f"Fleet {fleet.name}", summary + table, user, csrf)


def jobs_page(jobs: list[Job], project: str, state: str, owner: str, user: User, csrf: str) -> str:
    def field(name: str, label: str, value: str) -> str:
        return (
            f'<label for="f-{name}">{label}</label> '
            f'<input id="f-{name}" name="{name}" value="{_e(value)}" size="14">'
        )

    filters = (
        '<form method="get" action="/jobs" class="filters">'
        + field("project", "Project", project)
        + field("state", "State", state)
        + field("owner", "Owner", owner)
        + ' <button type="submit">Filter</button></form>'
    )
    rows = [
        [
            f'<a href="/jobs/{quote(j.run_id, safe="")}">{_e(j.run_id)}</a>',
            _e(j.project),
            _e(j.experiment),
            _e(j.owner),
            f'<span class="state">{_e(j.state)}</span>',
            _e(j.fleet),
            _e(when(j.created_at_ms)),
        ]
        for j in jobs
    ]
    table = _table(
        "Jobs you may read, newest first",
        ["Run id", "Project", "Experiment", "Owner", "State", "Fleet", "Created"],
        rows,
        "No Jobs you may read match these filters.",
    )
    query = urlencode(
        {k: v for k, v in (("project", project), ("state", state), ("owner", owner)) if v}
    )
    live = f'<div id="jobs-live" data-query="{_e(query)}" hidden></div>'
    return layout("Jobs", filters + table + live, user, csrf)


def job_page(job: Job, delivery: list[Delivery], user: User, csrf: str) -> str:
    may_cancel = may_change(job.owner, user.name, user.is_admin)
    may_cancel = may_cancel and job.state not in TERMINAL_JOB_STATES
    facts = (
        '<dl class="facts">'
        f'<dt>State</dt><dd><span id="job-state" class="state">{_e(job.state)}</span> '
        f'<span id="job-state-reason">{_e(job.state_reason)}</span></dd>'
        f"<dt>Owner</dt><dd>{_e(job.owner)}</dd>"
        f"<dt>Project</dt><dd>{_e(job.project)}</dd>"
        f"<dt>Experiment</dt><dd>{_e(job.experiment)}</dd>"
        f"<dt>Fleet</dt><dd>{_e(job.fleet)} ({_e(job.profile)})</dd>"
        f"<dt>Method</dt><dd>{_e(job.method_id)}</dd>"
        f"<dt>Runtime</dt><dd>{_e(job.runtime_id or '-')}</dd>"
        f"<dt>Derivation</dt><dd>{_e(job.init_from or 'none')}</dd>"
        f"<dt>Created</dt><dd>{_e(when(job.created_at_ms))}</dd></dl>"
    )
    cancel = ""
    if may_cancel:
        cancel = (
            f'<form method="post" action="/jobs/{quote(job.run_id, safe="")}/cancel" '
            'id="cancel-form">'
            f'<input type="hidden" name="csrf_token" value="{_e(csrf)}">'
            '<label for="reason">Reason (optional)</label> '
            '<input id="reason" name="reason" maxlength="500" size="40"> '
            '<button type="submit" id="cancel-button">Cancel this Job</button></form>'
        )
    attempts = []
    for attempt in job.attempts:
        rows = [
            [
                _e(m.index),
                _e(m.node_name or m.node_id or "-"),
                ", ".join(str(g) for g in m.gpu_indexes) or "-",
                _e(m.state),
                _e(
                    f"exit {m.exit_code}" + (f", signal {m.signal}" if m.signal else "")
                    if m.has_exit
                    else "-"
                ),
                _e(when(m.ended_at_ms)),
            ]
            for m in attempt.members
        ]
        attempts.append(
            f"<h3>Attempt {attempt.number}: {_e(attempt.state)}</h3>"
            + _table(
                f"Members of attempt {attempt.number}",
                ["Member", "Node", "GPUs", "State", "Exit", "Ended"],
                rows,
                "No members yet.",
            )
        )
    delivered = _table(
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
                _e(d.member.attempt),
                _e(d.member.member_index),
                _e(d.points_stored),
                _e(d.spool_points),
                "yes" if d.drained else "no",
                _e(when(d.last_contact_ms)),
                _e(d.data_loss_warnings),
            ]
            for d in delivery
        ],
        "No telemetry has reached the coordinator for this Job.",
    )
    history = _table(
        "State history",
        ["State", "At", "Reason"],
        [[_e(h.state), _e(when(h.at_ms)), _e(h.reason)] for h in job.history],
        "No state changes recorded.",
    )
    live = f'<div id="job-live" data-run-id="{_e(job.run_id)}" hidden></div>'
    charts = f'<p><a href="/jobs/{quote(job.run_id, safe="")}/charts">Charts</a></p>'
    body = (
        facts
        + charts
        + cancel
        + '<section aria-labelledby="h-attempts" id="attempts"><h2 id="h-attempts">Attempts</h2>'
        + ("".join(attempts) or "<p>No attempt yet (the Job waits in the queue).</p>")
        + "</section>"
        + '<section aria-labelledby="h-delivery"><h2 id="h-delivery">Telemetry delivery</h2>'
        + f"{delivered}</section>"
        + '<section aria-labelledby="h-history"><h2 id="h-history">History</h2>'
        + f"{history}</section>"
        + live
    )
    return layout(f"Job {job.run_id}", body, user, csrf)


def charts_page(
    run_id: str, runs: list[tuple[str, list[str]]], picked: list[str], user: User, csrf: str
) -> str:
    """Charts of ``run_id`` with other runs overlaid: ``runs`` is each run and its tags; a
    chart per picked tag (the first tag when none is picked). The drawing, zoom, smoothing,
    log scale and CSV links are ``/static/charts.js`` over ``/api/v1/jobs/{run_id}/series``."""
    every = sorted({tag for _, tags in runs for tag in tags})
    chosen = [t for t in picked if t in every] or every[:1]
    others = [run for run, _ in runs[1:]]
    run_fields = "".join(
        f'<label for="run-{i}">Overlay run {i}</label> '
        f'<input id="run-{i}" name="run" value="{_e(run)}" size="28" spellcheck="false">'
        for i, run in enumerate([*others, ""], start=1)
    )
    tag_boxes = "".join(
        f'<label><input type="checkbox" name="tag" value="{_e(tag)}"'
        f"{' checked' if tag in chosen else ''}> {_e(tag)}</label>"
        for tag in every
    )
    form = (
        f'<form method="get" action="/jobs/{quote(run_id, safe="")}/charts" class="filters">'
        f"<fieldset><legend>Runs</legend>{run_fields}</fieldset>"
        f"<fieldset><legend>Tags</legend>{tag_boxes or 'none yet'}</fieldset>"
        '<button type="submit">Draw</button></form>'
    )
    controls = (
        '<div class="filters" id="chart-controls">'
        '<label for="smoothing">Smoothing</label> '
        '<input id="smoothing" type="range" min="0" max="0.99" step="0.01" value="0"> '
        '<output id="smoothing-value" for="smoothing">0</output>'
        '<label><input id="log-scale" type="checkbox"> Log scale</label>'
        '<button type="button" id="reset-zoom">Reset zoom</button>'
        "<span>Drag across a chart to zoom: it reads that step range again, finer.</span></div>"
    )
    all_runs = [run for run, _ in runs]
    figures = []
    for i, tag in enumerate(chosen):
        having = [run for run, tags in runs if tag in tags]
        links = " ".join(
            f'<a class="csv" data-run="{_e(run)}" href="/api/v1/jobs/{quote(run, safe="")}/series'
            f'?{urlencode({"tag": tag, "format": "csv"})}">CSV of {_e(run)}</a>'
            for run in having
        )
        figures.append(
            f'<figure class="chart" id="chart-{i}" data-tag="{_e(tag)}" '
            f'data-runs="{_e(" ".join(having))}" data-state="loading">'
            f"<figcaption>{_e(tag)} <small>(band: min to max per bucket; line: last)</small> "
            f'{links}</figcaption><div class="plot"></div></figure>'
        )
    missing = [run for run, tags in runs if not tags]
    note = f"<p>No metrics stored yet for {_e(', '.join(missing))}.</p>" if missing else ""
    body = (
        f'<p><a href="/jobs/{quote(run_id, safe="")}">Back to Job {_e(run_id)}</a></p>'
        + form
        + controls
        + note
        + ("".join(figures) or "<p>No metrics to chart yet.</p>")
        + f'<div id="charts-live" data-runs="{_e(" ".join(all_runs))}" hidden></div>'
    )
    return layout(
        f"Charts of {run_id}",
        body,
        user,
        csrf,
        scripts=("uPlot.iife.min.js", "charts.js"),
        styles=("uPlot.min.css",),
    )
