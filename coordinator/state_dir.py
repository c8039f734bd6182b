"""The coordinator's state directory: what ``init`` creates and what ``serve`` publishes.

Rules:
- ``init`` refuses a directory that already holds a coordinator; it never overwrites keys, the
  store or the admin token. Secrets are 0600, the directory 0700.
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
from tuneplane.coordinator.auth import USER_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.config import CONFIG_NAME, DEFAULT_CONFIG
from tuneplane.coordinator.store import Store, db_path
from tuneplane.coordinator.tls import TlsPaths, create_dev_ca, default_sans

ADMIN_TOKEN = "admin.token"
ENDPOINTS = "endpoints.json"
TP_CONTEXT = "tp-context.json"


class StateDirError(RuntimeError):
    """The state directory cannot be used as asked; ``str()`` says why and what to do."""


@attrs.frozen
class Endpoints:
    api: str
    control: str
    telemetry: str
    ca: str
    pid: int
    # The Prometheus listener's address ([metrics] in coordinator.toml); "" when it is off.
    metrics: str = ""


def is_initialised(state_dir: Path) -> bool:
    return (state_dir / ADMIN_TOKEN).exists() or db_path(state_dir).exists()


def _lay_out(state_dir: Path, extra_sans: Iterable[str]) -> None:
    """Create the directory, the dev CA, the server certificate and the default config."""
    if is_initialised(state_dir):
        raise StateDirError(
            f"{state_dir} already holds a coordinator (admin.token or coordinator.db exists). "
            "Use it with `tuneplane-coordinator serve`, or pick an empty directory."
        )
    if state_dir.exists() and not state_dir.is_dir():
        raise StateDirError(f"{state_dir} exists and is not a directory. Pick another path.")
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    create_dev_ca(state_dir, default_sans(extra_sans))
    config = state_dir / CONFIG_NAME
    if not config.exists():
        write_atomic(config, DEFAULT_CONFIG.encode("utf-8"), 0o644)


async def initialise(state_dir: Path, extra_sans: Iterable[str] = ()) -> None:
    """Create a new coordinator state directory (an absolute path).

    Raises :class:`StateDirError` if one exists there already. Runs before any concurrency
    exists, so the file work is done in line.
    """
    _lay_out(state_dir, extra_sans)
    token = new_credential(USER_PREFIX)
    store = await Store.open(db_path(state_dir))
    try:
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


def require_initialised(state_dir: Path) -> None:
    if not (state_dir / ADMIN_TOKEN).exists() or not db_path(state_dir).exists():
        raise StateDirError(
            f"{state_dir} is not an initialised coordinator state directory. "
            f"Run `tuneplane-coordinator init --state-dir {state_dir}` first."
        )


def publish(state_dir: Path, endpoints: Endpoints) -> None:
    """Write ``endpoints.json`` and ``tp-context.json`` atomically."""
    state_dir = state_dir.absolute()
    write_atomic(
        state_dir / ENDPOINTS,
        (json.dumps(attrs.asdict(endpoints), indent=2, sort_keys=True) + "\n").encode("utf-8"),
    )
    context = {
        "coordinator": endpoints.api,
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
