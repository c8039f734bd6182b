"""The outputs listener's key and self-signed certificate: made and checked with cryptography.

Rules:
- Only the child that ``outputs_identity.load_or_create`` forks imports this module, so the
  agent itself never maps cryptography (about 8 MiB of its resident memory for its whole life,
  for work done once at start).
"""

from __future__ import annotations

import datetime
import hashlib
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .atomic_file import write_atomic
from .outputs_identity import CERT_DAYS, CERT_MARGIN, IdentityUnusable, read_private


def load_tls(path: Path, now: datetime.datetime) -> str:
    """The certificate digest of a usable key-and-certificate file."""
    data = read_private(path)
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


def tls_digest(
    tls_path: Path, node_id: str, now: datetime.datetime
) -> tuple[str, Exception | None]:
    """The certificate digest of ``tls_path``, made anew (atomically, 0600) when the file is
    missing or unusable; beside it, why it was made (None when it was reused)."""
    try:
        return load_tls(tls_path, now), None
    except (OSError, IdentityUnusable) as exc:
        write_atomic(tls_path, make_tls_pem(node_id, now), 0o600)
        return load_tls(tls_path, now), exc
