"""Where the daemons' logs go: journald with structured fields under systemd, else stderr.

Rules:
- One call, :func:`configure`, sets up logging for ``tuneplane-node run``,
  ``tuneplane-coordinator`` and ``tuneplane-collector``.
- journald is used when ``$JOURNAL_STREAM`` names the stream our stderr is (systemd's own test
  for "stderr goes to the journal"): then each record is one datagram in journald's native
  protocol with MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, LOGGER, CODE_FILE/LINE/FUNC, and every
  ``key=value`` of our log lines as ``TUNEPLANE_KEY=value`` (``journalctl -o verbose`` shows
  them; ``journalctl TUNEPLANE_MEMBER=…`` filters on them). A unit that sends stderr elsewhere
  (``StandardError=file:…``) gets the plain stderr format there, as it asked.
- A process that works for one thing names it on every entry: ``configure(fields=…)`` adds
  those ``TUNEPLANE_KEY`` fields to each (the collector: its member's run, attempt and index,
  and ``TUNEPLANE_MEMBER`` as the agent writes it, so one filter shows both daemons' lines).
- A child that logs for the daemon (the agent's collectors) is handed the daemon's own stderr
  when :func:`journald_in_use`, so the same rule sends its entries to journald too.
- A record journald refuses (its socket gone, say) is written to stderr instead, never lost
  silently and never raised into the daemon.
- ``TUNEPLANE_TEST_JOURNAL_SOCKET`` replaces journald's socket path, for tests only.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from logging_journald import JournaldTransport

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
#: Tests point the journal handler at a socket of their own with this; nothing else sets it.
TEST_SOCKET_VARIABLE = "TUNEPLANE_TEST_JOURNAL_SOCKET"
FIELD_PREFIX = "TUNEPLANE_"

# syslog priorities (journald's PRIORITY field) for Python's levels.
_PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
# A key of our log lines: a lower-case word right after a space (or at the start), then "=".
_KEY = re.compile(r"(?:^|(?<=\s))([a-z][a-z0-9_]*)=")
# journald accepts field names of upper-case letters, digits and "_", at most 64 long.
_FIELD_NAME_MAX = 64


def priority(levelno: int) -> int:
    """The syslog priority journald stores for a Python log level."""
    for level, value in _PRIORITY:
        if levelno >= level:
            return value
    return 7


def field_name(key: str) -> str:
    """The journal field a ``key=value`` key becomes: ``member`` is ``TUNEPLANE_MEMBER``."""
    return (FIELD_PREFIX + key.upper())[:_FIELD_NAME_MAX]


def fields_of(message: str) -> dict[str, str]:
    """The ``key=value`` pairs of one log line (pure): each value runs to the next key, so
    ``reason=the journal was closed cleanly`` keeps its spaces. Keys become journal field names
    ``TUNEPLANE_KEY``; a key seen twice keeps its first value."""
    found: dict[str, str] = {}
    matches = list(_KEY.finditer(message))
    for i, here in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(message)
        found.setdefault(field_name(here.group(1)), message[here.end() : end].strip())
    return found


def journal_stream_is_stderr(env: Mapping[str, str], stderr_fd: int) -> bool:
    """True when ``$JOURNAL_STREAM`` (``DEVICE:INODE``) is the file ``stderr_fd`` is."""
    device, _, inode = env.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        st = os.fstat(stderr_fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


class _JournalHandler(logging.Handler):
    """One datagram per record to journald; stderr when journald cannot take it."""

    def __init__(
        self,
        identifier: str,
        socket_path: Path,
        fallback: logging.Handler,
        fields: Mapping[str, str],
    ) -> None:
        super().__init__()
        self.identifier = identifier
        self.socket_path = socket_path
        self.fallback = fallback
        # The process's own fields, named once; a line's key=value of the same name yields to
        # them, so a filter on them finds every line.
        self.fields = {field_name(key): value for key, value in fields.items()}
        self._transport: Any = None

    def record_fields(self, record: logging.LogRecord) -> list[tuple[str, Any]]:
        message = record.getMessage()
        text = message
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        pairs: list[tuple[str, Any]] = [
            ("MESSAGE", text),
            ("PRIORITY", priority(record.levelno)),
            ("SYSLOG_IDENTIFIER", self.identifier),
            ("LOGGER", record.name),
            ("CODE_FILE", record.pathname),
            ("CODE_LINE", record.lineno),
            ("CODE_FUNC", record.funcName),
        ]
        pairs += ({**fields_of(message), **self.fields}).items()
        return pairs

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._transport is None:
                self._transport = JournaldTransport(socket_path=self.socket_path, connected=False)
            self._transport.send(self.record_fields(record))
        except Exception:
            self.fallback.handle(record)


def configure(
    level: int,
    identifier: str,
    stderr_format: str,
    fields: Mapping[str, str] | None = None,
) -> None:
    """Send this process's logs to journald (under systemd, see the module rules) or to stderr
    in ``stderr_format``; ``identifier`` is the SYSLOG_IDENTIFIER journald files them under;
    every journal entry also carries ``fields`` (``{"run_id": …}``: ``TUNEPLANE_RUN_ID=…``)."""
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter(stderr_format))
    handler: logging.Handler = stderr
    try:
        stderr_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        stderr_fd = -1  # stderr replaced by an object without a file: never the journal
    if journal_stream_is_stderr(os.environ, stderr_fd):
        socket_path = Path(os.environ.get(TEST_SOCKET_VARIABLE) or JOURNAL_SOCKET)
        handler = _JournalHandler(identifier, socket_path, stderr, fields or {})
    logging.basicConfig(level=level, handlers=[handler], force=True)


def journald_in_use() -> bool:
    """True when :func:`configure` sent this process's logs to journald."""
    return any(isinstance(h, _JournalHandler) for h in logging.getLogger().handlers)


__all__ = [
    "FIELD_PREFIX",
    "JOURNAL_SOCKET",
    "TEST_SOCKET_VARIABLE",
    "configure",
    "field_name",
    "fields_of",
    "journal_stream_is_stderr",
    "journald_in_use",
    "priority",
]
