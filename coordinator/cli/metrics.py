"""``tp metrics``: a Job's tags, one bounded series drawn as a chart, the raw inspector, delivery.

Rules:
- Canonical view (default): a tag merged across every member and source of one attempt (the
  latest with points unless ``--attempt``). ``--raw`` keeps series apart and may be narrowed by
  ``--member`` and ``--source``; those two need ``--raw``.
- Every series read is bounded by ``--max-points``: whole when it fits, otherwise buckets that
  keep each interval's min, max and last value, so a spike is never averaged away.
- ``--json`` and ``--csv`` print only data on stdout; errors are sentences on stderr.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.table import Table
from rich.text import Text

from ..values.metrics import Delivery, SeriesResult, TagSummary
from . import chart, render
from .api_errors import ApiError
from .connection import Endpoint

if TYPE_CHECKING:
    from .metrics_client import MetricsClient

T = TypeVar("T")
DEFAULT_MAX_POINTS = 1000
MAX_MAX_POINTS = 10_000


def _run(endpoint: Endpoint, work: Callable[[MetricsClient], Awaitable[T]]) -> T:
    # Imported here, as in tp itself: grpclib and betterproto load only when a call is made.
    import asyncio

    from .metrics_client import MetricsClient

    async def go() -> T:
        client = MetricsClient(endpoint)
        async with client:
            return await work(client)

    return asyncio.run(go())


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return f"{value:.6g}"


def _age(now_ms: int, then_ms: int | None) -> str:
    if then_ms is None:
        return "-"
    seconds = max(now_ms - then_ms, 0) / 1000
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def tags_table(run_id: str, attempt: int, tags: list[TagSummary], raw: bool) -> Table:
    view = "raw series" if raw else "metrics"
    table = Table(title=f"{view} of {run_id}, attempt {attempt}", title_justify="left")
    table.add_column("tag", overflow="fold")
    if raw:
        table.add_column("member", justify="right")
        table.add_column("source", overflow="fold")
    table.add_column("points", justify="right")
    table.add_column("last step", justify="right")
    table.add_column("last value", justify="right")
    if not raw:
        table.add_column("series", justify="right")
    for t in tags:
        cells = [t.tag]
        if raw:
            cells += [str(t.member_index), t.source]
        cells += [str(t.points), str(t.last_step), _number(t.last_value)]
        if not raw:
            cells.append(str(t.series))
        table.add_row(*cells)
    return table


def series_csv(series: SeriesResult) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["first_step", "last_step", "count", "min", "max", "last"])
    for b in series.buckets:
        writer.writerow(
            [b.first_step, b.last_step, b.count, repr(b.min), repr(b.max), repr(b.last)]
        )
    return out.getvalue()


def series_heading(run_id: str, series: SeriesResult) -> str:
    merged = f", {series.series} series merged" if series.series > 1 else ""
    if series.downsampled:
        shape = (
            f"{series.total_points} points in {len(series.buckets)} buckets "
            f"({chart.RANGE} min..max, {chart.LAST} last)"
        )
    else:
        shape = f"{series.total_points} points"
    return f"{series.tag} of {run_id}, attempt {series.attempt}: {shape}{merged}"


def points_table(series: SeriesResult) -> Table:
    table = Table(show_header=True)
    if series.downsampled:
        for column in ("steps", "count", "min", "max", "last"):
            table.add_column(column, justify="right")
        for b in series.buckets:
            table.add_row(
                f"{b.first_step}..{b.last_step}",
                str(b.count),
                _number(b.min),
                _number(b.max),
                _number(b.last),
            )
    else:
        table.add_column("step", justify="right")
        table.add_column("value", justify="right")
        for b in series.buckets:
            table.add_row(str(b.first_step), _number(b.last))
    return table


def delivery_table(now_ms: int, members: list[Delivery]) -> Table:
    table = Table(title="telemetry delivery", title_justify="left")
    for column in ("attempt", "member", "points stored", "spooled on Node", "last point", "state"):
        right = column not in ("state", "last point")
        table.add_column(column, justify="right" if right else "left")
    for d in members:
        if d.drained:
            state = "delivered (member exited)"
        elif d.backpressure:
            state = "spool full: reading paused"
        else:
            state = f"shipping (last call {_age(now_ms, d.last_contact_ms)})"
        if d.data_loss_warnings:
            # Values the collector could not read or ship, and files it did not follow (its
            # file cap, its search bounds): docs/telemetry.md, "Warnings".
            lost = d.data_loss_warnings
            state += (
                f"; {lost} data-loss warning{'' if lost == 1 else 's'} (values or files not read)"
            )
        if d.orphaned_points:
            state += f"; {d.orphaned_points} points orphaned by a restarted TensorBoard writer"
        table.add_row(
            str(d.member.attempt),
            str(d.member.member_index),
            str(d.points_stored),
            str(d.spool_points),
            _age(now_ms, d.last_point_wall_ms),
            state,
        )
    return table


def hparams_table(members: list[Delivery]) -> Table | None:
    """Each member's runs and the hparams they recorded; None when none recorded any."""
    rows = [(d, h) for d in members for h in d.hparams]
    if not rows:
        return None
    table = Table(title="hparams", title_justify="left")
    for column in ("attempt", "member", "source", "hparams", "metrics"):
        table.add_column(column, justify="right" if column in ("attempt", "member") else "left")
    for d, h in rows:
        table.add_row(
            str(d.member.attempt),
            str(d.member.member_index),
            h.source,
            ", ".join(f"{name}={value}" for name, value in h.hparams) or "-",
            ", ".join(h.metrics) or "-",
        )
    return table


