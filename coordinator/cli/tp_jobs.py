"""``tp job``: list Jobs and show one; ``tp job cancel`` and ``retry`` join the group from
:mod:`.jobctl`.

Rules: the same exit codes and error sentences as the rest of ``tp`` (errors propagate to
``tp.main``); ``--json`` prints stable JSON and nothing else on stdout, so notes about the list
go to stderr.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from .. import lifecycle
from ..values.jobs import JOB_LIST_DEFAULT, JOB_LIST_MAX, Job
from . import render
from .jobctl import job_cancel, job_retry
from .metrics import delivery_section, job_json
from .tp_common import Options, run

if TYPE_CHECKING:
    from .api_client import ApiClient


def check_job_limit(_ctx: click.Context, _param: click.Parameter, value: int) -> int:
    """``--limit`` of ``tp job ls``, or a usage error saying what it accepts: the coordinator
    never answers more than :data:`JOB_LIST_MAX` Jobs at once, so "all" (0) is not offered."""
    if not 1 <= value <= JOB_LIST_MAX:
        raise click.BadParameter(
            f"{value} is not a number of Jobs tp can list: give 1 to {JOB_LIST_MAX} (0 does not "
            f"mean all; the coordinator answers at most {JOB_LIST_MAX} Jobs at once). Narrow the "
            "list with --project, --state or --mine to see older Jobs.",
            param_hint="--limit",
        )
    return value


@click.group(name="job")
def job() -> None:
    """Jobs on the coordinator."""


@job.command("ls")
@click.option("--project", default="", help="Only Jobs of this project.")
@click.option(
    "--state",
    type=click.Choice(sorted(lifecycle.JOB_TRANSITIONS)),
    metavar="STATE",
    help="Only Jobs in this state: " + ", ".join(sorted(lifecycle.JOB_TRANSITIONS)) + ".",
)
@click.option("--mine", is_flag=True, help="Only Jobs you submitted.")
@click.option(
    "--limit",
    type=int,
    default=JOB_LIST_DEFAULT,
    show_default=True,
    callback=check_job_limit,
    help=f"At most N Jobs, newest first (1 to {JOB_LIST_MAX}).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def job_ls(
    options: Options, project: str, state: str | None, mine: bool, limit: int, as_json: bool
) -> None:
    """List Jobs, newest first as the coordinator returns them."""

    async def work(api: ApiClient) -> list[Job]:
        return await api.list_jobs(project=project, state=state or "", mine=mine, limit=limit)

    jobs = run(options.endpoint(), work)
    if as_json:
        click.echo(render.to_json(jobs))
    elif not jobs:
        click.echo("No Jobs match.")
    else:
        render.console().print(render.jobs_table(jobs))
    if len(jobs) >= limit:
        # Said on stderr so that --json output stays one JSON document.
        click.echo(
            f"Showing the newest {limit} Jobs; there may be more. Narrow the list with "
            f"--project, --state or --mine, or raise --limit (at most {JOB_LIST_MAX}).",
            err=True,
        )


@job.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--watch", is_flag=True, help="Keep showing the Job until it is terminal.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=1.0,
    show_default=True,
    help=(
        "With --watch: seconds between tries while the coordinator does not answer, and between "
        "polls of a coordinator too old to send changes as they happen."
    ),
)
@click.pass_obj
def job_show(options: Options, run_id: str, as_json: bool, watch: bool, interval: float) -> int:
    """Show a Job: state history, attempts and their members, Derivation.

    Of a failed Job, also the member that failed first (by when its Node reported its end), its
    Node, its exit and the last lines of its stderr. With --watch, the view refreshes until the
    Job is terminal (with --json: one JSON object per change); Ctrl-C stops watching and leaves
    the Job alone.
    """
    if watch:
        from .watch import watch_job

        return watch_job(options.endpoint(), run_id, as_json, interval)

    async def work(api: ApiClient) -> Job:
        return await api.get_job(run_id)

    found = run(options.endpoint(), work)
    if as_json:
        click.echo(job_json(options.endpoint(), run_id, render.to_json(found)))
        return 0
    out = render.console()
    for part in render.job_view(found):
        out.print(part)
    for part in delivery_section(options.endpoint(), run_id):
        out.print(part)
    return 0


job.add_command(job_cancel)
job.add_command(job_retry)
