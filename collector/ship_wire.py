"""The collector's wire edge: one ``Ship`` call to a telemetry gateway over verified TLS.

Rules:
- The only collector module that imports grpclib, betterproto or trio-asyncio. Server
  verification is always on (the coordinator's CA); every call has a deadline.
- One channel per gateway the collector was given; each call names the one it goes to
  (which one is :mod:`.gateway_ring`'s decision, taken by the shell).
- The credential file is read again for every call, so a credential the Node replaced (a
  repeated Commit carries a fresh one) is picked up without a restart.
- Every failure leaves as :class:`ShipFailed` with a sentence (the one wording every client
  shares, :mod:`tuneplane.agent.call_failure`); the shell retries with backoff.
"""

from __future__ import annotations

import math
import ssl
import sys
from array import array
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
import trio_asyncio
from grpclib.client import Channel

from tuneplane.agent.call_failure import CALL_ERRORS, Kind, classify
from tuneplane.agent.client_tls import CaFileError, grpc_client_context
from tuneplane.agent.host_port import join_host_port, split_host_port
from tuneplane.proto import v1

from .point_rules import storable
from .points import HParamsMark, Mark, ReadWarning, RestartMark
from .spool import SpooledPoint

DEADLINE_S = 10.0
#: The data-loss warning a point becomes when the gateway refused it (it is never sent again).
GATEWAY_REFUSED_KIND = "refused-by-gateway"


