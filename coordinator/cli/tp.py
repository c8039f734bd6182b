"""``tp``: the researcher's CLI (project, experiments, recipes, submit, jobs).

Rules: exit 0 on success, 1 when a request is refused (by the coordinator, or by tp's own checks
of the project), 2 when the command line or the connection configuration is wrong; every error is
one sentence on stderr. ``--json`` prints stable JSON on stdout and nothing else there.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs
import click

from tuneplane.proto.contract import jobspec

from .. import lifecycle
from ..catalogue import Catalogue
from ..values.jobs import JOB_LIST_DEFAULT, JOB_LIST_MAX, Job, Receipt
from . import render, submissions
from .api_errors import (
    ApiError,
    ClientConfigError,
    CoordinatorUnreachable,
    RequestRefused,
)
from .connection import (
    ConnectionConfigError,
    Endpoint,
    resolve_connection,
)
from .intent import IntentError, SubmitRequest, build_jobspec
from .jobctl import job_cancel, job_retry, logs_command
from .metrics import delivery_section, job_json, metrics
from .ops import fleet_group, node_group
from .project import (
    LOCK_FILE,
    Project,
    ProjectError,
    find_project,
    init_project,
    upgrade_lock,
)
from .scaffold import new_experiment

if TYPE_CHECKING:
    from .api_client import ApiClient

log = logging.getLogger(__name__)
T = TypeVar("T")

EXIT_REFUSED = 1
EXIT_USAGE = 2
# Errors that mean "change how you called tp" rather than "the request was refused".
_USAGE_ERRORS = (ConnectionConfigError, IntentError, ClientConfigError)


@attrs.frozen
class Options:
    """The global flags; the connection is resolved only by commands that talk to the server."""

    context: Path | None
    coordinator: str | None
    ca: Path | None
    token_file: Path | None

    def endpoint(self) -> Endpoint:
        return resolve_connection(self.context, self.coordinator, self.ca, self.token_file)


def _run(endpoint: Endpoint, work: Callable[[ApiClient], Awaitable[T]]) -> T:
    # Imported here: grpclib, betterproto and asyncio cost a tenth of a second at start, which
    # the commands that never talk to the coordinator (init, new, recipe) should not pay.
    import asyncio

    from .api_client import ApiClient

    async def go() -> T:
        async with ApiClient(endpoint) as api:
            return await work(api)

    return asyncio.run(go())


def _here() -> Project:
    return find_project(Path.cwd())


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--context",
    envvar="TUNEPLANE_CONTEXT",
    type=click.Path(path_type=Path, dir_okay=False),
    help="tp-context.json written by the coordinator (env TUNEPLANE_CONTEXT).",
)
@click.option(
    "--coordinator",
    envvar="TUNEPLANE_COORDINATOR",
    metavar="HOST:PORT",
    help="The coordinator's API address (env TUNEPLANE_COORDINATOR).",
)
@click.option(
    "--ca",
    envvar="TUNEPLANE_CA",
    type=click.Path(path_type=Path, dir_okay=False),
    help="CA certificate that must vouch for the coordinator (env TUNEPLANE_CA).",
)
@click.option(
    "--token-file",
    envvar="TUNEPLANE_TOKEN_FILE",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding your API token (env TUNEPLANE_TOKEN_FILE).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log what tp does to stderr.")
@click.version_option(package_name="tuneplane", prog_name="tp")
@click.pass_context
def cli(
    ctx: click.Context,
    context: Path | None,
    coordinator: str | None,
    ca: Path | None,
    token_file: Path | None,
    verbose: bool,
) -> None:
    """Submit and follow TunePlane Jobs from a project directory."""
    if verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = Options(context, coordinator, ca, token_file)


# -- project ---------------------------------------------------------------------------------


@cli.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path, file_okay=False))
@click.option("--name", help="Project name (default: the directory's name).")
def init(directory: Path | None, name: str | None) -> None:
    """Make DIRECTORY (default: here) a project by writing tuneplane.yaml."""
    folder = directory or Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    project = init_project(folder, name)
    click.echo(f"Initialised project {project.name} in {project.root} (tuneplane.yaml).")
    click.echo("Next: tp new <experiment> --method custom/custom")


@cli.command()
@click.argument("experiment")
@click.option(
    "--method",
    "method_id",
    required=True,
    metavar="FRAMEWORK/METHOD",
    help="Method id from `tp recipe ls`, e.g. custom/custom.",
)
def new(experiment: str, method_id: str) -> None:
    """Create experiments/EXPERIMENT/ for a method, with its config and recipe lock."""
    project = _here()
    for path in new_experiment(project, experiment, method_id, Catalogue.bundled()):
        click.echo(f"wrote {project.shown(path)}")
    click.echo(f"Next: tp submit {experiment} --profile <profile>[:<gpus>] --preview")


@cli.group()
def recipe() -> None:
    """The Catalogue's recipes and your experiments' locks on them."""


@recipe.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def recipe_ls(as_json: bool) -> None:
    """List the recipes of the Catalogue bundled with this tp."""
    catalogue = Catalogue.bundled()
    if as_json:
        data = {"recipes": [render.recipe_json(r) for r in catalogue]}
        click.echo(render.to_json(data))
    else:
        out = render.console()
        click.echo("Catalogue bundled with this tp:")
        out.print(render.recipes_table(catalogue))


@recipe.command("upgrade")
@click.argument("experiment")
@click.option(
    "--method",
    "method_id",
    metavar="FRAMEWORK/METHOD",
    help="Move the experiment to this method (also writes a missing lock).",
)
def recipe_upgrade(experiment: str, method_id: str | None) -> None:
    """Rewrite EXPERIMENT's recipe.lock.json to the Catalogue's current recipe."""
    project = _here()
    old, new_lock = upgrade_lock(project, experiment, Catalogue.bundled(), method_id)
    shown = project.shown(project.experiment_dir(experiment) / LOCK_FILE)
    if old == new_lock:
        click.echo(f"{shown} is already current ({new_lock.method_id} {new_lock.recipe_version}).")
        return
    if old is None:
        click.echo(f"wrote {shown} for {new_lock.method_id} {new_lock.recipe_version}.")
        return
    click.echo(f"upgraded {shown}:")
    for line in old.differences(new_lock):
        click.echo(f"  {line}")


# -- submit ----------------------------------------------------------------------------------


@cli.command()
@click.argument("experiment", required=False)
@click.option("--profile", metavar="PROFILE[:GPUS]", help="e.g. h200:8 (GPUs for the whole Job).")
@click.option("--members", type=click.IntRange(min=1), help="Split the GPUs over N Nodes.")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE", help="Recipe parameter.")
@click.option("--env", "env_vars", multiple=True, metavar="NAME=VALUE", help="Workload env.")
@click.option("--init-from", metavar="RUN_ID", help="Begin from another run's artifact.")
@click.option("--preview", "preview_only", is_flag=True, help="Preview only; commit later.")
@click.option("--yes", is_flag=True, help="Preview and commit at once.")
@click.option("--commit", "commit_target", metavar="PREVIEW", help="Commit a preview (file/id).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def submit(
    options: Options,
    experiment: str | None,
    profile: str | None,
    members: int | None,
    params: tuple[str, ...],
    env_vars: tuple[str, ...],
    init_from: str | None,
    preview_only: bool,
    yes: bool,
    commit_target: str | None,
    as_json: bool,
) -> None:
    """Preview EXPERIMENT (--preview), or preview and commit it (--yes); or --commit a preview.

    A preview creates no Job. Committing the same preview again returns the same receipt.
    With --json, prints one JSON object per line: the preview ("kind": "preview"), then the
    receipt ("kind": "receipt") once committed.
    """
    if commit_target is not None:
        shaping = (experiment, profile, members, init_from) != (None, None, None, None)
        if shaping or params or env_vars or preview_only or yes:
            raise click.UsageError(
                "--commit takes only the preview (file or id); the intent was fixed when it "
                "was previewed. Preview again to change it."
            )
        _commit(options, commit_target, as_json)
        return
    if experiment is None:
        raise click.UsageError("Name the experiment to submit, or give --commit PREVIEW.")
    if preview_only == yes:
        raise click.UsageError(
            "Say --preview to see what would run (and commit later with --commit), "
            "or --yes to preview and commit at once."
        )
    project = _here()
    request = SubmitRequest(experiment, profile, members, params, env_vars, init_from)
    spec = build_jobspec(project, request, Catalogue.bundled())
    endpoint = options.endpoint()
    log.debug("jobspec built experiment=%s local_digest=%s", experiment, jobspec.digest(spec))

    async def work(api: ApiClient) -> None:
        preview = await api.preview(jobspec.canonical_json(spec))
        record = submissions.Submission(
            format=submissions.FORMAT,
            coordinator=endpoint.address,
            project=project.name,
            experiment=experiment,
            retry_key=submissions.new_retry_key(),
            preview=preview,
        )
        path = submissions.path_for(project, preview.preview_id)
        submissions.save(path, record)
        log.debug("preview saved preview_id=%s path=%s", preview.preview_id, path)
        saved = project.shown(path)
        if as_json:
            click.echo(render.json_line(render.preview_json(record, path)))
        else:
            out = render.console()
            out.print(render.preview_view(preview, experiment, project.name, saved))
        if yes:
            try:
                record = await _confirm(api, path, record)
            except ApiError as exc:
                raise _with_retry_hint(exc, preview.preview_id) from None
        if record.receipt is not None:
            _print_receipt(record.receipt, as_json)
        elif not as_json:
            click.echo(f"Commit it with: tp submit --commit {preview.preview_id}")

    _run(endpoint, work)


async def _confirm(
    api: ApiClient, path: Path, record: submissions.Submission
) -> submissions.Submission:
    p = record.preview
    receipt = await api.commit(p.preview_id, p.digest, record.retry_key)
    record = attrs.evolve(record, receipt=receipt)
    submissions.save(path, record)
    return record


def _with_retry_hint(exc: ApiError, preview_id: str) -> ApiError:
    """The preview is saved with its retry key, so confirming again can never make two Jobs."""
    hint = (
        f" The preview is saved: confirm it again with `tp submit --commit {preview_id}` "
        "(same retry key, so at most one Job)."
    )
    if isinstance(exc, RequestRefused):
        return RequestRefused(exc.status, f"{exc}{hint}")
    return CoordinatorUnreachable(f"{exc}{hint}")


def _print_receipt(receipt: Receipt, as_json: bool) -> None:
    if as_json:
        click.echo(render.json_line(render.receipt_json(receipt)))
        return
    click.echo(render.receipt_line(receipt))
    click.echo(f"Follow it with: tp job show {receipt.run_id}")


def _commit(options: Options, target: str, as_json: bool) -> None:
    try:
        project: Project | None = _here()
    except ProjectError:
        project = None
    path = submissions.locate(target, project)
    record = submissions.load(path)
    endpoint = options.endpoint()
    if record.coordinator != endpoint.address:
        raise ProjectError(
            f"Preview {record.preview.preview_id} was made by the coordinator at "
            f"{record.coordinator}, but tp is configured for {endpoint.address}; commit it there "
            "(--context or --coordinator) or preview again here."
        )

    async def work(api: ApiClient) -> submissions.Submission:
        return await _confirm(api, path, record)

    record = _run(endpoint, work)
    if record.receipt is not None:
        _print_receipt(record.receipt, as_json)


# -- jobs ------------------------------------------------------------------------------------


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


@cli.group()
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

    jobs = _run(options.endpoint(), work)
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
    help="Seconds between refreshes with --watch.",
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

    found = _run(options.endpoint(), work)
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
cli.add_command(logs_command)
cli.add_command(fleet_group)
cli.add_command(metrics)
cli.add_command(node_group)


# -- entry point -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run tp; returns (and, as a console script, exits with) 0, 1 or 2."""
    try:
        rc = cli.main(args=argv, prog_name="tp", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        return EXIT_USAGE
    except click.ClickException as exc:
        exc.show()
        return EXIT_REFUSED
    except click.Abort:
        click.echo("Aborted.", err=True)
        return EXIT_REFUSED
    except _USAGE_ERRORS as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_USAGE
    except (ProjectError, ApiError) as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_REFUSED
    except BrokenPipeError:
        # `tp job ls | head`: the reader left; that is not an error worth a traceback.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - must outlive this frame for exit
        return 0
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
