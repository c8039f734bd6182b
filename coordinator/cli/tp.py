"""``tp``: the researcher's CLI (project, experiments, recipes, submit, jobs).

This module is the front door: the click group with its global flags, and :func:`main`, which
turns errors into exit codes. The commands live beside it, one module per concern:
``tp_project`` (init, new, recipe), ``tp_submit`` (submit), ``tp_jobs`` (job), ``jobctl``
(job cancel, job retry, logs), ``ops`` (fleet, node) and ``metrics``; what they share is in
``tp_common``.

Rules: exit 0 on success, 1 when a request is refused (by the coordinator, or by tp's own checks
of the project), 2 when the command line or the connection configuration is wrong; every error is
one sentence on stderr. ``--json`` prints stable JSON on stdout and nothing else there.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from .api_errors import ApiError, ClientConfigError
from .connection import RIDE_OUT_S, ConnectionConfigError
from .intent import IntentError
from .jobctl import logs_command
from .metrics import metrics
from .ops import fleet_group, node_group
from .project import ProjectError
from .tp_common import Options
from .tp_jobs import job
from .tp_project import init, new, recipe
from .tp_submit import submit

EXIT_REFUSED = 1
EXIT_USAGE = 2
# Errors that mean "change how you called tp" rather than "the request was refused".
_USAGE_ERRORS = (ConnectionConfigError, IntentError, ClientConfigError)


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
    metavar="HOST:PORT[,...]",
    help="The coordinator's API address; several, comma-separated, when coordinators share a "
    "store (env TUNEPLANE_COORDINATOR).",
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
@click.option(
    "--ride-out",
    "ride_out_s",
    envvar="TUNEPLANE_RIDE_OUT",
    type=click.FloatRange(min=0),
    default=RIDE_OUT_S,
    show_default=True,
    metavar="SECONDS",
    help="With several coordinators, how long a call keeps trying them (a takeover) before it "
    "gives up (env TUNEPLANE_RIDE_OUT).",
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
    ride_out_s: float,
    verbose: bool,
) -> None:
    """Submit and follow TunePlane Jobs from a project directory."""
    if verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = Options(context, coordinator, ca, token_file, ride_out_s)


for _command in (init, new, recipe, submit, job, logs_command, fleet_group, metrics, node_group):
    cli.add_command(_command)


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
