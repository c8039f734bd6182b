"""The coordinator's state directory: what ``init`` creates and what ``serve`` publishes.

Rules:
- ``init`` refuses a directory that already holds a coordinator; it never overwrites keys, the
  store or the admin token. Secrets are 0600, the directory 0700.
- The stores are SQLite files here unless ``init --store`` named a PostgreSQL database, which
  ``[store] url`` in coordinator.toml then records (0600 if the URL carries a password). That
  database is reached first: one that cannot be reached, or already holds a coordinator, stops
  ``init`` before anything is written here.
- ``endpoints.json`` and ``tp-context.json`` are written atomically, only once every listener
  accepts connections, so a reader that sees them can dial at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import attrs

from tuneplane.agent.atomic_file import fsync_dir, write_atomic

from ..auth import USER_PREFIX, hash_credential, new_credential
from ..clock import now_ms
from ..config import CONFIG_NAME, DEFAULT_CONFIG, store_table
from ..store.core import DB_NAME, Store, db_path
from ..store.users import users
from ..store_location import PostgresUrl, Where, store_where
from .tls import TlsPaths, create_dev_ca, default_sans

ADMIN_TOKEN = "admin.token"
ENDPOINTS = "endpoints.json"
#: The lock serve shares and migrate-store holds alone (coordinator/server/serve_lock.py); made
#: by init, so a serve that is refused for its configuration leaves the directory as it found it.
SERVE_LOCK = "serve.lock"
TP_CONTEXT = "tp-context.json"


class StateDirError(RuntimeError):
    """The state directory cannot be used as asked; ``str()`` says why and what to do."""


def _just_this_api(endpoints: Endpoints) -> tuple[str, ...]:
    return (endpoints.api,)


def _address_tuple(addresses: Iterable[str]) -> tuple[str, ...]:
    return tuple(addresses)


@attrs.frozen
class Endpoints:
    api: str
    control: str
    telemetry: str
    ca: str
    pid: int
    # The Prometheus listener's address ([metrics] in coordinator.toml); "" when it is off.
    metrics: str = ""
    # Every coordinator's API address when several share the store (this one first), which tp
    # tries in turn to follow the leader; alone, just ``api``.
    api_addresses: tuple[str, ...] = attrs.field(
        default=attrs.Factory(_just_this_api, takes_self=True), converter=_address_tuple
    )
    # The web console's address, https://HOST:PORT ([console] in coordinator.toml); "" when off.
    console: str = ""


def is_initialised(state_dir: Path) -> bool:
    return (state_dir / ADMIN_TOKEN).exists() or db_path(state_dir).exists()


def _check_empty(state_dir: Path) -> None:
    if is_initialised(state_dir):
        raise StateDirError(
            f"{state_dir} already holds a coordinator (admin.token or coordinator.db exists). "
            "Use it with `tuneplane-coordinator serve`, or pick an empty directory."
        )
    if state_dir.exists() and not state_dir.is_dir():
        raise StateDirError(f"{state_dir} exists and is not a directory. Pick another path.")


def _lay_out(state_dir: Path, extra_sans: Iterable[str], url: PostgresUrl | None) -> None:
    """Create the directory, the dev CA, the server certificate and the default config (with
    ``[store] url`` when the stores live in PostgreSQL)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    create_dev_ca(state_dir, default_sans(extra_sans))
    os.close(os.open(state_dir / SERVE_LOCK, os.O_WRONLY | os.O_CREAT, 0o600))
    config = state_dir / CONFIG_NAME
    if not config.exists():
        text = DEFAULT_CONFIG + (store_table(url) if url is not None else "")
        secret = url is not None and url.has_password
        write_atomic(config, text.encode("utf-8"), 0o600 if secret else 0o644)


async def initialise(
    state_dir: Path, extra_sans: Iterable[str] = (), url: PostgresUrl | None = None
) -> None:
    """Create a new coordinator state directory (an absolute path), its stores in the SQLite
    files there or, with ``url``, in that PostgreSQL database.

    Raises :class:`StateDirError` if one exists there already, or the database already holds a
    coordinator's store; a database that cannot be reached is a
    :class:`~tuneplane.coordinator.store.core.StoreError`. Either way nothing is written here. Runs
    before any concurrency exists, so the file work is done in line.
    """
    _check_empty(state_dir)
    token = new_credential(USER_PREFIX)
    if url is not None:
        # The database first: a refusal there leaves no directory half made.
        store = await Store.open(url)
    else:
        _lay_out(state_dir, extra_sans, None)
        store = await Store.open(db_path(state_dir))
    try:
        if url is not None:
            if await users(store):
                raise StateDirError(
                    f"the PostgreSQL database {url} already holds a coordinator's store (it has "
                    "users). Point `init --store` at an empty database, or use the coordinator "
                    "that owns it."
                )
            _lay_out(state_dir, extra_sans, url)
        await store.bootstrap(hash_credential(token), now_ms())
    finally:
        await store.close()
    # The token file is written last: its presence is what marks the directory initialised.
    write_atomic(state_dir / ADMIN_TOKEN, (token + "\n").encode("utf-8"), 0o600)


def read_admin_token(state_dir: Path) -> str:
    path = state_dir / ADMIN_TOKEN
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise StateDirError(
            f"{path} does not exist. Run `tuneplane-coordinator init --state-dir {state_dir}`."
        ) from None


def require_initialised(state_dir: Path, url: PostgresUrl | None = None) -> None:
    """The state directory was initialised (for SQLite stores, ``url`` None: with its store)."""
    store_missing = url is None and not db_path(state_dir).exists()
    if not (state_dir / ADMIN_TOKEN).exists() or store_missing:
        raise StateDirError(
            f"{state_dir} is not an initialised coordinator state directory. "
            f"Run `tuneplane-coordinator init --state-dir {state_dir}` first."
        )


def coordinator_where(state_dir: Path, url: PostgresUrl | None) -> Where:
    """Where the coordinator store lives: ``coordinator.db`` here, or the database ``url``."""
    return store_where(state_dir, url, DB_NAME)


def publish(state_dir: Path, endpoints: Endpoints) -> None:
    """Write ``endpoints.json`` and ``tp-context.json`` atomically. ``tp-context.json`` keeps
    ``coordinator`` (this coordinator's API address, for older ``tp``) beside
    ``api_addresses`` (this one first, then the others sharing the store)."""
    state_dir = state_dir.absolute()
    write_atomic(
        state_dir / ENDPOINTS,
        (json.dumps(attrs.asdict(endpoints), indent=2, sort_keys=True) + "\n").encode("utf-8"),
    )
    context = {
        # "coordinator": the one address an older tp reads; "api_addresses": the whole list.
        "coordinator": endpoints.api,
        "api_addresses": [
            endpoints.api,
            *(a for a in endpoints.api_addresses if a != endpoints.api),
        ],
        "ca": str(TlsPaths.under(state_dir).ca_cert),
        "token_file": str(state_dir / ADMIN_TOKEN),
    }
    write_atomic(
        state_dir / TP_CONTEXT,
        (json.dumps(context, indent=2, sort_keys=True) + "\n").encode("utf-8"),
    )


def withdraw(state_dir: Path, pid: int) -> None:
    """Remove ``endpoints.json`` on a clean stop, if it is still this process's."""
    path = state_dir / ENDPOINTS
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pid") == pid:
            path.unlink()
            fsync_dir(state_dir)
    except (FileNotFoundError, ValueError):
        return
