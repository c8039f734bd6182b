"""A coordinator's name among those sharing a store: ``<host>-<8 hex>``, kept in its state dir.

Rules:
- Made at the first ``serve`` of a state directory and kept in ``coordinator-id`` (written
  atomically, 0644): a restart keeps its name, so the roll call shows one row per coordinator,
  not one per start.
- A state directory copied to set up a second coordinator would carry the first one's name:
  the file records the host it was made on, and a name made on another host is replaced by a
  new one (logged), so two machines never answer to one name.
"""

from __future__ import annotations

import logging
import secrets
import socket
from pathlib import Path

from tuneplane.agent.atomic_file import write_atomic

log = logging.getLogger(__name__)

ID_FILE = "coordinator-id"


def _made_here(host: str) -> str:
    return f"{host}-{secrets.token_hex(4)}"


def coordinator_id(state_dir: Path, host: str | None = None) -> str:
    """This state directory's coordinator name, made (or remade for this host) when needed."""
    host = host or socket.gethostname()
    path = state_dir / ID_FILE
    try:
        kept = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        kept = ""
    if kept and kept.rpartition("-")[0] == host:
        return kept
    made = _made_here(host)
    if kept:
        log.warning(
            "coordinator id made on another host; taking a new one old=%s new=%s path=%s",
            kept,
            made,
            path,
        )
    write_atomic(path, (made + "\n").encode(), mode=0o644)
    return made
