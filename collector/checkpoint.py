"""The tailer's checkpoint: one small JSON file, replaced atomically.

Rules:
- Written as tmp file, fsync, rename over the old one, fsync of the directory: a crash leaves
  either the old or the new checkpoint, never a torn one.
- It holds only *committed* positions (what a consumer made durable) plus the stream table, so
  a restart re-reads at most what was not yet durable and the dedup keys come out the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FORMAT = "tuneplane.collector.checkpoint/1"


class CheckpointError(ValueError):
    """The checkpoint file cannot be used; the message says which file and what to do."""


def save_checkpoint(path: Path, body: dict[str, Any]) -> None:
    """Replace ``path`` with ``body`` atomically and durably."""
    text = json.dumps({"format": FORMAT, **body}, sort_keys=True, separators=(",", ":"))
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The saved body, or None when no checkpoint exists yet."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is not valid JSON ({exc}); it was not written by this collector "
            "or the disk damaged it. Move it aside to re-read the telemetry from the start "
            "(points are deduplicated downstream)"
        ) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise CheckpointError(
            f"checkpoint {path} has format {found!r}, expected {FORMAT!r}. Move it aside to "
            "re-read the telemetry from the start"
        )
    body.pop("format")
    return body
