"""Which names a server certificate covers, as a TLS client decides it: one rule for the
addresses serve advertises and for ``control-address``. Pure: a parsed certificate in.
"""

from __future__ import annotations

import ipaddress

from cryptography import x509


def _normal(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def certificate_names(cert: x509.Certificate) -> list[str]:
    """The DNS names (lower case) and IP addresses (as text) ``cert``'s subjectAltName lists."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    names = [n.lower().rstrip(".") for n in san.get_values_for_type(x509.DNSName)]
    return names + [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def covers(cert: x509.Certificate, host: str) -> bool:
    """Whether a client verifying ``cert`` for ``host`` would accept it (subjectAltName only,
    as TLS clients match: an IP address exactly, a name exactly or by a ``*.`` first label).
    The one place that decides it: the advertised addresses and ``control-address`` both ask."""
    wanted = _normal(host)
    for name in certificate_names(cert):
        if name == wanted:
            return True
        if name.startswith("*.") and "." in wanted and wanted.split(".", 1)[1] == name[2:]:
            return True
    return False
