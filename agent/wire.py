"""The wire edge's footing: the agent's wire errors, the coordinator's address, TLS, the channel.

Part of the agent's adapter layer (with :mod:`.adapter`, :mod:`.wire_convert` and
:mod:`.wire_control`): only these modules touch grpclib, betterproto or asyncio.

Rules:
- The wire modules are the only agent modules that talk to the coordinator over grpclib;
  besides them only the shared client helpers they use (:mod:`.client_tls`,
  :mod:`.call_failure`, :mod:`.grpc_limits`) import grpclib. Server verification is always on
  (the CA from the Node's state dir), ALPN offers only h2, and a unary call has a 10 s deadline.
- Exceptions are translated once, here (:func:`translated`), by the one table every client
  shares (:mod:`.call_failure`), into :class:`WireError` subclasses whose ``str()`` says what
  failed and how to fix it.
- grpclib is asyncio code: every call goes through :func:`tuneplane.agent.adapter.run_aio`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
from grpclib.client import Channel

from .call_failure import CALL_ERRORS, Kind, classify
from .client_tls import CaFileError, grpc_client_context
from .grpc_limits import ClientCodec
from .host_port import join_host_port, split_host_port
from .wire_errors import CoordinatorBusy as CoordinatorBusy
from .wire_errors import CoordinatorUnreachable as CoordinatorUnreachable
from .wire_errors import Refused as Refused
from .wire_errors import TlsVerificationFailed as TlsVerificationFailed
from .wire_errors import UnknownMessage as UnknownMessage
from .wire_errors import WireError as WireError

UNARY_DEADLINE_S = 10.0
#: Connecting to a coordinator and opening the control stream (TCP, TLS, HTTP/2 headers): a
#: coordinator that takes longer is treated as unreachable and the next one is tried.
CONNECT_DEADLINE_S = 3.0


@attrs.frozen
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Read ``HOST:PORT`` (``[::1]:PORT`` for IPv6). Raises :class:`ValueError` with the fix."""
        found = split_host_port(text)
        if found is None:
            raise ValueError(
                f"coordinator address {text!r} is not HOST:PORT; use the `control` address from "
                "the coordinator's endpoints.json, for example 127.0.0.1:7444."
            )
        return cls(*found)

    def __str__(self) -> str:
        return join_host_port(self.host, self.port)


def client_tls(ca_path: Path) -> ssl.SSLContext:
    """The one client TLS (:mod:`tuneplane.agent.client_tls`), a CA file it cannot load being a
    :class:`TlsVerificationFailed` (retrying won't help)."""
    try:
        return grpc_client_context(ca_path)
    except CaFileError as exc:
        raise TlsVerificationFailed(str(exc)) from None


@contextmanager
def translated(endpoint: Endpoint, ca_path: Path, call: str) -> Iterator[None]:
    """Map what ``call`` raised to :class:`WireError` subclasses, once, at the edge, by the one
    table (:func:`tuneplane.agent.call_failure.classify`)."""
    try:
        yield
    except CALL_ERRORS as exc:
        failure = classify(exc)
        text = failure.sentence(
            f"the coordinator at {endpoint}",
            call,
            UNARY_DEADLINE_S,
            ca_path,
            "Pass the coordinator's own tls/ca.pem",
            "that node.json's coordinator names its control listener",
        )
        if failure.kind is Kind.REFUSED:
            raise Refused(text, failure.status) from None
        if failure.kind is Kind.UNVERIFIED:
            raise TlsVerificationFailed(text) from None
        raise CoordinatorUnreachable(text) from None


async def aio_channel(endpoint: Endpoint, ctx: ssl.SSLContext) -> Channel:
    """A grpclib channel to the coordinator (asyncio code: call it through ``run_aio``)."""
    return Channel(endpoint.host, endpoint.port, ssl=ctx, codec=ClientCodec())