class ShipFailed(Exception):
    """A Ship call did not store the batch; ``str()`` says why. ``refused`` when the gateway
    answered and said no (a credential or batch problem) rather than being unreachable."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class CollectorConfigError(Exception):
    """The gateway address, CA or credential file cannot be used; ``str()`` says how to fix it."""


@attrs.frozen
class Gateway:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Gateway:
        """``HOST:PORT`` (``[v6]:PORT``), read by
        :func:`tuneplane.agent.host_port.split_host_port`."""
        found = split_host_port(text)
        if found is None:
            raise CollectorConfigError(
                f"--gateway {text!r} is not HOST:PORT; pass the `telemetry` address from the "
                "coordinator's endpoints.json, for example 127.0.0.1:7445."
            )
        return cls(*found)

    def __str__(self) -> str:
        return join_host_port(self.host, self.port)


@attrs.frozen
class Progress:
    spool_points: int
    backpressure: bool
    member_exited: bool
    drained: bool
    warnings: int
    data_loss_warnings: int


def tls_context(ca_path: Path) -> ssl.SSLContext:
    """The one client TLS (:mod:`tuneplane.agent.client_tls`); a CA file it cannot load is a
    :class:`CollectorConfigError` naming ``--ca``."""
    try:
        return grpc_client_context(ca_path)
    except CaFileError as exc:
        raise CollectorConfigError(f"{exc} Pass it with --ca.") from None


def read_credential(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise CollectorConfigError(
            f"the collector credential {path} cannot be read ({exc.strerror}); the Node writes "
            "it when the member is committed. Pass its path with --credential-file."
        ) from None
    if not token:
        raise CollectorConfigError(f"the collector credential {path} is empty.")
    return token


def _packed(typecode: str, values: Iterable[float] | Iterable[int]) -> bytes:
    column = array(typecode, values)
    if sys.byteorder == "big":
        column.byteswap()
    return column.tobytes()


def columns(points: Sequence[SpooledPoint]) -> v1.PointColumns:
    """``points`` as the compact columns of ``PointColumns`` (little-endian numbers)."""
    strings: dict[str, int] = {}

    def ref(text: str) -> int:
        return strings.setdefault(text, len(strings))

    source_refs = [ref(p.source_id) for p in points]
    tag_refs = [ref(p.tag) for p in points]
    return v1.PointColumns(
        strings=list(strings),
        source_refs=_packed("I", source_refs),
        tag_refs=_packed("I", tag_refs),
        offsets=_packed("Q", [p.offset for p in points]),
        indexes=_packed("I", [p.index for p in points]),
        steps=_packed("q", [p.step for p in points]),
        wall_times=_packed("d", [math.nan if p.wall_time is None else p.wall_time for p in points]),
        values=_packed("d", [p.value for p in points]),
    )


def ship_request(
    member: tuple[str, int, int],
    points: Sequence[SpooledPoint],
    progress: Progress,
    marks: Sequence[Mark] = (),
) -> v1.ShipRequest:
    """The ShipRequest that stores ``points`` and ``marks`` of ``member`` (run id, attempt,
    index) and says where the collector stands (``progress``)."""
    run_id, attempt, index = member
    restarts, hparams = mark_messages(marks)
    return v1.ShipRequest(
        restarts=restarts,
        hparams=hparams,
        member=v1.MemberRef(run_id=run_id, attempt=attempt, member_index=index),
        columns=columns(points),
        progress=v1.CollectorProgress(
            spool_points=progress.spool_points,
            backpressure=progress.backpressure,
            member_exited=progress.member_exited,
            drained=progress.drained,
            warnings=progress.warnings,
            data_loss_warnings=progress.data_loss_warnings,
        ),
    )


def warm_messages() -> None:
    """Encode a ShipRequest of every kind of field and decode a ShipReply once, so a collector
    forked from the template (collector/template.py) inherits betterproto's per-class metadata
    (type hints, defaults, field tables) instead of building it again at its first ship."""
    point = SpooledPoint(1, "source", 0, 0, "tag", 1, 1.0, 0.5)
    marks: list[Mark] = [
        RestartMark("s", "source", 0, 1, ("tag",), 1.0),
        HParamsMark("s", "source", 0, 0, (("lr", "0.1"),), ("tag",)),
    ]
    request = ship_request(("run", 1, 0), [point], Progress(1, False, False, False, 0, 0), marks)
    v1.ShipRequest().parse(bytes(request))
    reply = v1.ShipReply(stored=1, refused=[v1.RefusedPoint(index=0, reason="r")])
    v1.ShipReply().parse(bytes(reply))


def mark_messages(marks: Sequence[Mark]) -> tuple[list[v1.RestartMark], list[v1.HParamsMark]]:
    """``marks`` as the ``restarts`` and ``hparams`` of a ShipRequest."""
    restarts: list[v1.RestartMark] = []
    hparams: list[v1.HParamsMark] = []
    for m in marks:
        if isinstance(m, RestartMark):
            restarts.append(
                v1.RestartMark(
                    source_id=m.source_id,
                    offset=m.offset,
                    step=m.step,
                    all_tags=m.tags is None,
                    tags=list(m.tags or ()),
                    has_wall_time=m.wall_time is not None,
                    wall_time=m.wall_time or 0.0,
                )
            )
        elif isinstance(m, HParamsMark):
            hparams.append(
                v1.HParamsMark(
                    source_id=m.source_id,
                    offset=m.offset,
                    index=m.index,
                    hparams=[v1.HParam(name=n, value_json=v) for n, v in m.hparams],
                    metrics=list(m.metrics),
                )
            )
    return restarts, hparams


class TelemetryClient:
    """Ships batches for one member to any of its gateways (``gateways``: the Commit's
    telemetry address, then its fallbacks). Use inside :func:`open_telemetry_client`."""

    def __init__(
        self,
        channels: Sequence[Channel],
        gateways: Sequence[Gateway],
        ca_path: Path,
        credential_file: Path,
    ) -> None:
        self._channels = tuple(channels)
        self.gateways = tuple(gateways)
        self._ca_path = ca_path
        self._credential_file = credential_file

    async def ship(
        self,
        member: tuple[str, int, int],
        points: Sequence[SpooledPoint],
        progress: Progress,
        marks: Sequence[Mark] = (),
        at: int = 0,
    ) -> v1.ShipReply:
        """Store ``points`` and ``marks`` through ``gateways[at]``; returns only once that
        gateway acknowledged them durably."""
        try:
            token = read_credential(self._credential_file)
        except CollectorConfigError as exc:
            raise ShipFailed(str(exc)) from None
        request = ship_request(member, points, progress, marks)
        stub = v1.TelemetryStub(
            self._channels[at], metadata={"authorization": f"Bearer {token}"}, timeout=DEADLINE_S
        )
        try:
            # Trio's own limit backs up the gRPC deadline if the connection hangs in TLS.
            with trio.fail_after(DEADLINE_S + 2):
                reply: v1.ShipReply = await trio_asyncio.aio_as_trio(stub.ship)(request)
        except CALL_ERRORS as exc:
            failure = classify(exc)
            text = failure.sentence(
                f"the telemetry gateway at {self.gateways[at]}",
                "Ship",
                DEADLINE_S,
                self._ca_path,
                "Pass the coordinator's tls/ca.pem with --ca",
                "that --gateway names the coordinator's telemetry listener",
            )
            raise ShipFailed(text, refused=failure.kind is Kind.REFUSED) from None
        return reply


def refusals(reply: v1.ShipReply) -> list[ReadWarning]:
    """The points the gateway refused for good, as data-loss warnings naming file and offset."""
    return [
        ReadWarning(storable(r.source_id), r.offset, GATEWAY_REFUSED_KIND, storable(r.reason))
        for r in reply.refused
    ]


async def _aio_channel(gateway: Gateway, ctx: ssl.SSLContext) -> Channel:
    return Channel(gateway.host, gateway.port, ssl=ctx)


@asynccontextmanager
async def open_telemetry_client(
    gateway: Gateway, ca_path: Path, credential_file: Path, fallbacks: Sequence[Gateway] = ()
) -> AsyncIterator[TelemetryClient]:
    """Host asyncio for grpclib inside this Trio run and open one channel per gateway
    (``gateway``, then ``fallbacks``) for the block; each connects when first called."""
    ctx = tls_context(ca_path)
    gateways = (gateway, *fallbacks)
    async with trio_asyncio.open_loop():
        channels: list[Channel] = []
        try:
            for each in gateways:
                channels.append(await trio_asyncio.aio_as_trio(_aio_channel)(each, ctx))
            yield TelemetryClient(channels, gateways, ca_path, credential_file)
        finally:
            for channel in channels:
                channel.close()
