"""The outputs listener's identity: its TLS key and self-signed certificate, and the grant key.

Rules:
- Made once, kept in the Node's credentials directory (0700) as two files, each written
  atomically with mode 0600: ``outputs-tls.pem`` (an EC P-256 private key and its self-signed
  certificate, which other Nodes pin by the sha256 of its DER) and ``outputs-grant.key`` (32
  random bytes the coordinator signs fetch grants with, proto/contract/outputs_grant.py).
- Neither is a secret anyone else keeps a copy of: the Node reports the certificate digest and
  the grant key in every Hello, so a new identity takes effect at the next Connect. A file that
  cannot be used (truncated, corrupt, a key that does not match its certificate, an expired
  certificate) or that others could read (mode wider than 0600: the key may have been read) is
  therefore REPLACED with a new one, and each replacement is logged as a warning naming the file
  and why. Grants made for the old key stop being accepted, which only makes a Prepare sent
  before the restart fail and be retried with a fresh grant.
- Blocking file I/O: called once at start, before the Trio run. The key and certificate are
  made and checked with cryptography (agent/outputs_tls.py) in a child forked for it, so the
  agent itself never maps cryptography: about 8 MiB of its resident memory, for its whole life,
  for work done once. The child's answer, or its exception, comes back through a pipe; the
  warnings are logged here, by the agent.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import pickle
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import attrs

from tuneplane.proto.contract.outputs_grant import GRANT_KEY_BYTES

from .atomic_file import write_atomic

log = logging.getLogger(__name__)

TLS_FILE = "outputs-tls.pem"
GRANT_KEY_FILE = "outputs-grant.key"
#: Pinning is by digest, so the lifetime only has to outlast the Node; a renewal is a new digest.
CERT_DAYS = 3650
#: A certificate closer than this to its end is replaced at start.
CERT_MARGIN = datetime.timedelta(days=30)
_MAX_FILE_BYTES = 64 * 1024

_T = TypeVar("_T")
_CHILD = "the process that checks the outputs listener's key and certificate"


class IdentityUnusable(ValueError):
    """One identity file cannot be used, or the child that checks it gave no answer; ``str()``
    says which and why (a ValueError, so the agent stops with that sentence)."""


@attrs.frozen
class OutputsIdentity:
    """What the listener serves with and what Hello reports."""

    tls_path: Path
    cert_sha256: str
    grant_key: bytes = attrs.field(repr=False)
    # Sentences for each file made anew at this load (empty when both were reused).
    replaced: tuple[str, ...] = ()


def read_private(path: Path) -> bytes:
    """The bytes of a 0600 regular file at ``path`` (a link is not followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IdentityUnusable(f"{path} is not a regular file")
        if info.st_mode & 0o077:
            raise IdentityUnusable(
                f"{path} has mode {stat.S_IMODE(info.st_mode):04o}, so others could have read it"
            )
        if info.st_uid != os.geteuid():
            raise IdentityUnusable(f"{path} belongs to uid {info.st_uid}, not to the agent")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise IdentityUnusable(f"{path} is larger than {_MAX_FILE_BYTES} bytes")
    return data


def _load_grant_key(path: Path) -> bytes:
    data = read_private(path)
    if len(data) != GRANT_KEY_BYTES:
        raise IdentityUnusable(f"{path} holds {len(data)} bytes, not {GRANT_KEY_BYTES}")
    return data


def load_or_create(
    credentials_dir: Path, node_id: str, now: datetime.datetime | None = None
) -> OutputsIdentity:
    """The listener's identity from ``credentials_dir``, each missing or unusable file made
    anew (atomically, 0600) and every replacement logged as a warning."""
    when = now or datetime.datetime.now(datetime.UTC)
    credentials_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    replaced: list[str] = []
    key_path = credentials_dir / GRANT_KEY_FILE
    try:
        grant_key = _load_grant_key(key_path)
    except (OSError, IdentityUnusable) as exc:
        grant_key = secrets.token_bytes(GRANT_KEY_BYTES)
        write_atomic(key_path, grant_key, 0o600)
        replaced.append(_replacement(key_path, exc))
    tls_path = credentials_dir / TLS_FILE
    digest, why = _in_child(functools.partial(_tls_digest, tls_path, node_id, when))
    if why is not None:
        replaced.append(_replacement(tls_path, why))
    return OutputsIdentity(tls_path, digest, grant_key, tuple(replaced))


def _tls_digest(
    tls_path: Path, node_id: str, now: datetime.datetime
) -> tuple[str, Exception | None]:
    from . import outputs_tls  # imported by the forked child only (see the module's rules)

    return outputs_tls.tls_digest(tls_path, node_id, now)


def _in_child(work: Callable[[], _T]) -> _T:
    """``work()`` run in a forked child: its result, or the exception it raised, pickled back
    through a pipe. The child ends with ``os._exit`` and so runs no handler of the agent's."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its result is what the tests check
        try:
            os.close(read_fd)
            try:
                outcome: tuple[bool, object] = (True, work())
            except BaseException as exc:
                outcome = (False, exc)
            try:
                answer = pickle.dumps(outcome)
            except Exception as exc:
                answer = pickle.dumps((False, IdentityUnusable(f"{_CHILD} failed: {exc!r}")))
            with os.fdopen(write_fd, "wb") as out:
                out.write(answer)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as got:
        data = got.read()
    _, status = os.waitpid(pid, 0)
    try:
        ok, value = pickle.loads(data)
    except (pickle.UnpicklingError, EOFError, ValueError):
        raise IdentityUnusable(
            f"{_CHILD} ended (wait status {status}) without a whole answer"
        ) from None
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _replacement(path: Path, exc: BaseException) -> str:
    """The sentence for a file made anew, logged: a warning unless there was none before."""
    if isinstance(exc, FileNotFoundError):
        sentence = f"{path} was made (there was none)."
        log.info("outputs identity written file=%s reason=%s", path, sentence)
        return sentence
    why = f"{path}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
    sentence = f"{path} was replaced with a new one because it could not be used: {why}."
    log.warning("outputs identity replaced file=%s reason=%s", path, sentence)
    return sentence
