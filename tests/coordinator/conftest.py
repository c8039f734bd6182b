"""Every test in tests/coordinator runs twice: on SQLite files and on a PostgreSQL database.

Rules: the backend is a module-scoped parameter (all of a module's tests run on SQLite, then all
on PostgreSQL), so a module-scoped fixture (one coordinator shared by a module's tests) asks for
``module_store_backend`` and gets a coordinator of its own per backend. Each test also gets a
``store_backend`` of its own (on PostgreSQL, its own database), made
:func:`tests.support.store_backend.current` while it runs; tests/support (``start_coordinator``,
``store_backend.where``) follows it. A test whose subject is SQLite itself (a file written by hand,
WAL) says so with ``@pytest.mark.sqlite_only("why")`` and is skipped on PostgreSQL with that reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.postgres import postgres_server as postgres_server
from tests.support.store_backend import StoreBackend, in_use


@pytest.fixture(scope="module", autouse=True, params=["sqlite", "postgresql"])
def store_backend_name(request: pytest.FixtureRequest) -> str:
    """Which backend this pass over the module uses."""
    return str(request.param)


def _backend(name: str, request: pytest.FixtureRequest) -> StoreBackend:
    if name == "postgresql":
        return StoreBackend(name, request.getfixturevalue("postgres_server"))
    return StoreBackend(name)


@pytest.fixture(scope="module")
def module_store_backend(
    store_backend_name: str, request: pytest.FixtureRequest
) -> Iterator[StoreBackend]:
    """One backend for the whole pass over a module, for a module-scoped fixture's coordinator."""
    with in_use(_backend(store_backend_name, request)) as backend:
        yield backend


@pytest.fixture(autouse=True)
def store_backend(
    store_backend_name: str, request: pytest.FixtureRequest
) -> Iterator[StoreBackend]:
    """The backend this test uses, with a database of its own on PostgreSQL."""
    if store_backend_name == "postgresql":
        only = request.node.get_closest_marker("sqlite_only")
        if only is not None:
            pytest.skip(f"SQLite only: {only.args[0] if only.args else 'its subject is SQLite'}")
    with in_use(_backend(store_backend_name, request)) as backend:
        yield backend