def hparams_json(members: list[Delivery]) -> list[dict[str, Any]]:
    """Each run's hparams for ``--json``: values as the JSON they were recorded as."""
    return [
        {
            "attempt": d.member.attempt,
            "member_index": d.member.member_index,
            "source": h.source,
            "hparams": {name: json.loads(value) for name, value in h.hparams},
            "metrics": list(h.metrics),
        }
        for d in members
        for h in d.hparams
    ]


def job_json(endpoint: Endpoint, run_id: str, job_text: str) -> str:
    """``tp job show --json``: the Job, with ``hparams`` from its telemetry. When the
    telemetry cannot be read the Job is printed without it and a note goes to stderr."""
    try:
        _, members = _run(endpoint, lambda api: api.delivery(run_id))
    except ApiError as exc:
        click.echo(f"hparams unavailable: {exc}", err=True)
        return job_text
    data = json.loads(job_text)
    data["hparams"] = hparams_json(members)
    return json.dumps(data, indent=2, sort_keys=True)


def delivery_section(endpoint: Endpoint, run_id: str) -> list[Any]:
    """What ``tp job show`` prints about telemetry; a failure is a note, never an error,
    because a Job's state never depends on its metrics."""
    try:
        now, members = _run(endpoint, lambda api: api.delivery(run_id))
    except ApiError as exc:
        return [Text(f"telemetry delivery unavailable: {exc}", style="yellow")]
    if not members:
        return [Text("telemetry delivery: no points received yet")]
    hparams = hparams_table(members)
    return [delivery_table(now, members)] + ([hparams] if hparams is not None else [])


def delivery_json(d: Delivery) -> dict[str, Any]:
    """One member's delivery as ``--json`` prints it: its attempt and index beside its counts
    (the Job is the one the command named)."""
    return {
        "attempt": d.member.attempt,
        "member_index": d.member.member_index,
        "points_stored": d.points_stored,
        "spool_points": d.spool_points,
        "backpressure": d.backpressure,
        "drained": d.drained,
        "last_point_wall_ms": d.last_point_wall_ms,
        "last_contact_ms": d.last_contact_ms,
        "warnings": d.warnings,
        "data_loss_warnings": d.data_loss_warnings,
        "hparams": d.hparams,
        "orphaned_points": d.orphaned_points,
    }


def _delivery_json(now: int, members: list[Delivery]) -> dict[str, Any]:
    return {"server_time_ms": now, "members": [delivery_json(d) for d in members]}


@click.command("metrics")
@click.argument("run_id")
@click.option("--tag", help="Draw this tag's series (without it: list the tags).")
@click.option(
    "--max-points",
    type=click.IntRange(min=1, max=MAX_MAX_POINTS),
    default=DEFAULT_MAX_POINTS,
    show_default=True,
    help="At most this many points or buckets come back.",
)
@click.option("--raw", is_flag=True, help="Keep series apart by member and source.")
@click.option("--attempt", type=click.IntRange(min=1), help="Read this attempt (default: latest).")
@click.option("--member", type=click.IntRange(min=0), help="Only this member (needs --raw).")
@click.option("--source", help="Only this source file (needs --raw).")
@click.option("--delivery", is_flag=True, help="Show how far each member's points arrived.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--csv", "as_csv", is_flag=True, help="Print the series as CSV (needs --tag).")
@click.option("--width", type=click.IntRange(min=30), help="Chart width (default: the terminal).")
@click.pass_obj
def metrics(
    options: Any,
    run_id: str,
    tag: str | None,
    max_points: int,
    raw: bool,
    attempt: int | None,
    member: int | None,
    source: str | None,
    delivery: bool,
    as_json: bool,
    as_csv: bool,
    width: int | None,
) -> None:
    """A Job's metrics: tags with point counts and last values, or with --tag one bounded,
    downsampled series drawn as a chart (--raw: the raw scalar inspector)."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv both choose the output; pick one.")
    if (member is not None or source) and not raw:
        raise click.UsageError(
            "--member and --source narrow the raw view; add --raw (the canonical view merges "
            "every member and source)."
        )
    if as_csv and not tag:
        raise click.UsageError("--csv prints one series; name it with --tag.")
    endpoint: Endpoint = options.endpoint()
    out = render.console()
    if delivery:
        now, members = _run(endpoint, lambda api: api.delivery(run_id))
        if as_json:
            click.echo(render.to_json(_delivery_json(now, members)))
        elif not members:
            click.echo(f"No points of {run_id} have reached the coordinator yet.")
        else:
            out.print(delivery_table(now, members))
        return
    at, src = attempt or 0, source or ""
    if not tag:

        async def list_work(api: MetricsClient) -> tuple[int, list[TagSummary]]:
            return await api.list_metrics(run_id, raw=raw, attempt=at, member=member, source=src)

        found_attempt, tags = _run(endpoint, list_work)
        if as_json:
            click.echo(render.to_json({"attempt": found_attempt, "tags": tags}))
        elif not tags:
            click.echo(f"Job {run_id} has no metrics yet.")
        else:
            out.print(tags_table(run_id, found_attempt, tags, raw))
        return

    async def series_work(api: MetricsClient) -> SeriesResult:
        assert tag is not None
        return await api.query_series(
            run_id, tag, max_points, raw=raw, attempt=at, member=member, source=src
        )

    series = _run(endpoint, series_work)
    if as_json:
        click.echo(render.to_json(series))
        return
    if as_csv:
        sys.stdout.write(series_csv(series))
        return
    out.print(series_heading(run_id, series), markup=False)
    for line in chart.draw(series.buckets, width or min(out.width, 120), 12):
        out.print(line, markup=False, highlight=False, overflow="ignore", crop=False)
    if raw:
        out.print(points_table(series))
