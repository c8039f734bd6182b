"""What every ``tuneplane-coordinator`` command shares: its options, running its work with
errors told as sentences, opening the store, and asking whether ``serve`` runs.

Rules: every failure is one sentence on stderr naming the file or option, what is wrong and how
to fix it, with exit status 1 (2 for a malformed command line, as click does). Commands that touch
the store open the store a running ``serve`` uses (the SQLite files of the state directory, or the
PostgreSQL database ``[store] url`` names), one writer at a time, so they work while it runs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click

from tuneplane.proto.contract.input_checks import InputRefused

from ..config import ConfigError, parse_duration, store_setting
from ..server.serve_error import ServeError
from ..server.state_dir import (
    ENDPOINTS,
    StateDirError,
    coordinator_where,
    require_initialised,
)
from ..server.tls import TlsError
from ..store.core import Store, StoreError
from ..store.decision_log import DecisionLogError
from ..store_location import PostgresUrl, StoreUrlError, parse_store_url
from .api_errors import ApiError
from .connection import ConnectionConfigError

T = TypeVar("T")
#: A Fleet's or a user's name: 1-63 lowercase letters, digits, '.', '_' or '-'.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_ERRORS = (
    InputRefused,
    StateDirError,
    StoreError,
    ConfigError,
    TlsError,
    ServeError,
    DecisionLogError,
    ApiError,
    ConnectionConfigError,
    StoreUrlError,
)

state_dir_option = click.option(
    "--state-dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="The coordinator's state directory.",
)


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` under anyio; a known error becomes the command's one-sentence failure."""
    try:
        return anyio.run(fn, *args, backend="asyncio")
    except _ERRORS as exc:
        raise click.ClickException(str(exc)) from None


def run_sync(fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)``; a known error becomes the command's one-sentence failure."""
    try:
        return fn(*args)
    except _ERRORS as exc:
        raise click.ClickException(str(exc)) from None


def store_option(text: str | None) -> PostgresUrl | None:
    """``--store``: a PostgreSQL URL checked now, before anything is touched."""
    if text is None:
        return None
    try:
        return parse_store_url(text, "--store")
    except StoreUrlError as exc:
        raise click.BadParameter(str(exc), param_hint="--store") from None


def parse_ttl(text: str, option: str = "--ttl") -> int:
    """``30s``, ``15m``, ``1h``, ``7d`` -> seconds."""
    seconds = parse_duration(text)
    if seconds is None:
        raise click.BadParameter(
            f"{text!r} is not a duration. Write a whole number and a unit: 30s, 15m, 1h or 7d.",
            param_hint=option,
        )
    return seconds


async def with_store(state_dir: Path, work: Callable[[Store], Awaitable[T]]) -> T:
    """Open the store the state directory's ``serve`` uses, run ``work`` on it, close it."""
    url = store_setting(state_dir)
    require_initialised(state_dir, url)
    store = await Store.open(coordinator_where(state_dir, url))
    try:
        return await work(store)
    finally:
        await store.close()


def serving_pid(state_dir: Path) -> int:
    """The pid of a ``serve`` running on this state directory (its endpoints.json), or 0."""
    try:
        pid = int(json.loads((state_dir / ENDPOINTS).read_text(encoding="utf-8"))["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return pid
