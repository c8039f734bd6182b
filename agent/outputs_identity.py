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
- Blocking file I/O: called once at start, before the Trio run.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import secrets
import stat
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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


class IdentityUnusable(Exception):
    """One identity file cannot be used; ``str()`` says which and why."""


@attrs.frozen
class OutputsIdentity:
    """What the listener serves with and what Hello reports."""

    tls_path: Path
    cert_sha256: str
    grant_key: bytes = attrs.field(repr=False)
    # Sentences for each file made anew at this load (empty when both were reused).
    replaced: tuple[str, ...] = ()


def _read_private(path: Path) -> bytes:
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
    data = _read_private(path)
    if len(data) != GRANT_KEY_BYTES:
        raise IdentityUnusable(f"{path} holds {len(data)} bytes, not {GRANT_KEY_BYTES}")
    return data


def _load_tls(path: Path, now: datetime.datetime) -> str:
    """The certificate digest of a usable key-and-certificate file."""
    data = _read_private(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise IdentityUnusable(f"{path} does not hold a PEM key and certificate ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityUnusable(f"{path} holds a {type(key).__name__}, not an EC P-256 key")
    mine = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    theirs = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if mine != theirs:
        raise IdentityUnusable(f"{path} holds a certificate that is not its key's")
    if cert.not_valid_after_utc - CERT_MARGIN < now:
        raise IdentityUnusable(
            f"{path} holds a certificate that ends {cert.not_valid_after_utc:%Y-%m-%d}"
        )
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def make_tls_pem(node_id: str, now: datetime.datetime) -> bytes:
    """A new EC P-256 key and a self-signed certificate for it, PEM, key first."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tuneplane-outputs {node_id}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ) + cert.public_bytes(serialization.Encoding.PEM)


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
    try:
        digest = _load_tls(tls_path, when)
    except (OSError, IdentityUnusable) as exc:
        write_atomic(tls_path, make_tls_pem(node_id, when), 0o600)
        digest = _load_tls(tls_path, when)
        replaced.append(_replacement(tls_path, exc))
    return OutputsIdentity(tls_path, digest, grant_key, tuple(replaced))


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
