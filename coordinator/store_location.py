"""Where a store lives: a SQLite file in the state directory, or a PostgreSQL database by URL.

Pure, and beside the decision modules rather than in ``store/``: coordinator.toml's reader
(:mod:`~tuneplane.coordinator.config`) names a store with it, and the pure tier imports nothing
of the store.

Rules:
- The default is SQLite, one file per store in the state directory, with nothing to configure.
  A PostgreSQL store is named by a ``postgresql://`` URL (``[store] url`` in coordinator.toml,
  or ``serve --store``); :func:`parse_store_url` refuses anything else with a sentence that
  names where the URL came from.
- A password never leaves :class:`PostgresUrl` except towards the driver: ``str()`` and
  ``repr()`` show the URL without it (a ``password`` query parameter is dropped too), so a
  message or a log line built from one cannot leak it. Better still, keep it out of the URL:
  the driver reads ``PGPASSWORD`` and ``~/.pgpass`` as libpq does.
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

import attrs

SCHEMES = ("postgresql", "postgres")
_SAFE = re.compile(r"^[\x21-\x7e]+$")


class StoreUrlError(ValueError):
    """A store URL is not one this coordinator can use; ``str()`` names where it came from."""


@attrs.frozen(repr=False)
class PostgresUrl:
    """A checked ``postgresql://`` URL. ``str()`` is safe to show; :meth:`dsn` is not."""

    _raw: str = attrs.field(alias="raw")
    shown: str
    has_password: bool

    def dsn(self) -> str:
        """The URL as given, password and all: for the driver only."""
        return self._raw

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"PostgresUrl({self.shown!r})"


#: Where one store lives: its SQLite file, or the PostgreSQL database (each store class keeps
#: its tables in a schema of its own there).
Where = Path | PostgresUrl


def parse_store_url(text: str, source: str) -> PostgresUrl:
    """``text`` checked as a PostgreSQL URL; ``source`` names where it came from in the refusal
    (``[store] url in /etc/.../coordinator.toml``, ``--store``)."""
    fix = (
        "Write postgresql://USER@HOST:PORT/DATABASE (a password belongs in PGPASSWORD or "
        "~/.pgpass, not in the URL)."
    )
    if not isinstance(text, str) or not text:
        raise StoreUrlError(f"{source} is empty. {fix}")
    if not _SAFE.match(text):
        raise StoreUrlError(
            f"{source} holds spaces or control characters. {fix} Percent-encode what the URL "
            "needs (%20 for a space)."
        )
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        raise StoreUrlError(
            f"{source} is not a URL this coordinator can read (its host or port is malformed). "
            f"{fix}"
        ) from None
    shown = _shown(parts)
    if parts.scheme not in SCHEMES:
        scheme = parts.scheme or "(none)"
        raise StoreUrlError(
            f"{source} has the scheme {scheme!r}; only a PostgreSQL database can be named "
            f"there (the SQLite store needs no URL: leave it out). {fix}"
        )
    database = urllib.parse.unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise StoreUrlError(f"{source} ({shown}) names no database after the host. {fix}")
    if parts.fragment:
        raise StoreUrlError(
            f"{source} ({shown}) ends in a #fragment, which means nothing here. {fix}"
        )
    if port == 0:
        raise StoreUrlError(f"{source} ({shown}) has port 0. {fix}")
    query = urllib.parse.parse_qs(parts.query)
    has_password = bool(parts.password) or "password" in query
    return PostgresUrl(raw=text, shown=shown, has_password=has_password)


def _shown(parts: urllib.parse.SplitResult) -> str:
    """The URL without its password (in the netloc or as a ``password`` query parameter)."""
    host = parts.hostname or ""
    if host and ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host + (f":{port}" if port else "")
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    query = "&".join(
        p for p in parts.query.split("&") if urllib.parse.unquote(p.split("=", 1)[0]) != "password"
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def store_where(state_dir: Path, url: PostgresUrl | None, file_name: str) -> Where:
    """Where the store kept in ``file_name`` under SQLite lives: that file in ``state_dir``, or
    the PostgreSQL database ``url`` names when there is one."""
    return url if url is not None else state_dir / file_name
