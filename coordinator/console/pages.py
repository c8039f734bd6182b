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

from ..values.fleet import Fleet, Node
from ..values.jobs import Job
from ..values.users import User
from .views import node_json


def when(ms: int | None) -> str:
    """Epoch ms as UTC text; a dash when not known."""
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def esc(value: object) -> str:
    return escape(str(value), quote=True)


def table(caption: str, head: Iterable[str], rows: Iterable[Iterable[str]], empty: str) -> str:
    """A table of already-escaped cells."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f"<p>{esc(empty)}</p>"
    th = "".join(f'<th scope="col">{esc(h)}</th>' for h in head)
    return (
        f"<table><caption>{esc(caption)}</caption><thead><tr>{th}</tr></thead>"
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
            f'<span class="who">Signed in as {esc(user.name)} ({esc(user.role)})</span>'
            '<form method="post" action="/sign-out" class="inline">'
            f'<input type="hidden" name="csrf_token" value="{esc(csrf)}">'
            '<button type="submit">Sign out</button></form></nav>'
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} - TunePlane console</title>"
        + "".join(f'<link rel="stylesheet" href="/static/{esc(name)}">' for name in styles)
        + '<link rel="stylesheet" href="/static/console.css">'
        '<script src="/static/console.js" defer></script>'
        + "".join(f'<script src="/static/{esc(name)}" defer></script>' for name in scripts)
        + "</head>"
        f'<body><header><span class="brand">TunePlane</span>{nav}</header>'
        f'<main id="main"><h1>{esc(title)}</h1>{body}</main></body></html>'
    )


def sign_in_page(csrf: str, refusal: str = "") -> str:
    said = f'<p class="refusal" role="alert">{esc(refusal)}</p>' if refusal else ""
    body = (
        f"{said}<p>Paste your TunePlane user token: the one <code>tp</code> uses (the token file "
        "named in your tp context, or the one <code>tuneplane-coordinator user create</code> "
        "printed).</p>"
        '<form method="post" action="/sign-in">'
        f'<input type="hidden" name="csrf_token" value="{esc(csrf)}">'
        '<label for="token">User token</label> '
        '<input id="token" name="token" type="password" autocomplete="off" required '
        'spellcheck="false" size="60"> <button type="submit">Sign in</button></form>'
    )
    return layout("Sign in", body)


def error_page(title: str, message: str, user: User | None, csrf: str) -> str:
    return layout(title, f'<p class="refusal" role="alert">{esc(message)}</p>', user, csrf)


def fleets_page(fleets: list[Fleet], user: User, csrf: str) -> str:
    rows = []
    for f in fleets:
        capacity = ", ".join(
            f"{c.series}: {c.free} free of {c.healthy} healthy ({c.total} in all)"
            for c in f.capacity
        )
        rows.append(
            [
                f'<a href="/fleets/{quote(f.name, safe="")}">{esc(f.name)}</a>',
                esc(f.kind),
                f"{f.connected_nodes} of {f.nodes}",
                esc(f.schedulable_nodes),
                esc(capacity or "-"),
                f"{f.queued_jobs} queued, {f.active_jobs} active",
            ]
        )
    shown = table(
        "Fleets",
        ["Fleet", "Kind", "Connected Nodes", "Schedulable Nodes", "GPUs", "Jobs"],
        rows,
        "There are no Fleets yet.",
    )
    return layout("Fleets", shown, user, csrf)


def _gpus(node: Node) -> str:
    items = []
    for gpu in node_json(node)["gpus"]:
        health = "healthy" if gpu["healthy"] else f"unhealthy: {gpu['health_reason'] or '?'}"
        owner = f", held by {gpu['held_by']} ({gpu['owner']})" if gpu["held_by"] else ", free"
        items.append(f"<li>GPU {gpu['index']} {esc(gpu['series'])}: {esc(health)}{esc(owner)}</li>")
    return f"<ul>{''.join(items)}</ul>" if items else "none"


def fleet_page(fleet: Fleet, nodes: list[Node], user: User, csrf: str) -> str:
    rows = [
        [
            esc(n.name or n.id) + f"<br><small>{esc(n.id)}</small>",
            esc(n.hostname),
            "connected"
            if n.connected
            else f"disconnected since {esc(when(n.disconnected_since_ms))}",
            esc(n.scheduling)
            + (f"<br><small>{esc(n.scheduling_reason)}</small>" if n.scheduling_reason else ""),
            _gpus(n),
            esc(when(n.credential_expires_at_ms)) + (" (revoked)" if n.revoked_at_ms else ""),
            esc(when(n.last_heartbeat_ms)),
        ]
        for n in nodes
    ]
    summary = (
        f"<p>Kind {esc(fleet.kind)}; {fleet.connected_nodes} of {fleet.nodes} Nodes connected, "
        f"{fleet.schedulable_nodes} schedulable; {fleet.queued_jobs} Jobs queued, "
        f"{fleet.active_jobs} active.</p>"
    )
    shown = table(
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
    return layout(f"Fleet {fleet.name}", summary + shown, user, csrf)


def jobs_page(jobs: list[Job], project: str, state: str, owner: str, user: User, csrf: str) -> str:
    def field(name: str, label: str, value: str) -> str:
        return (
            f'<label for="f-{name}">{label}</label> '
            f'<input id="f-{name}" name="{name}" value="{esc(value)}" size="14">'
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
            f'<a href="/jobs/{quote(j.run_id, safe="")}">{esc(j.run_id)}</a>',
            esc(j.project),
            esc(j.experiment),
            esc(j.owner),
            f'<span class="state">{esc(j.state)}</span>',
            esc(j.fleet),
            esc(when(j.created_at_ms)),
        ]
        for j in jobs
    ]
    head = ["Run id", "Project", "Experiment", "Owner", "State", "Fleet", "Created"]
    caption = "Jobs you may read, newest first"
    empty = "No Jobs you may read match these filters."
    # The live list (console.js) draws the table again in the same place, from the same words.
    shown = (
        f'<div id="jobs-table" data-caption="{esc(caption)}" data-empty="{esc(empty)}" '
        f'data-columns="{esc("|".join(head))}">{table(caption, head, rows, empty)}</div>'
    )
    query = urlencode(
        {k: v for k, v in (("project", project), ("state", state), ("owner", owner)) if v}
    )
    live = f'<div id="jobs-live" data-query="{esc(query)}" hidden></div>'
    return layout("Jobs", filters + shown + live, user, csrf)


#: What the Tags fieldset says before any tag is stored (charts.js removes it when one comes).
NO_TAGS = '<span id="no-tags">none yet</span>'


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
        f'<input id="run-{i}" name="run" value="{esc(run)}" size="28" spellcheck="false">'
        for i, run in enumerate([*others, ""], start=1)
    )
    tag_boxes = "".join(
        f'<label><input type="checkbox" name="tag" value="{esc(tag)}"'
        f"{' checked' if tag in chosen else ''}> {esc(tag)}</label>"
        for tag in every
    )
    form = (
        f'<form method="get" action="/jobs/{quote(run_id, safe="")}/charts" class="filters">'
        f"<fieldset><legend>Runs</legend>{run_fields}</fieldset>"
        '<fieldset id="tag-boxes"><legend>Tags</legend>'
        f"{tag_boxes or NO_TAGS}</fieldset>"
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
            f'<a class="csv" data-run="{esc(run)}" href="/api/v1/jobs/{quote(run, safe="")}/series'
            f'?{urlencode({"tag": tag, "format": "csv"})}">CSV of {esc(run)}</a>'
            for run in having
        )
        figures.append(
            f'<figure class="chart" id="chart-{i}" data-tag="{esc(tag)}" '
            f'data-runs="{esc(" ".join(having))}" data-state="loading">'
            f"<figcaption>{esc(tag)} <small>(band: min to max per bucket; line: last)</small> "
            f'{links}</figcaption><div class="plot"></div></figure>'
        )
    missing = [run for run, tags in runs if not tags]
    note = f"<p>No metrics stored yet for {esc(', '.join(missing))}.</p>" if missing else ""
    body = (
        f'<p><a href="/jobs/{quote(run_id, safe="")}">Back to Job {esc(run_id)}</a></p>'
        + form
        + controls
        + note
        + ("".join(figures) or "<p>No metrics to chart yet.</p>")
        + f'<div id="charts-live" data-runs="{esc(" ".join(all_runs))}" hidden></div>'
    )
    return layout(
        f"Charts of {run_id}",
        body,
        user,
        csrf,
        scripts=("uPlot.iife.min.js", "charts.js"),
        styles=("uPlot.min.css",),
    )
