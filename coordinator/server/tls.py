"""The dev CA, the server certificate and the TLS contexts of the three listeners.

Rules:
- Server verification is always on: clients verify the server against ``tls/ca.pem``; there is no
  switch that turns it off. ALPN offers only ``h2`` (gRPC is HTTP/2); the console's listener,
  on the same certificate, only ``http/1.1``.
- Private keys are written 0600 in a 0700 directory, atomically.
- The server certificate covers every name serve advertises (``cover_names``): one issued by
  this state directory's dev CA is reissued with the missing names, over the same key; any other
  is never touched, and a missing name stops serve with a sentence.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tuneplane.agent.atomic_file import write_atomic

from ..certificate_names import covers

TLS_DIR = "tls"


@attrs.frozen
class TlsPaths:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def under(cls, state_dir: Path) -> TlsPaths:
        tls = state_dir / TLS_DIR
        return cls(tls / "ca.pem", tls / "ca.key", tls / "server.pem", tls / "server.key")


class TlsError(RuntimeError):
    """A certificate or key file is missing or unreadable."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san_entries(names: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    seen: set[str] = set()
    for name in names:
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def default_sans(extra: Iterable[str] = ()) -> list[str]:
    """localhost, the loopback addresses, this host's name and whatever the operator adds."""
    return ["localhost", "127.0.0.1", "::1", socket.gethostname(), *extra]


def _server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    server_key: ec.EllipticCurvePrivateKey,
    sans: Iterable[str],
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> x509.Certificate:
    """A server certificate for ``sans`` over ``server_key``, signed by the dev CA."""
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tuneplane-coordinator")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(_san_entries(sans)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def create_dev_ca(state_dir: Path, sans: Iterable[str], valid_days: int = 825) -> TlsPaths:
    """Generate a dev CA and a server certificate signed by it under ``<state_dir>/tls``."""
    paths = TlsPaths.under(state_dir)
    paths.ca_cert.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - datetime.timedelta(minutes=5)
    not_after = now + datetime.timedelta(days=valid_days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "TunePlane dev CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _server_cert(ca_key, ca_name, server_key, sans, not_before, not_after)

    write_atomic(paths.ca_key, _key_pem(ca_key), 0o600)
    write_atomic(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    write_atomic(paths.server_key, _key_pem(server_key), 0o600)
    write_atomic(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return paths


def cover_names(paths: TlsPaths, hosts: Iterable[str]) -> list[str]:
    """Make the server certificate cover every one of ``hosts``; returns the names it added.

    A certificate issued by this state directory's dev CA (``tls/ca.key`` present and the
    issuer) is reissued with the missing names added, over the same key, to the same expiry,
    written atomically (one file changes: a crash leaves the old or the new certificate). Any
    other certificate is left alone and a missing name raises :class:`TlsError`.
    """
    try:
        cert = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    except (OSError, ValueError) as exc:
        raise TlsError(
            f"cannot read the server certificate {paths.server_cert} ({exc}). Run "
            "`tuneplane-coordinator init` or put a certificate and key there."
        ) from None
    missing = [h for h in dict.fromkeys(hosts) if not covers(cert, h)]
    if not missing:
        return []
    ca_key = _dev_ca_key(paths, cert)
    if ca_key is None:
        raise TlsError(
            f"the server certificate {paths.server_cert} does not cover "
            f"{', '.join(missing)}, which serve advertises, so every Node and collector would "
            "refuse it. Issue a certificate whose subjectAltName names it, or advertise a "
            "name the certificate covers."
        )
    server_key = serialization.load_pem_private_key(paths.server_key.read_bytes(), None)
    if not isinstance(server_key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"{paths.server_key} is not the EC key the dev CA issued with.")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = [*san.get_values_for_type(x509.DNSName)]
    names += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    now = datetime.datetime.now(datetime.UTC)
    fresh = _server_cert(
        ca_key,
        cert.issuer,
        server_key,
        [*names, *missing],
        now - datetime.timedelta(minutes=5),
        cert.not_valid_after_utc,
    )
    write_atomic(paths.server_cert, fresh.public_bytes(serialization.Encoding.PEM), 0o644)
    return missing


def _dev_ca_key(paths: TlsPaths, cert: x509.Certificate) -> ec.EllipticCurvePrivateKey | None:
    """The dev CA's key when it exists here and issued ``cert``; None otherwise."""
    try:
        ca_cert = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), None)
    except (OSError, ValueError):
        return None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or cert.issuer != ca_cert.subject:
        return None
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return None
    return ca_key


def server_context(paths: TlsPaths, alpn: tuple[str, ...] = ("h2",)) -> ssl.SSLContext:
    """The TLS context every listener serves with: TLS 1.2+, ALPN h2 (gRPC); the console's
    (HTTP/1.1 under uvicorn) offers ``http/1.1`` instead."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(paths.server_cert, paths.server_key)
    except (FileNotFoundError, ssl.SSLError) as exc:
        raise TlsError(
            f"cannot load the server certificate {paths.server_cert} and key {paths.server_key} "
            f"({exc}). Run `tuneplane-coordinator init` or put a certificate and key there."
        ) from None
    ctx.set_alpn_protocols(list(alpn))
    return ctx
