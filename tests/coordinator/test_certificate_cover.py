"""One rule decides whether the coordinator's certificate covers a name: ``covers``, as TLS
clients match (an IP address exactly, a DNS name exactly or by a ``*.`` first label). The
advertised addresses (``cover_names``) and ``tuneplane-coordinator control-address`` both use it,
so a site with a wildcard certificate can move its coordinator to any name the wildcard covers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from tuneplane.coordinator import control_address
from tuneplane.coordinator.certificate_names import covers
from tuneplane.coordinator.control_address import BadAddress
from tuneplane.coordinator.server import tls

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def cert_path(tmp_path: Path) -> Path:
    paths = tls.create_dev_ca(tmp_path, ["*.gpu.example.org", "10.0.0.7", "Coord.Example.org"])
    return paths.server_cert


@pytest.mark.parametrize(
    ("host", "covered"),
    [
        ("node1.gpu.example.org", True),
        ("NODE1.gpu.example.org.", True),
        ("gpu.example.org", False),  # a wildcard covers one label, never the bare domain
        ("a.b.gpu.example.org", False),  # nor two labels
        ("coord.example.org", True),
        ("10.0.0.7", True),
        ("10.0.0.8", False),
        ("example.org", False),
    ],
)
def test_control_address_and_advertised_names_agree(
    cert_path: Path, host: str, covered: bool
) -> None:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert covers(cert, host) is covered
    address = f"{host}:7444"
    if covered:
        assert control_address.check(address, cert_path) == address
    else:
        with pytest.raises(BadAddress) as refused:
            control_address.check(address, cert_path)
        assert "*.gpu.example.org" in str(refused.value)
