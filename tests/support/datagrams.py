"""A datagram socket a test binds to stand in for systemd: its notify socket or journald's.

Rules: a thread receives every datagram as it arrives (a daemon never blocks on a full queue
here) and keeps it with the monotonic and wall-clock times of its arrival; tests wait on
:meth:`DatagramInbox.wait_for`, never on a fixed sleep. ``on_datagram`` runs in that thread at
arrival, for checks that must happen at that moment (a listener accepts when READY=1 arrives).
"""

from __future__ import annotations

import array
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import attrs

_FD_SIZE = array.array("i").itemsize
# Room for a passed file descriptor and the sender's credentials (pid, uid, gid).
_ANCILLARY = socket.CMSG_SPACE(_FD_SIZE) + socket.CMSG_SPACE(struct.calcsize("=iII"))


@attrs.frozen
class Datagram:
    data: bytes
    at_monotonic: float
    at_ms: int
    #: The sending process as the kernel vouches for it (SCM_CREDENTIALS), as systemd checks it.
    sender_pid: int


def notify_fields(data: bytes) -> dict[str, str]:
    """sd_notify's ``KEY=value`` lines."""
    return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)


def journal_fields(data: bytes) -> dict[str, str]:
    """journald's native protocol: ``KEY=value`` lines, or ``KEY``, a newline, the value's
    length (64 bits, little-endian), the value and a newline."""
    fields: dict[str, str] = {}
    at = 0
    while at < len(data):
        end = data.index(b"\n", at)
        line = data[at:end]
        if b"=" in line:
            key, value = line.split(b"=", 1)
            at = end + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", data, end + 1)
            value = data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n", "a binary field ends in \\n"
            at = end + 10 + size
        fields[key.decode()] = value.decode()
    return fields


class DatagramInbox:
    """A bound ``AF_UNIX`` datagram socket at ``address`` (a path, or ``@name`` for abstract)."""

    def __init__(self, address: str, on_datagram: Callable[[Datagram], None] | None = None) -> None:
        self.address = address
        self.received: list[Datagram] = []
        self.errors: list[BaseException] = []
        self._on_datagram = on_datagram
        self._changed = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self._sock.recvmsg(1 << 20, _ANCILLARY)
            except TimeoutError:
                continue
            except OSError:
                return
            sender = 0
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    sender = struct.unpack_from("=iII", payload)[0]
                # journald's protocol passes a large entry as a sealed memfd.
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fd = array.array("i", payload[:_FD_SIZE])[0]
                    with os.fdopen(fd, "rb") as memfd:
                        memfd.seek(0)
                        data = memfd.read()
            got = Datagram(data, time.monotonic(), int(time.time() * 1000), sender)
            if self._on_datagram is not None:
                try:
                    self._on_datagram(got)
                except BaseException as exc:
                    self.errors.append(exc)
            with self._changed:
                self.received.append(got)
                self._changed.notify_all()

    def wait_for(
        self, what: str, check: Callable[[list[Datagram]], object], timeout: float = 30.0
    ) -> object:
        """Wait until ``check(received)`` is truthy (and return it); fail naming ``what``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = check(list(self.received))
                if found:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout:g} s waiting for {what}; received: "
                        f"{[d.data[:200] for d in self.received]}"
                    )
                self._changed.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        if not self.address.startswith("@"):
            Path(self.address).unlink(missing_ok=True)

    def __enter__(self) -> DatagramInbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["Datagram", "DatagramInbox", "journal_fields", "notify_fields"]
