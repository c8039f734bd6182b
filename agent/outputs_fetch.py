"""Fetch a source member's outputs from the Node that holds them (blocking; a Prepare worker).

Rules:
- One TLS connection per fetch. The holder's certificate is self-signed, so it is not verified
  against a CA (``CERT_NONE``) but PINNED: the sha256 of its DER must equal the digest the
  coordinator sent (from the holder's own Hello) before a single byte is sent, so the grant
  never reaches anyone else.
- Every request carries the grant (agent/outputs_wire.py); the holder decides each one.
- Socket timeouts bound the connect and every read and write; response headers are bounded
  before they are read, the manifest by ``MAX_MANIFEST_BYTES``, a file body by the size its
  header announced (what the body holds is checked by the caller, agent/init_from.py).
- Every failure is :class:`FetchFailed` whose ``str()`` says what went wrong, in words.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

from tuneplane.proto.contract.derivation_source import InitFromSource

from . import outputs_wire as ow
from .host_port import split_host_port
from .messages import InitFromFetch
from .outputs_manifest import MAX_MANIFEST_BYTES, Entry

CONNECT_TIMEOUT_S = 10.0
#: The longest any one read or write may wait (a holder that stops sending mid-file).
IO_TIMEOUT_S = 30.0


class FetchFailed(Exception):
    """The holder could not be reached, was not the pinned one, refused, or broke off."""


def client_context() -> ssl.SSLContext:
    """TLS 1.2+, no CA check and no host name: the certificate is pinned by digest instead."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _recv_exact(sock: ssl.SSLSocket, size: int, what: str) -> bytes:
    parts: list[bytes] = []
    left = size
    while left:
        chunk = sock.recv(min(left, 1024 * 1024))
        if not chunk:
            raise FetchFailed(f"the holder hung up in the middle of {what}")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class Body:
    """A file's body as the holder sends it: at most the size its header announced."""

    def __init__(self, conn: Connection, size: int, rel: str) -> None:
        self._conn = conn
        self.size = size
        self.left = size
        self._rel = rel

    def read(self, size: int = -1, /) -> bytes:
        if self.left == 0:
            return b""
        want = self.left if size < 0 else min(size, self.left)
        chunk = self._conn.recv_some(want, f"the file {self._rel}")
        self.left -= len(chunk)
        return chunk


class Connection:
    """An open, pinned connection to one holder for one source member."""

    def __init__(self, sock: ssl.SSLSocket, fetch: InitFromFetch, source: InitFromSource) -> None:
        self._sock = sock
        self._fetch = fetch
        self._source = source
        # A body not read to its end leaves the stream mid-frame: nothing more may be asked.
        self._body: Body | None = None

    def recv_some(self, size: int, what: str) -> bytes:
        try:
            chunk = self._sock.recv(size)
        except TimeoutError:
            raise FetchFailed(
                f"the holder sent nothing for {IO_TIMEOUT_S:g} s during {what}"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise FetchFailed(f"the connection broke during {what} ({exc})") from None
        if not chunk:
            raise FetchFailed(f"the holder hung up in the middle of {what}")
        return chunk

    def _request(self, op: str, path: str = "") -> ow.Response:
        if self._body is not None and self._body.left:
            raise FetchFailed("a file was not read to its end before the next request")
        request = ow.Request(
            op=op,
            run_id=self._source.run_id,
            attempt=self._source.attempt,
            member_index=self._source.member_index,
            out_dir=self._source.out_dir,
            grant=self._fetch.grant,
            expires_at_ms=self._fetch.grant_expires_at_ms,
            path=path,
        )
        what = f"the answer to the {op} request" + (f" for {path}" if path else "")
        try:
            self._sock.sendall(ow.encode_request(request))
            prefix = _recv_exact(self._sock, ow.PREFIX_BYTES, what)
            length = ow.body_length(prefix, ow.MAX_RESPONSE_BYTES, "holder's response")
            response = ow.decode_response(_recv_exact(self._sock, length, what))
        except ow.FrameError as exc:
            raise FetchFailed(f"the holder's answer is not of this protocol: {exc}") from None
        except TimeoutError:
            raise FetchFailed(f"the holder sent nothing for {IO_TIMEOUT_S:g} s ({what})") from None
        except (OSError, ssl.SSLError) as exc:
            raise FetchFailed(f"the connection broke ({exc})") from None
        if not response.ok:
            raise FetchFailed(f"the holder refused: {response.error}")
        return response

    def manifest(self) -> bytes:
        """The source member's manifest bytes, as the holder serves them."""
        response = self._request("manifest")
        if response.size > MAX_MANIFEST_BYTES:
            raise FetchFailed(
                f"the holder announces a manifest of {response.size} bytes; at most "
                f"{MAX_MANIFEST_BYTES} are accepted"
            )
        body = Body(self, response.size, "the manifest")
        parts = []
        while chunk := body.read(1024 * 1024):
            parts.append(chunk)
        return b"".join(parts)

    @contextmanager
    def open_file(self, entry: Entry) -> Iterator[Body]:
        """The body of one file the manifest lists (its checks are the caller's)."""
        response = self._request("file", entry.path)
        self._body = Body(self, response.size, entry.path)
        yield self._body


@contextmanager
def connect(
    fetch: InitFromFetch, source: InitFromSource, timeout_s: float = IO_TIMEOUT_S
) -> Iterator[Connection]:
    """Dial the holder, pin its certificate, and yield the connection (closed on leaving)."""
    address = split_host_port(fetch.address)
    if address is None:
        raise FetchFailed(
            f"the outputs address {fetch.address!r} is not HOST:PORT; the coordinator sent an "
            "address this Node cannot dial"
        )
    host, port = address
    try:
        raw = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise FetchFailed(f"no connection within {CONNECT_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise FetchFailed(
            f"the connection failed ({exc.strerror or exc}); is the holder running, and may "
            "this Node reach that port (firewall)?"
        ) from None
    raw.settimeout(timeout_s)
    try:
        sock = client_context().wrap_socket(raw)
    except TimeoutError:
        raw.close()
        raise FetchFailed(f"no TLS handshake within {timeout_s:g} s") from None
    except (OSError, ssl.SSLError) as exc:
        raw.close()
        raise FetchFailed(f"the TLS handshake failed ({exc})") from None
    with sock:
        der = sock.getpeercert(binary_form=True) or b""
        found = hashlib.sha256(der).hexdigest()
        if found != fetch.cert_sha256:
            # Nothing was sent: the grant stays with this Node.
            raise FetchFailed(
                f"the listener there presented a certificate whose sha256 is {found}, not the "
                f"holder's {fetch.cert_sha256 or '(none given)'}; nothing was sent to it"
            )
        yield Connection(sock, fetch, source)
