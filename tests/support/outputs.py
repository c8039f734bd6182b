"""A real Node holding ended members' outputs, and a raw client of its outputs listener.

Rules: the holder is a real ``tuneplane-node`` (tests/support/agent.py) under a real coordinator,
whose members ran real jobs; the test plays the coordinator's part only by signing grants with
the grant key the Node keeps in its state directory (what the Node tells the coordinator in
Hello). The raw client speaks agent/outputs_wire.py over TLS, pinned like agent/outputs_fetch.py,
so a test can send what no well-behaved Node would.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from tests.agent.jobs import journal, tp, wait_job
from tests.faults.jobs import project, submit, wait_state
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.agent import outputs_wire as ow
from tuneplane.agent.host_port import split_host_port
from tuneplane.agent.messages import InitFromFetch
from tuneplane.agent.outputs_fetch import client_context
from tuneplane.agent.outputs_identity import GRANT_KEY_FILE, TLS_FILE
from tuneplane.coordinator.derivation import GRANT_TTL_MS
from tuneplane.proto.contract.derivation_source import InitFromSource, manifest_path
from tuneplane.proto.contract.outputs_grant import make_grant

WRITE = """set -eu
mkdir -p "$TUNEPLANE_OUT_DIR/ckpt"
head -c 1500000 /dev/urandom > "$TUNEPLANE_OUT_DIR/ckpt/model.bin"
echo "step 7" > "$TUNEPLANE_OUT_DIR/ckpt/notes.txt"
"""
#: Runs until the test ends it (tp job cancel).
SLEEP = "sleep 600\n"


@attrs.frozen
class Member:
    run_id: str
    attempt: int
    member_index: int
    out_dir: Path

    @property
    def manifest(self) -> Path:
        return Path(manifest_path(str(self.out_dir)))


@attrs.frozen
class Holder:
    coord: CoordinatorProcess
    agent: AgentProcess
    done: Member  # exited, with ckpt/model.bin and ckpt/notes.txt
    other: Member  # another exited member
    running: Member  # still running

    @property
    def address(self) -> str:
        return str(self.agent.status()["outputs_listen"])

    @property
    def grant_key(self) -> bytes:
        return (self.agent.state_dir / "credentials" / GRANT_KEY_FILE).read_bytes()

    @property
    def cert_sha256(self) -> str:
        pem = (self.agent.state_dir / "credentials" / TLS_FILE).read_text()
        cert = pem[pem.index("-----BEGIN CERTIFICATE-----") :]
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert)).hexdigest()

    def grant(self, member: Member, expires_at_ms: int | None = None) -> tuple[str, int]:
        """A grant as the coordinator makes it for ``member`` (and its expiry)."""
        expires = expires_at_ms or int(time.time() * 1000) + GRANT_TTL_MS
        key = self.grant_key
        return make_grant(key, member.run_id, member.attempt, member.member_index, expires), expires

    def fetch_order(self, member: Member) -> InitFromFetch:
        grant, expires = self.grant(member)
        return InitFromFetch(self.address, self.cert_sha256, grant, expires)

    def source(self, member: Member) -> InitFromSource:
        """The member as a resolved JobSpec names it for a Node that fetches it."""
        data = member.manifest.read_bytes()
        listed = json.loads(data)
        return InitFromSource(
            run_id=member.run_id, attempt=member.attempt, member_index=member.member_index,
            out_dir=str(member.out_dir), manifest_sha256=hashlib.sha256(data).hexdigest(),
            files=len(listed["files"]), bytes=listed["bytes"], node_id=self.agent.node_id,
        )  # fmt: skip

    def log_count(self, text: str) -> int:
        return self.agent.read_log().count(text)


def _member(agent: AgentProcess, run_id: str) -> Member:
    rows = [r for r in journal(agent, "members", "--json") if r["run_id"] == run_id]
    assert len(rows) == 1, rows
    row: dict[str, Any] = rows[0]
    return Member(run_id, int(row["attempt"]), int(row["member_index"]), Path(row["out_dir"]))


@contextmanager
def holder(root: Path) -> Iterator[Holder]:
    """A coordinator and one Node (listener on a free loopback port) holding two exited
    members and a running one; the running Job is cancelled at the end."""
    with start_coordinator(root) as coord:
        agent = start_agent(root, coord, "holder", "h200:2")
        try:
            agent.wait_connected()
            done = submit(coord, project(coord, root / "done", "custom/custom",
                                         {"train.sh": WRITE}), "h200:1")  # fmt: skip
            other = submit(coord, project(coord, root / "other", "custom/custom",
                                          {"train.sh": WRITE}), "h200:1")  # fmt: skip
            for run_id in (done, other):
                assert wait_job(coord, run_id, 120)["state"] == "succeeded"
            running = submit(coord, project(coord, root / "running", "custom/custom",
                                            {"train.sh": SLEEP}), "h200:1")  # fmt: skip
            wait_state(coord, running, "running", 120)
            wait_until("the holder to say Hello with its outputs address",
                       lambda: agent.status().get("outputs_address"))  # fmt: skip
            yield Holder(
                coord, agent, _member(agent, done), _member(agent, other),
                _member(agent, running),
            )  # fmt: skip
            tp(coord, "job", "cancel", running, "--reason", "test over")
            wait_job(coord, running, 60)
        finally:
            agent.stop()


class RawClient:
    """One pinned TLS connection to a listener, sending whatever the test asks."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        host, port = _split(address)
        raw = socket.create_connection((host, port), timeout=timeout)
        self.sock = client_context().wrap_socket(raw)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, **fields: Any) -> None:
        self.send(ow.frame(json.dumps(fields).encode()))

    def _exact(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise EOFError(f"the listener hung up after {len(data)} of {size} bytes")
            data += chunk
        return data

    def response(self) -> tuple[ow.Response, bytes]:
        """The next response and its body."""
        size = ow.body_length(self._exact(4), ow.MAX_RESPONSE_BYTES, "response")
        response = ow.decode_response(self._exact(size))
        return response, self._exact(response.size) if response.ok else b""

    def closed(self) -> bool:
        """Whether the listener hung up (after its last answer)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionError, ssl.SSLError):
            return True


def request_fields(member: Member, grant: str, expires: int, op: str = "manifest",
                   path: str | None = None) -> dict[str, Any]:  # fmt: skip
    fields: dict[str, Any] = {
        "op": op, "run_id": member.run_id, "attempt": member.attempt,
        "member_index": member.member_index, "out_dir": str(member.out_dir), "grant": grant,
        "expires_at_ms": expires,
    }  # fmt: skip
    if path is not None:
        fields["path"] = path
    return fields


def snapshot(*roots: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``roots``: size, mtime and sha256 (what "nothing changed" compares)."""
    found: dict[str, tuple[int, int, str]] = {}
    for root in roots:
        for folder, _dirs, files in os.walk(root):
            for name in files:
                path = Path(folder) / name
                if path.is_symlink() or not path.is_file():
                    continue
                info = path.stat()
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                found[str(path)] = (info.st_size, info.st_mtime_ns, digest)
    return found


def _split(address: str) -> tuple[str, int]:
    found = split_host_port(address)
    assert found is not None, f"{address!r} is not HOST:PORT"
    return found
