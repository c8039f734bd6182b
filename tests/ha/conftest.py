"""High-availability tests: coordinators sharing one real PostgreSQL database.

Rules: each test gets a fresh database of its own on the session's embedded PostgreSQL
(:mod:`tests.support.postgres`), dropped when it ends; every coordinator it starts is made the
PostgreSQL backend's (:func:`tests.support.store_backend.current`), so ``start_coordinator`` and
``store_backend.where`` follow it. Without PostgreSQL these tests skip with a sentence (fail
under ``CI=true``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.postgres import PostgresServer
from tests.support.postgres import postgres_server as postgres_server
from tests.support.store_backend import StoreBackend, in_use


@pytest.fixture
def pg_backend(postgres_server: PostgresServer) -> Iterator[StoreBackend]:
    """The PostgreSQL backend, with a database of this test's own, in use while it runs."""
    with in_use(StoreBackend("postgresql", postgres_server)) as backend:
        yield backend
