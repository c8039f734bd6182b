"""``tp submit``: preview an experiment as a Job, commit a preview, or both at once.

Rules: the same exit codes and error sentences as the rest of ``tp`` (errors propagate to
``tp.main``); ``--json`` prints one JSON object per line and nothing else on stdout. A preview is
saved with its retry key before it is committed, so committing it again never makes two Jobs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import click

from tuneplane.proto.contract import jobspec

from ..catalogue import Catalogue
from ..values.jobs import Receipt
from . import render, submissions
from .api_errors import ApiError, CoordinatorUnreachable, RequestRefused
from .intent import SubmitRequest, build_jobspec
from .project import Project, ProjectError
from .tp_common import Options, here, run

if TYPE_CHECKING:
    from .api_client import ApiClient

log = logging.getLogger(__name__)


@click.command(name="submit")
@click.argument("experiment", required=False)
@click.option("--profile", metavar="PROFILE[:GPUS]", help="e.g. h200:8 (GPUs for the whole Job).")
@click.option("--members", type=click.IntRange(min=1), help="Split the GPUs over N Nodes.")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE", help="Recipe parameter.")
@click.option("--env", "env_vars", multiple=True, metavar="NAME=VALUE", help="Workload env.")
@click.option("--init-from", metavar="RUN_ID", help="Begin from another run's artifact.")
@click.option(
    "--image",
    metavar="REGISTRY/NAME:TAG|@sha256:HEX",
    help="Run in this image instead of the recipe's runtime; a tag is pinned at Preview.",
)
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
    image: str | None,
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
        shaping = (experiment, profile, members, init_from, image) != (None,) * 5
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
    project = here()
    request = SubmitRequest(experiment, profile, members, params, env_vars, init_from, image)
    spec = build_jobspec(project, request, Catalogue.bundled())
    endpoint = options.endpoint()
    log.debug("jobspec built experiment=%s local_digest=%s", experiment, jobspec.digest(spec))

    async def work(api: ApiClient) -> None:
        preview = await api.preview(jobspec.canonical_json(spec))
        record = submissions.Submission(
            format=submissions.FORMAT,
            coordinator=api.address,
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

    run(endpoint, work)


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
        project: Project | None = here()
    except ProjectError:
        project = None
    path = submissions.locate(target, project)
    record = submissions.load(path)
    endpoint = options.endpoint()
    # Coordinators sharing a store share its previews: any of them may commit this one.
    if record.coordinator not in endpoint.addresses:
        raise ProjectError(
            f"Preview {record.preview.preview_id} was made by the coordinator at "
            f"{record.coordinator}, but tp is configured for {', '.join(endpoint.addresses)}; "
            "commit it there (--context or --coordinator) or preview again here."
        )

    async def work(api: ApiClient) -> submissions.Submission:
        return await _confirm(api, path, record)

    record = run(endpoint, work)
    if record.receipt is not None:
        _print_receipt(record.receipt, as_json)
