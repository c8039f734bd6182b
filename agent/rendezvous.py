"""The rendezvous check: member 0's Node holds the rendezvous port, the others prove they reach it.

Theory of operation:
- At Prepare, member 0's Node binds a TCP listener on the rendezvous port (on every address, as
  a framework's rank 0 does) and advertises its own address with it. The listener keeps the port
  reserved until the workload starts (it is closed just before, so rank 0 can bind it) or the
  member ends.
- Every other member's Prepare carries that address, port and the attempt's nonce. Its Node
  connects and sends a challenge; the listener answers HMAC-SHA256(nonce, challenge). A right
  answer proves this very attempt's listener answered at that address, so some other service on
  the port cannot pass for it, and the nonce itself never crosses the wire.
- A Node that gets no right answer within :data:`PROBE_TIMEOUT_S` refuses the Prepare with a
  sentence naming the address, the port and the interface it tried from.
- Each member's workload gets ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` naming the
  interface the kernel routes to the rendezvous address through (member 0: the interface of its
  own address), unless the Job's env sets them.

The handshake (bytes in, bytes out) and the route lookup are plain functions; the listener and
the probe are the Trio shell around them.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Mapping

import attrs
import psutil
import trio

log = logging.getLogger(__name__)

#: How long a Node tries to reach member 0's rendezvous listener before it refuses Prepare.
PROBE_TIMEOUT_S = 10.0
#: How long the listener gives one probe to send its challenge and to hang up afterwards.
PROBE_SESSION_S = 5.0
#: Probes the listener answers at once; more wait for a free slot.
MAX_CONCURRENT_PROBES = 32
#: For tests only: the address member 0's Node advertises instead of its own. It stands for a
#: Node whose advertised address the other Nodes cannot reach (a documented TEST-NET address).
TEST_ADDRESS_VARIABLE = "TUNEPLANE_TEST_RENDEZVOUS_ADDRESS"
#: The variables the frameworks read to pick the network interface their sockets use.
IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

MAGIC = b"TPRDV1\r\n"
CHALLENGE_BYTES = 32
REQUEST_BYTES = len(MAGIC) + CHALLENGE_BYTES
ANSWER_BYTES = hashlib.sha256().digest_size
_CONTEXT = b"tuneplane rendezvous v1\x00"


# --- the handshake (pure) ------------------------------------------------------------------------


def new_challenge() -> bytes:
    return secrets.token_bytes(CHALLENGE_BYTES)


def probe_request(challenge: bytes) -> bytes:
    """What a probing Node sends: the magic, then its challenge."""
    if len(challenge) != CHALLENGE_BYTES:
        raise ValueError(f"a challenge is {CHALLENGE_BYTES} bytes, not {len(challenge)}")
    return MAGIC + challenge


def read_request(data: bytes) -> bytes | None:
    """The challenge in a probe's request, or None when the bytes are not a probe."""
    if len(data) != REQUEST_BYTES or not data.startswith(MAGIC):
        return None
    return data[len(MAGIC) :]


def answer(nonce: str, challenge: bytes) -> bytes:
    """The listener's answer: it can only be made by one who holds the attempt's nonce."""
    return hmac.new(nonce.encode("utf-8"), _CONTEXT + challenge, hashlib.sha256).digest()


def answer_proves(nonce: str, challenge: bytes, reply: bytes) -> bool:
    """Whether ``reply`` is this attempt's listener answering ``challenge``."""
    return len(reply) == ANSWER_BYTES and hmac.compare_digest(reply, answer(nonce, challenge))


# --- routes and interfaces ------------------------------------------------------------------------


@attrs.frozen
class Route:
    """How this host reaches an address: the local address it sends from and its interface."""

    local_address: str
    interface: str  # "" when no interface holds local_address (a NAT rule, a vanished address)


def _bare(address: str) -> str:
    """An address without its IPv6 zone (``fe80::1%eth0`` -> ``fe80::1``), normalised."""
    text = address.split("%", 1)[0]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return text


def interface_of(local_address: str, interfaces: Mapping[str, list[str]]) -> str:
    """The interface holding ``local_address`` in ``interfaces`` (name -> addresses), or ""."""
    wanted = _bare(local_address)
    for name in sorted(interfaces):
        if any(_bare(a) == wanted for a in interfaces[name]):
            return name
    return ""


def local_interfaces() -> dict[str, list[str]]:
    """Every interface of this host and its IPv4/IPv6 addresses (psutil reads the kernel's)."""
    found: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        found[name] = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    return found


