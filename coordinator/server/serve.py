"""``serve``: the coordinator process - three TLS listeners, the scheduler and the Node sessions.

Rules:
- One anyio task group owns everything long-lived: a task per listener, the scheduler, the
  heartbeat flusher, the signal watcher. SIGTERM or SIGINT cancels the group; Node sessions are
  closed (and their Nodes recorded disconnected), the last heartbeats stored, then the store closes.
- ``endpoints.json`` and ``tp-context.json`` appear only after all three listeners accept.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

import anyio
import attrs

from tuneplane.agent.metrics_listener import (
    MetricsListenError,
    RunningListener,
    start_listener,
)
from tuneplane.agent.sd_notify import ServiceNotifier

from ..api.control_address import ControlAddressApi
from ..api.fleet import FleetService
from ..api.identity import IdentityApi
from ..api.jobs import ApiService
from ..api.lifecycle import LifecycleApi
from ..api.metrics import MetricsApi
from ..api.node_loss import MaxDisconnectWatch, NodeLossApi, NodeLossDesk
from ..catalogue import Catalogue
from ..clock import now_ms
from ..config import CoordinatorConfig, load_config, store_setting
from ..counters import REGISTRY
from ..gateways.collector_credentials import CollectorCredentials
from ..gateways.control import ControlGateway
from ..gateways.control_address import ControlAddressDesk
from ..gateways.heartbeats import HeartbeatBook, HeartbeatFlusher
from ..gateways.rate_limit import PeerRateLimit
from ..gateways.sessions import SessionRegistry
from ..gateways.telemetry import TelemetryGateway
from ..store.core import Store
from ..store.logs import DB_NAME as LOGS_DB
from ..store.logs import LogStore
from ..store.telemetry import DB_NAME as TELEMETRY_DB
from ..store.telemetry import TelemetryStore
from ..store_location import PostgresUrl, store_where
from .advertise import (
    Advertised,
    AdvertiseError,
    hosts,
    judge,
    look_up_all,
    plan,
)
from .listeners import bounded, run_listener
from .metrics_export import count_store_retry, refresh_gauges
from .scheduler import Scheduler
from .serve_lock import serving
from .state_dir import (
    Endpoints,
    coordinator_where,
    publish,
    require_initialised,
    withdraw,
)
from .tls import TlsError, TlsPaths, cover_names, server_context

log = logging.getLogger(__name__)

# Fixed, documented defaults (docs/operator.md): a Node remembers the control address it
# enrolled with, so a restart on other ports would strand every Node. Port 0 still means "let the
# kernel pick a free one" (what the tests use so parallel runs never collide).
DEFAULT_API_PORT = 7443
DEFAULT_CONTROL_PORT = 7444
DEFAULT_TELEMETRY_PORT = 7445


@attrs.frozen
class ServeOptions:
    state_dir: Path
    host: str = "127.0.0.1"
    api_port: int = DEFAULT_API_PORT
    control_port: int = DEFAULT_CONTROL_PORT
    telemetry_port: int = DEFAULT_TELEMETRY_PORT
    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 15.0
    prepare_timeout_s: float = 120.0
    # ``--advertise``: the host every listener is advertised at, over [addresses] host ("").
    advertise: str = ""
    # ``--store``: the PostgreSQL database for this run, over [store] url (None: as configured).
    store_url: PostgresUrl | None = None


class ServeError(RuntimeError):
    """``serve`` cannot start; ``str()`` says why and what to do."""


def _listen(name: str, host: str, port: int) -> socket.socket:
    """A bound, listening socket for listener ``name``; port 0 lets the kernel pick a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio and grpclib turn Nagle off only on sockets whose proto is
    # IPPROTO_TCP, and accepted sockets copy it. With Nagle on, every reply waited for the
    # client's delayed ACK (about 40 ms per unary call).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"The {name} listener cannot listen on {host}:{port} ({exc.strerror}). Change "
            f"--{name}-port (0 picks a free port) or stop the process that holds it."
        ) from None
    sock.setblocking(False)
    return sock


def _start_metrics(config: CoordinatorConfig) -> RunningListener | None:
    """The Prometheus listener coordinator.toml's [metrics] asks for (None: off)."""
    if config.metrics is None:
        return None
    try:
        return start_listener(config.metrics, REGISTRY, "[metrics] in coordinator.toml")
    except MetricsListenError as exc:
        raise ServeError(str(exc)) from None


