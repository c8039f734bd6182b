"""A real TLS reverse proxy in front of a test registry that first answers chosen requests with
an error status, as a load balancer in front of an overloaded or restarting registry does (429,
502, 503, 504), then forwards everything to the registry.

Rules: it listens on its own loopback port with the registry's own certificate (issued for
127.0.0.1 by the test CA), so a client that trusts the registry trusts it; it runs in a thread of
the test process and is shut down when the ``with`` block ends; every answer it gave is kept in
:attr:`BusyProxy.answers` for the test to read.
"""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import attrs
import httpx

from tests.support.oci_registry import RegistryProcess

#: Response headers not passed on: hop-by-hop, or re-made by this server.
_DROPPED = {"connection", "transfer-encoding", "keep-alive", "server", "date"}


@attrs.define
class BusyProxy:
    """``failures``: for a path containing the key, the statuses to answer first, in order."""

    upstream: RegistryProcess
    failures: dict[str, list[int]]
    retry_after: str = ""
    port: int = 0
    answers: list[tuple[str, int]] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def next_failure(self, path: str) -> int | None:
        with self._lock:
            for part, statuses in self.failures.items():
                if part in path and statuses:
                    return statuses.pop(0)
        return None

    def record(self, path: str, status: int) -> None:
        with self._lock:
            self.answers.append((path, status))

    def failed(self) -> list[tuple[str, int]]:
        """The answers this proxy made up (not the registry's)."""
        with self._lock:
            return [(path, status) for path, status in self.answers if status >= 400]


def _handler(proxy: BusyProxy, client: httpx.Client) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return  # the answers are recorded; nothing goes to the test's stderr

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            status = proxy.next_failure(self.path)
            if status is not None:
                text = b"busy, try again\n"
                self.send_response(status)
                if proxy.retry_after:
                    self.send_header("Retry-After", proxy.retry_after)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                if body:
                    self.wfile.write(text)
                proxy.record(self.path, status)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            with client.stream(self.command, self.path, headers=headers) as upstream:
                self.send_response(upstream.status_code)
                for name, value in upstream.headers.multi_items():
                    if name.lower() not in _DROPPED:
                        self.send_header(name, value)
                self.end_headers()
                if body:
                    for chunk in upstream.iter_raw():
                        self.wfile.write(chunk)
            proxy.record(self.path, upstream.status_code)

    return Handler


@contextmanager
def busy_proxy(
    registry: RegistryProcess,
    failures: Mapping[str, Sequence[int]],
    retry_after: str = "",
) -> Iterator[BusyProxy]:
    """A :class:`BusyProxy` for ``registry`` on a free loopback port, for the ``with`` block."""
    proxy = BusyProxy(registry, {k: list(v) for k, v in failures.items()}, retry_after)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(registry.folder / "tls/server.pem", registry.folder / "tls/server.key")
    with httpx.Client(
        base_url=f"https://{registry.address}",
        verify=ssl.create_default_context(cafile=str(registry.ca_file)),
        timeout=30,
    ) as client:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy, client))
        server.daemon_threads = True
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        proxy.port = server.socket.getsockname()[1]
        thread = threading.Thread(target=server.serve_forever, name="busy-proxy", daemon=True)
        thread.start()
        try:
            yield proxy
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=30)
