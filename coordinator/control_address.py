"""Which control address Nodes may be told: ``HOST:PORT`` whose host the server certificate
covers. Pure: the certificate is read by the caller's path, nothing is stored or sent.

Rules (docs/operator.md, "Moving the coordinator"):
- The address must be ``HOST:PORT`` and its host must be a name or address the coordinator's
  server certificate covers (:func:`~tuneplane.coordinator.certificate_names.covers`): a Node
  verifies the certificate, so any other address would only strand it. The refusal names the
  certificate and how to add the name.
- Empty means none: Nodes keep dialing what they enrolled with.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509

from tuneplane.agent.host_port import split_host_port
from tuneplane.proto.contract.input_checks import InputRefused

from .certificate_names import certificate_names, covers


class BadAddress(InputRefused):
    """The address is not HOST:PORT, or the server certificate does not cover its host."""


def split(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) -> (host, port), read by
    :func:`tuneplane.agent.host_port.split_host_port`. Raises :class:`BadAddress`."""
    found = split_host_port(address)
    if found is None:
        raise BadAddress(
            f"The control address {address!r}",
            "is not HOST:PORT (for IPv6, [ADDRESS]:PORT)",
            "Give the name or address Nodes will dial and the control port, e.g. "
            "coordinator.example.org:7444.",
        )
    return found


def check(address: str, server_cert: Path) -> str:
    """``address`` when Nodes could use it (empty: clear); else :class:`BadAddress`."""
    if not address:
        return ""
    host, _ = split(address)
    cert = x509.load_pem_x509_certificate(server_cert.read_bytes())
    if not covers(cert, host):
        covered = certificate_names(cert)
        raise BadAddress(
            f"The control address {address!r}",
            f"names {host!r}, which the coordinator's server certificate {server_cert} does not "
            f"cover (it covers {', '.join(sorted(covered)) or 'no names'}), so every Node "
            "dialing it would refuse the coordinator",
            'Issue a certificate that names it (docs/operator.md, "Moving the coordinator") '
            "or give a name it covers.",
        )
    return address