def _listen_all(opts: ServeOptions) -> dict[str, socket.socket]:
    """Bind all three listeners before anything else happens, so a taken port stops ``serve``
    with one sentence and nothing changed (no store touched, no endpoints published)."""
    socks: dict[str, socket.socket] = {}
    try:
        for name, port in (
            ("api", opts.api_port),
            ("telemetry", opts.telemetry_port),
            ("control", opts.control_port),
        ):
            socks[name] = _listen(name, opts.host, port)
    except ServeError:
        for sock in socks.values():
            sock.close()
        raise
    return socks


async def _advertise(
    opts: ServeOptions,
    config: CoordinatorConfig,
    socks: dict[str, socket.socket],
    tls_paths: TlsPaths,
) -> Advertised:
    """The addresses serve hands out, checked against what this machine holds and covered by
    the server certificate (coordinator/server/advertise.py); :class:`ServeError` when they cannot
    be."""
    ports = {name: sock.getsockname()[1] for name, sock in socks.items()}
    try:
        advertised = plan(opts.host, config.addresses.with_host(opts.advertise), ports)
    except AdvertiseError as exc:
        raise ServeError(str(exc)) from None
    # getaddrinfo blocks (DNS): off the event loop.
    facts = await anyio.to_thread.run_sync(look_up_all, hosts(advertised))
    verdict = judge(socks["api"].getsockname()[0], advertised, facts)
    for warning in verdict.warnings:
        log.warning("advertised address doubtful message=%r", warning)
    if verdict.refusals:
        raise ServeError(" ".join(verdict.refusals))
    try:
        added = cover_names(tls_paths, hosts(advertised))
    except TlsError as exc:
        told = str(exc)
        raise ServeError(told[:1].upper() + told[1:]) from None
    if added:
        log.info("server certificate reissued by the dev CA added_names=%s", ",".join(added))
    return advertised


async def _watch_signals(scope: anyio.CancelScope, notifier: ServiceNotifier) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("stop requested signal=%s", signal.Signals(signum).name)
            notifier.stopping("stopping: closing Node sessions and the store")
            scope.cancel()
            return


async def serve(opts: ServeOptions) -> None:
    """Run the coordinator until SIGTERM/SIGINT (or until cancelled)."""
    state_dir = opts.state_dir.absolute()
    # systemd's variables leave the environment before any worker process is started.
    notifier = ServiceNotifier.from_environment()
    require_initialised(state_dir, opts.store_url or store_setting(state_dir))
    # Held from before a store opens until after the last one closed: `migrate-store` refuses
    # to run meanwhile, and this serve refuses to start while it runs
    # (coordinator/server/serve_lock.py).
    with serving(state_dir):
        await _serve(opts, state_dir, notifier)


