"""The tailer's checkpoint: one small JSON file, replaced atomically.

Rules:
- Written atomically (:func:`tuneplane.agent.atomic_file.write_atomic`: tmp file, fsync, rename
  over the old one, fsync of the directory): a crash leaves the old or the new checkpoint, never
  a torn one.
- It holds only *committed* positions (what a consumer made durable) plus the stream table, so
  a restart re-reads at most what was not yet durable and the dedup keys come out the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuneplane.agent.atomic_file import write_atomic

FORMAT = "tuneplane.collector.checkpoint/1"


class CheckpointError(ValueError):
    """The checkpoint file cannot be used; the message says which file and what to do."""


def save_checkpoint(path: Path, body: dict[str, Any]) -> None:
    """Replace ``path`` with ``body`` atomically and durably."""
    text = json.dumps({"format": FORMAT, **body}, sort_keys=True, separators=(",", ":"))
    write_atomic(path, text.encode(), 0o600)


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
