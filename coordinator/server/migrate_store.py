"""``tuneplane-coordinator migrate-store``: an installation's SQLite stores, copied into a
PostgreSQL database, checked, and named in coordinator.toml.

Rules:
- Every refusal is a :class:`~tuneplane.coordinator.store.migrate.MigrateError` (or the state
  directory's, config's or store's own error) with a sentence naming what and how to fix it,
  raised before anything is written: a state directory already on PostgreSQL, a ``serve``
  running on it (the serve lock, :mod:`~tuneplane.coordinator.server.serve_lock`, held
  exclusively from the first check to the last write, so none can start meanwhile), a
  coordinator.toml that cannot take a ``[store]`` table, then what the copy itself refuses
  (:func:`~tuneplane.coordinator.store.migrate.copy_and_check`).
- Only after the copy is checked is ``[store] url`` appended to coordinator.toml, atomically,
  by the code ``init --store`` uses (``store_table``); after a mismatch coordinator.toml is left
  as it was. The SQLite files stay where they are, a frozen copy nothing writes any more.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from pathlib import Path

from tuneplane.agent.atomic_file import write_atomic

from ..config import (
    CONFIG_NAME,
    ConfigError,
    parse_config,
    store_setting,
    store_table,
)
from ..store.migrate import COMMAND, MigrateError, Migration, copy_and_check
from ..store_location import PostgresUrl
from .serve_lock import alone
from .state_dir import require_initialised

log = logging.getLogger(__name__)


async def migrate(
    state_dir: Path, url: PostgresUrl, say: Callable[[str], None] = lambda _: None
) -> Migration:
    """Copy the SQLite stores of ``state_dir`` into the database ``url``, check the copy and
    record ``url`` as ``[store] url``; ``say`` gets a sentence as each step ends."""
    config_text = _check_source(state_dir)
    with alone(state_dir, COMMAND):
        done = await copy_and_check(state_dir, url, say)
        _record_url(state_dir, config_text, url)
        log.info("stores migrated where=%s tables=%d", url, len(done.digests))
        return done


def _check_source(state_dir: Path) -> str:
    """The state directory's coordinator.toml text, once it is known that the stores are SQLite
    files here and that the file can take a ``[store]`` table."""
    path = state_dir / CONFIG_NAME
    already = store_setting(state_dir)
    if already is not None:
        raise MigrateError(
            f"The stores of {state_dir} are already in PostgreSQL ({already}, [store] url in "
            f"{path}); {COMMAND} copies SQLite stores only, so there is nothing to move."
        )
    require_initialised(state_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MigrateError(
            f"{path} does not exist, so there is nowhere to record the new store. Restore it "
            "(or copy a fresh one from `tuneplane-coordinator init` into place), then run "
            f"{COMMAND} again."
        ) from None
    parse_config(text, path)
    if "store" in tomllib.loads(text):
        raise MigrateError(
            f"{path} already has a [store] table (with no url), and {COMMAND} appends one. "
            f"Remove that table, then run {COMMAND} again."
        )
    return text


def _record_url(state_dir: Path, text: str, url: PostgresUrl) -> None:
    """Append ``[store] url`` to coordinator.toml, atomically, keeping its mode (0600 when the
    URL carries a password)."""
    path = state_dir / CONFIG_NAME
    updated = text + ("" if text.endswith("\n") else "\n") + store_table(url)
    try:
        recorded = parse_config(updated, path).store_url
    except ConfigError as exc:
        raise MigrateError(
            f"The copy is complete and checked, but {path} would not read back with [store] url "
            f'added ({exc}); it was not changed. Add [store] url = "..." yourself (see '
            'docs/operator.md, "PostgreSQL store").'
        ) from None
    assert recorded is not None and recorded.dsn() == url.dsn()
    mode = 0o600 if url.has_password else path.stat().st_mode & 0o777
    write_atomic(path, updated.encode("utf-8"), mode)