def route_to(address: str) -> Route | None:
    """The kernel's route to ``address``: a UDP ``connect`` picks it and sends nothing. None when
    no interface of this host routes there."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        infos = socket.getaddrinfo(address, 9, family, socket.SOCK_DGRAM)
    except OSError:
        return None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(infos[0][4])
            local = str(sock.getsockname()[0])
        except OSError:
            return None
    return Route(local, interface_of(local, local_interfaces()))


def ifname_env(address: str, job_env: Mapping[str, str]) -> dict[str, str]:
    """``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` for a member whose rendezvous is at
    ``address``, leaving out each one the Job's env sets (the researcher's choice wins)."""
    missing = [name for name in IFNAME_VARIABLES if name not in job_env]
    if not missing or not address:
        return {}
    route = route_to(address)
    if route is None or not route.interface:
        log.warning("no interface found for the rendezvous address=%s", address)
        return {}
    return {name: route.interface for name in missing}


def advertised_address(node_address: str) -> str:
    """The address member 0's Node puts in the rendezvous: its own, unless a test says another."""
    return os.environ.get(TEST_ADDRESS_VARIABLE, "").strip() or node_address


# --- the listener (member 0's Node) ---------------------------------------------------------------


class ListenFailed(Exception):
    """The rendezvous port cannot be held; ``str()`` is a sentence for PrepareReply.reason."""


async def _answer_one(stream: trio.SocketStream, nonce: str) -> None:
    """Answer one probe; anything that is not a probe is hung up on without an answer."""
    with trio.move_on_after(PROBE_SESSION_S):
        data = b""
        while len(data) < REQUEST_BYTES:
            chunk = await stream.receive_some(REQUEST_BYTES - len(data))
            if not chunk:
                return
            data += chunk
        challenge = read_request(data)
        if challenge is None:
            log.info("rendezvous listener hung up on a connection that is not a probe")
            return
        await stream.send_all(answer(nonce, challenge))
        # The prober hangs up first, so the port's TIME_WAIT stays on its side and rank 0 can
        # bind the port the moment this listener closes.
        while await stream.receive_some(64):
            pass


@attrs.define(eq=False)
class Listener:
    """A held rendezvous port, served in the nursery it was opened in until :meth:`aclose`."""

    address: str
    port: int
    _socket: trio.socket.SocketType = attrs.field(alias="socket")
    _nonce: str = attrs.field(alias="nonce", repr=False)
    _scope: trio.CancelScope = attrs.field(factory=trio.CancelScope, alias="scope")
    _closed: trio.Event = attrs.field(factory=trio.Event, alias="closed")

    async def serve(self) -> None:
        slots = trio.Semaphore(MAX_CONCURRENT_PROBES)
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    while True:
                        await slots.acquire()
                        try:
                            conn, _ = await self._socket.accept()
                        except OSError as exc:
                            slots.release()
                            log.warning("rendezvous listener accept failed port=%d reason=%s",
                                        self.port, exc)  # fmt: skip
                            continue
                        nursery.start_soon(self._one, conn, slots)
        finally:
            self._socket.close()
            self._closed.set()

    async def _one(self, conn: trio.socket.SocketType, slots: trio.Semaphore) -> None:
        stream = trio.SocketStream(conn)
        try:
            await _answer_one(stream, self._nonce)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # The prober went away mid-handshake: nothing to answer, and the listener goes on.
            log.debug("rendezvous probe ended early reason=%s", exc)
        finally:
            await trio.aclose_forcefully(stream)
            slots.release()

    async def aclose(self) -> None:
        """Stop answering and release the port; returns once the socket is closed."""
        self._scope.cancel()
        await self._closed.wait()


async def open_listener(nursery: trio.Nursery, address: str, nonce: str, port: int = 0) -> Listener:
    """Hold a rendezvous port (``port``, or a free one for 0) on every address of ``address``'s
    family, answering probes for ``nonce``; advertised as ``address``."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        # A port this Node held before a restart can be taken again at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        sock.listen(MAX_CONCURRENT_PROBES)
    except OSError as exc:
        sock.close()
        which = f"port {port}" if port else "a free TCP port"
        raise ListenFailed(
            f"This Node cannot hold {which} for the rendezvous ({exc.strerror or exc}); free "
            "the port or start a new attempt."
        ) from None
    listener = Listener(address, int(sock.getsockname()[1]), socket=sock, nonce=nonce)
    nursery.start_soon(listener.serve)
    return listener


# --- the probe (every other member's Node) ------------------------------------------------------


class Unreachable(Exception):
    """The rendezvous cannot be reached; ``str()`` is the sentence for PrepareReply.reason."""


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return "no route to it"
    if exc.errno == errno.ECONNREFUSED:
        return "the connection was refused (nothing listens there)"
    return exc.strerror or str(exc)


async def _ask(address: str, port: int, nonce: str) -> str | None:
    """One probe: None when the listener proved itself, else why not (a few words)."""
    challenge = new_challenge()
    try:
        infos = await trio.socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"the name does not resolve ({exc})"
    family, kind, proto, _, where = infos[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        await sock.connect(where)
    except BaseException as exc:
        sock.close()  # also when the bound ran out mid-connect
        if isinstance(exc, OSError):
            return _why(exc)
        raise
    async with trio.SocketStream(sock) as stream:
        try:
            await stream.send_all(probe_request(challenge))
            reply = b""
            while len(reply) < ANSWER_BYTES:
                chunk = await stream.receive_some(ANSWER_BYTES - len(reply))
                if not chunk:
                    break
                reply += chunk
        except (trio.BrokenResourceError, OSError) as exc:
            return f"the connection broke ({exc})"
    if answer_proves(nonce, challenge, reply):
        return None
    return (
        "something answered there, but not this attempt's member 0 Node (its answer did not "
        "prove the attempt's nonce)"
    )


async def probe(address: str, port: int, nonce: str, timeout_s: float = PROBE_TIMEOUT_S) -> Route:
    """Prove that this attempt's member 0 Node listens at ``address:port``; return the route.

    Raises :class:`Unreachable` naming the address, the port and the interface tried from when
    no right answer comes within ``timeout_s`` (a refused connection is tried again until then:
    the listener may be behind a briefly busy network).
    """
    route = route_to(address)
    where = (
        f"from interface {route.interface or '(none)'} (local address {route.local_address})"
        if route is not None
        else "but no interface of this Node routes there"
    )
    why = "it did not answer in time"
    with trio.move_on_after(timeout_s):
        while True:
            problem = await _ask(address, port, nonce)
            if problem is None:
                return route or Route("", "")
            why = problem
            await trio.sleep(0.2)
    raise Unreachable(
        f"This Node cannot reach the rendezvous {address}:{port} that member 0's Node picked: "
        f"{why}. It tried {where} for {timeout_s:g} s. Make sure the Nodes can reach each other "
        "at the address member 0's Node reaches the coordinator from (a firewall or a second "
        "network interface may stand in the way), then retry the Job."
    )
