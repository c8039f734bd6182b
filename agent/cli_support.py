"""What every ``tuneplane-node`` command group shares: errors as sentences, ``--state-dir``, times.

Rules: a typed error the agent expects becomes one sentence on stderr and exit status 1 (never a
traceback); anything else is a bug and propagates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from . import journal_read
from .inventory import InventoryError
from .journal_records import JournalError
from .state_dir import StateDirError
from .wire_errors import WireError

F = TypeVar("F", bound=Callable[..., Any])
EXPECTED_ERRORS = (
    WireError,
    StateDirError,
    InventoryError,
    JournalError,
    journal_read.JournalUnreadable,
    ValueError,
)


@contextmanager
def sentences() -> Iterator[None]:
    """Turn the agent's typed errors into a one-line message and exit status 1."""
    try:
        yield
    except EXPECTED_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    except BaseExceptionGroup as group:
        # Trio nurseries group what their tasks raised; show the first expected one plainly.
        matched, _rest = group.split(EXPECTED_ERRORS)
        if matched is None:
            raise
        first: BaseException = matched
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise click.ClickException(str(first)) from None


def state_dir_option(fn: F) -> F:
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("/var/lib/tuneplane-node"),
        show_default=True,
        help="The Node's private state directory (node.json, credentials, journal.db).",
    )(fn)


def image_root_option(fn: F) -> F:
    return click.option(
        "--image-root",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Where runtime images are cached, as `run` was given it (default: tuneplane-images "
        "beside the state dir).",
    )(fn)


def duration_s(text: str) -> int | None:
    """A duration written ``30s``, ``10m``, ``2h`` or ``1d`` in seconds; None for anything else."""
    match = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if match is None:
        return None
    return int(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def ms_text(value: int | None) -> str:
    """Epoch milliseconds as UTC wall time for a table ("-" for none)."""
    if value is None:
        return "-"
    return datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
