"""The one client TLS (agent/client_tls.py), against a real server context over loopback: the
coordinator's CA and name verified, TLS 1.2+, h2; a CA file it cannot load is a sentence."""

from __future__ import annotations

import re
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuneplane.agent.client_tls import CaFileError, grpc_client_context
from tuneplane.coordinator.server.tls import TlsPaths, create_dev_ca, server_context

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def dev_ca(tmp_path_factory: pytest.TempPathFactory) -> TlsPaths:
    return create_dev_ca(tmp_path_factory.mktemp("ca"), ["localhost", "127.0.0.1"])


@pytest.fixture
def server(dev_ca: TlsPaths) -> Iterator[int]:
    """A TLS listener on loopback with the dev CA's server certificate, for one handshake."""
    ctx = server_context(dev_ca)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        try:
            raw, _ = listener.accept()
        except OSError:
            return
        with raw:
            try:
                with ctx.wrap_socket(raw, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (OSError, ssl.SSLError):
                return  # the client refused the certificate: nothing more to serve

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()
        thread.join(timeout=10)


def handshake(ctx: ssl.SSLContext, port: int, name: str) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        return ctx.wrap_socket(raw, server_hostname=name)
    except BaseException:
        raw.close()
        raise


def test_the_context_verifies_the_ca_and_the_name_and_asks_for_tls_1_2(dev_ca: TlsPaths) -> None:
    ctx = grpc_client_context(dev_ca.ca_cert)
    assert ctx.verify_mode is ssl.CERT_REQUIRED
    assert ctx.check_hostname is True
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_a_handshake_with_the_coordinators_certificate_speaks_h2(
    dev_ca: TlsPaths, server: int
) -> None:
    with handshake(grpc_client_context(dev_ca.ca_cert), server, "localhost") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        assert tls.recv(2) == b"ok"


def test_a_certificate_from_another_ca_is_refused(
    dev_ca: TlsPaths, server: int, tmp_path: Path
) -> None:
    other = create_dev_ca(tmp_path, ["localhost", "127.0.0.1"])
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(grpc_client_context(other.ca_cert), server, "localhost")


def test_a_name_the_certificate_does_not_cover_is_refused(dev_ca: TlsPaths, server: int) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(grpc_client_context(dev_ca.ca_cert), server, "coordinator.example.org")


def test_a_missing_ca_file_is_a_sentence_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    with pytest.raises(CaFileError) as caught:
        grpc_client_context(missing)
    assert caught.value.path == missing
    text = str(caught.value)
    assert text.startswith(f"The CA file {missing} cannot be loaded (FileNotFoundError")
    assert text.endswith("it must be a PEM certificate such as the coordinator's tls/ca.pem.")


@pytest.mark.parametrize("content", [b"", b"not a certificate\n", b"-----BEGIN CERTIFICATE-----\n"])
def test_a_file_that_is_not_a_certificate_is_a_sentence(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_bytes(content)
    shown = re.escape(f"The CA file {bad} cannot be loaded (SSLError")
    with pytest.raises(CaFileError, match=f"^{shown}"):
        grpc_client_context(bad)
