"""A real Node's outputs listener tried as an attacker would: forged, expired and misdirected
grants, paths the manifest does not list, a member still running, oversized and malformed
requests, and a client pinning the wrong certificate. Each is refused with an error frame and a
sentence, the connection is closed, nothing is served and nothing on the holder changes.
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent import wait_until
from tests.support.outputs import Holder, Member, RawClient, holder, request_fields, snapshot
from tuneplane.agent import outputs_wire as ow
from tuneplane.agent.host_port import join_host_port, split_host_port
from tuneplane.agent.messages import InitFromFetch
from tuneplane.agent.outputs_fetch import FetchFailed, connect
from tuneplane.agent.outputs_tls import make_tls_pem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Holder]:
    with holder(tmp_path_factory.mktemp("outputs-attack")) as found:
        yield found


def _refused(node: Holder, fields: dict[str, object], said: str) -> None:
    """Send one request; assert the error frame says ``said``, the connection is closed, nothing
    was served, and no file under the output root or the credentials changed."""
    watched = (node.agent.out_root, node.agent.state_dir / "credentials")
    before = snapshot(*watched)
    served = node.log_count("outputs served")
    refusals = node.log_count("outputs refused")
    with RawClient(node.address) as client:
        client.request(**fields)
        response, body = client.response()
        assert not response.ok and body == b""
        assert said in response.error, response.error
        assert response.error.endswith("."), response.error
        assert client.closed()
    wait_for_log(node, "outputs refused", refusals + 1)
    assert node.log_count("outputs served") == served
    assert snapshot(*watched) == before
    token = (node.agent.state_dir / "credentials" / "control.token").read_text().strip()
    assert token not in response.error


def wait_for_log(node: Holder, text: str, count: int) -> None:
    wait_until(f"{count} {text!r} lines in the holder's log",
               lambda: node.log_count(text) >= count, 10)  # fmt: skip


def test_a_good_grant_is_served_the_manifest_and_a_listed_file(node: Holder) -> None:
    """The baseline the refusals below are measured against."""
    grant, expires = node.grant(node.done)
    with RawClient(node.address) as client:
        client.request(**request_fields(node.done, grant, expires))
        response, body = client.response()
        assert response.ok and body == node.done.manifest.read_bytes()
        client.request(**request_fields(node.done, grant, expires, "file", "ckpt/notes.txt"))
        response, body = client.response()
        assert response.ok and body == b"step 7\n"
    wait_for_log(node, f"outputs served run_id={node.done.run_id}", 2)


def test_a_forged_grant_is_refused_before_anything_is_read(node: Holder) -> None:
    _, expires = node.grant(node.done)
    _refused(node, request_fields(node.done, secrets.token_hex(32), expires),
             "The grant is not this Node's for member 0")  # fmt: skip


def test_a_grant_whose_expiry_was_moved_is_refused(node: Holder) -> None:
    grant, expires = node.grant(node.done)
    _refused(node, request_fields(node.done, grant, expires + 3_600_000),
             "The grant is not this Node's")  # fmt: skip


def test_an_expired_grant_is_refused(node: Holder) -> None:
    past = int(time.time() * 1000) - 1000
    grant, _ = node.grant(node.done, expires_at_ms=past)
    _refused(node, request_fields(node.done, grant, past, "file", "ckpt/model.bin"),
             f"expired at {past}")  # fmt: skip


def test_a_grant_for_another_member_is_refused(node: Holder) -> None:
    grant, expires = node.grant(node.other)
    _refused(node, request_fields(node.done, grant, expires), "The grant is not this Node's")
    # The other member's grant with this member's output directory: the journal says no.
    moved = Member(node.other.run_id, node.other.attempt, node.other.member_index,
                   node.done.out_dir)  # fmt: skip
    _refused(node, request_fields(moved, grant, expires),
             f"on this Node is not {node.done.out_dir}")  # fmt: skip
    # The same run and attempt, another member index.
    wrong = Member(node.done.run_id, node.done.attempt, 1, node.done.out_dir)
    grant, expires = node.grant(wrong)
    _refused(node, request_fields(wrong, grant, expires), "is not known here")


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("../../credentials/control.token", "has an empty, '.' or '..' part"),
        ("ckpt/../../../credentials/control.token", "has an empty, '.' or '..' part"),
        ("/etc/passwd", "starts with /"),
        ("secret.txt", "lists no file 'secret.txt'"),
        ("ckpt", "lists no file 'ckpt'"),
    ],
)
def test_a_path_the_manifest_does_not_list_is_refused(node: Holder, path: str, said: str) -> None:
    if path == "/etc/passwd":
        # The control token by absolute path, too.
        grant, expires = node.grant(node.done)
        token = str(node.agent.state_dir / "credentials" / "control.token")
        _refused(node, request_fields(node.done, grant, expires, "file", token), said)
    secret = node.done.out_dir / "secret.txt"
    secret.write_text("written after the manifest")  # not listed: never served
    try:
        grant, expires = node.grant(node.done)
        _refused(node, request_fields(node.done, grant, expires, "file", path), said)
    finally:
        secret.unlink()


def test_a_listed_file_replaced_by_a_link_is_refused(node: Holder) -> None:
    notes = node.done.out_dir / "ckpt" / "notes.txt"
    kept = notes.read_bytes()
    notes.unlink()
    notes.symlink_to(node.agent.state_dir / "credentials" / "control.token")
    try:
        grant, expires = node.grant(node.done)
        _refused(node, request_fields(node.done, grant, expires, "file", "ckpt/notes.txt"),
                 "a link or an unreadable file is refused")  # fmt: skip
    finally:
        notes.unlink()
        notes.write_bytes(kept)


def test_an_out_dir_elsewhere_is_refused(node: Holder) -> None:
    grant, expires = node.grant(node.done)
    elsewhere = Member(node.done.run_id, node.done.attempt, 0, node.agent.state_dir)
    _refused(node, request_fields(elsewhere, grant, expires),
             f"on this Node is not {node.agent.state_dir}")  # fmt: skip


def test_the_manifest_of_a_running_member_is_refused(node: Holder) -> None:
    grant, expires = node.grant(node.running)
    _refused(node, request_fields(node.running, grant, expires), "is running")
    _refused(node, request_fields(node.running, grant, expires, "file", "anything"),
             "is running")  # fmt: skip


def test_a_request_over_the_bound_is_refused_from_its_length(node: Holder) -> None:
    refusals = node.log_count("outputs refused")
    with RawClient(node.address) as client:
        client.send((10 * 1024 * 1024).to_bytes(4, "big"))
        response, _ = client.response()
        assert not response.ok and f"at most {ow.MAX_REQUEST_BYTES}" in response.error
        assert client.closed()
    wait_for_log(node, "outputs refused", refusals + 1)


def test_a_malformed_request_is_refused(node: Holder) -> None:
    with RawClient(node.address) as client:
        client.send(ow.frame(b"{not json"))
        response, _ = client.response()
        assert not response.ok and "not UTF-8 JSON" in response.error
        assert client.closed()


def test_plain_tcp_gets_nothing_and_the_listener_keeps_serving(node: Holder) -> None:
    host, port = _split(node.address)
    with socket.create_connection((host, port), timeout=10) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
        raw.settimeout(10)
        try:
            got = raw.recv(4096)
        except ConnectionError:
            got = b""
        assert b"manifest" not in got and b"tuneplane" not in got
    test_a_good_grant_is_served_the_manifest_and_a_listed_file(node)


def test_a_wrong_certificate_digest_sends_nothing_to_the_real_listener(node: Holder) -> None:
    served = node.log_count("outputs served")
    refusals = node.log_count("outputs refused")
    grant, expires = node.grant(node.done)
    wrong = InitFromFetch(node.address, "0" * 64, grant, expires)
    with (
        pytest.raises(FetchFailed, match="nothing was sent to it"),
        connect(wrong, node.source(node.done)),
    ):
        pass
    # A request made after it is the first one the holder logs: the pinned-out one sent none.
    _refused(node, request_fields(node.done, secrets.token_hex(32), expires), "not this Node's")
    assert node.log_count("outputs served") == served
    assert node.log_count("outputs refused") == refusals + 1


def test_a_wrong_certificate_never_receives_the_grant(node: Holder, tmp_path: Path) -> None:
    """An impostor listener with its own certificate records every byte it receives after the
    handshake: the fetching client hangs up without sending one."""
    pem = tmp_path / "impostor.pem"
    pem.write_bytes(make_tls_pem("impostor", datetime.datetime.now(datetime.UTC)))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(pem))
    received: list[bytes] = []
    handshaken = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with ctx.wrap_socket(conn, server_side=True) as tls:
            handshaken.set()
            tls.settimeout(10)
            try:
                while chunk := tls.recv(65536):
                    received.append(chunk)
            except (OSError, ssl.SSLError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    grant, expires = node.grant(node.done)
    address = join_host_port("127.0.0.1", server.getsockname()[1])
    try:
        order = InitFromFetch(address, node.cert_sha256, grant, expires)
        with (
            pytest.raises(FetchFailed, match="not the holder's"),
            connect(order, node.source(node.done)),
        ):
            pass
        thread.join(15)
    finally:
        server.close()
    assert handshaken.is_set()
    assert not thread.is_alive()
    assert b"".join(received) == b""
    assert grant.encode() not in b"".join(received)
    assert hashlib.sha256(pem.read_bytes()).hexdigest() != node.cert_sha256


def _split(address: str) -> tuple[str, int]:
    found = split_host_port(address)
    assert found is not None, f"{address!r} is not HOST:PORT"
    return found