async def _serve(opts: ServeOptions, state_dir: Path, notifier: ServiceNotifier) -> None:
    config = load_config(state_dir)
    url = opts.store_url or config.store_url
    for warning in config.warnings:
        log.warning("config key ignored message=%r", warning)
    tls_paths = TlsPaths.under(state_dir)
    catalogue = Catalogue.bundled()
    socks = _listen_all(opts)
    exporter: RunningListener | None = None
    try:
        # Before the TLS context is loaded: a dev certificate may be reissued to cover them.
        advertised = await _advertise(opts, config, socks, tls_paths)
        ctx = server_context(tls_paths)
        exporter = _start_metrics(config)
        store = await Store.open(coordinator_where(state_dir, url))
        store.retry_observers.append(count_store_retry)
    except BaseException:
        for sock in socks.values():
            sock.close()
        if exporter is not None:
            exporter.close()
        raise
    telemetry_store: TelemetryStore | None = None
    log_store: LogStore | None = None
    try:
        telemetry_store = await TelemetryStore.open(store_where(state_dir, url, TELEMETRY_DB))
        telemetry_store.retry_observers.append(count_store_retry)
        log_store = await LogStore.open(store_where(state_dir, url, LOGS_DB))
        log_store.retry_observers.append(count_store_retry)
        collectors = CollectorCredentials(telemetry_store)
        await store.mark_all_disconnected(now_ms())
        registry = SessionRegistry()
        scheduler = Scheduler(
            store,
            registry,
            catalogue,
            opts.prepare_timeout_s,
            quotas=config.quotas,
            loader_env_runtimes=config.loader_env_runtimes,
        )
        api = ApiService(store, config, catalogue, scheduler.wake, log_store)
        addresses = ControlAddressDesk(store, registry, tls_paths.server_cert)
        await addresses.load()
        heartbeats = HeartbeatBook()
        flusher = HeartbeatFlusher(heartbeats, store, opts.heartbeat_interval_s, collectors)
        fleets = FleetService(store, config.quotas, scheduler.wake, heartbeats)
        control = ControlGateway(
            store,
            registry,
            scheduler.wake,
            opts.heartbeat_interval_s,
            opts.heartbeat_timeout_s,
            collectors,
            log_store,
            heartbeats=heartbeats,
            credential_lifetime_s=config.node_credential_lifetime_s,
            enroll_limit=PeerRateLimit(config.limits.enroll_burst, config.limits.enroll_per_second),
            addresses=addresses,
        )
        identity = IdentityApi(store, registry)
        address_api = ControlAddressApi(store, addresses)
        lifecycle = LifecycleApi(store, log_store, registry, scheduler.wake)
        loss_desk = NodeLossDesk(store, registry, scheduler.wake, collectors)
        node_loss = NodeLossApi(store, loss_desk)
        loss_watch = MaxDisconnectWatch(store, registry, loss_desk, config.fleets)
        telemetry = TelemetryGateway(store, collectors)
        metrics = MetricsApi(store, telemetry_store)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, tg.cancel_scope, notifier)
            tg.start_soon(notifier.keep_watchdog)
            try:
                await tg.start(
                    run_listener,
                    "api",
                    bounded(
                        "api",
                        [api, fleets, metrics, lifecycle, identity, node_loss, address_api],
                        config.limits,
                    ),
                    opts.host,
                    socks["api"],
                    ctx,
                )
                # Telemetry before control: every Commit a Node receives names the gateway,
                # at its advertised address (never the bind address: 0.0.0.0 reaches nobody).
                await tg.start(
                    run_listener,
                    "telemetry",
                    bounded("telemetry", [telemetry], config.limits),
                    opts.host,
                    socks["telemetry"],
                    ctx,
                )
                collectors.telemetry_address = advertised.telemetry
                await tg.start(
                    run_listener,
                    "control",
                    bounded("control", [control], config.limits),
                    opts.host,
                    socks["control"],
                    ctx,
                )
                api_addr, control_addr = advertised.api, advertised.control
                telemetry_addr = advertised.telemetry
                tg.start_soon(scheduler.run)
                if exporter is not None:
                    tg.start_soon(refresh_gauges, store)
                tg.start_soon(flusher.run)
                tg.start_soon(loss_watch.run)
                publish(
                    state_dir,
                    Endpoints(
                        api=api_addr,
                        control=control_addr,
                        telemetry=telemetry_addr,
                        ca=str(tls_paths.ca_cert),
                        pid=os.getpid(),
                        metrics=exporter.address if exporter is not None else "",
                    ),
                )
                log.info(
                    "coordinator ready api=%s control=%s telemetry=%s state_dir=%s store=%s",
                    api_addr,
                    control_addr,
                    telemetry_addr,
                    state_dir,
                    url or "sqlite",
                )
                # Every listener accepts and the store is open: systemd may start what needs us.
                notifier.ready(f"serving api={api_addr} control={control_addr} "
                               f"telemetry={telemetry_addr}")  # fmt: skip
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await registry.close_all()
                    # Every session is closed: no heartbeat arrives after this last batch.
                    await flusher.flush()
    finally:
        for sock in socks.values():
            sock.close()  # already closed by its server when it ran; a no-op then
        with anyio.CancelScope(shield=True):
            if exporter is not None:
                # shutdown() waits for the server thread's poll loop: off the event loop.
                await anyio.to_thread.run_sync(exporter.close)
            if telemetry_store is not None:
                await telemetry_store.close()
            if log_store is not None:
                await log_store.close()
            await store.close()
            withdraw(state_dir, os.getpid())
        log.info("coordinator stopped state_dir=%s", state_dir)
