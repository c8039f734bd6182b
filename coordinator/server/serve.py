"""``serve``: the coordinator process - its listeners' sockets, its signals, and when it leads.

Rules:
- The three listeners' ports (and the console's, ``[console]``) are bound before anything else
  (a taken port stops ``serve`` with one sentence, nothing changed), but accept only while this
  coordinator leads (:mod:`.lead`); until then a connection is refused at once, which turns
  Nodes, collectors and ``tp`` to the leader.
- On SQLite the coordinator leads from the start. On PostgreSQL it stands by until it takes the
  lease (:mod:`.leadership`), leads until it loses it, and stands by again.
- One anyio task group owns the signal watcher, systemd's watchdog and the round being run;
  SIGTERM or SIGINT cancels it: a leader closes its Node sessions and stores and resigns its
  lease (a standby takes over at its next poll), a standby just leaves.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

import anyio
import attrs

from tuneplane.agent.host_port import join_host_port
from tuneplane.agent.metrics_listener import (
    MetricsListenError,
    RunningListener,
    start_listener,
)
from tuneplane.agent.sd_notify import ServiceNotifier
from tuneplane.proto.contract import control_protocol

from ..config import ConsoleSettings, CoordinatorConfig, load_config, store_setting
from ..counters import REGISTRY
from ..store.handle import StoreUnavailable
from ..store.lease import CoordinatorFacts, LeaseDesk
from ..store_location import PostgresUrl
from .advertise import (
    Advertised,
    AdvertiseError,
    hosts,
    judge,
    look_up_all,
    plan,
)
from .coordinator_id import coordinator_id
from .lead import Lease, Setting, lead
from .leader_metrics import watch_leadership
from .leadership import Leadership, LeaderView, Peers
from .serve_error import ServeError as ServeError
from .serve_lock import serving
from .state_dir import require_initialised
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


def _bind(name: str, host: str, port: int, fix: str = "") -> socket.socket:
    """A bound socket for listener ``name``, not yet listening: until the leader listens on it
    (:func:`~tuneplane.coordinator.server.lead.lead`) a connection to it is refused at once,
    which is how a standby turns clients to the leader. Port 0 lets the kernel pick a free
    port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio and grpclib turn Nagle off only on sockets whose proto is
    # IPPROTO_TCP, and accepted sockets copy it. With Nagle on, every reply waited for the
    # client's delayed ACK (about 40 ms per unary call).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fix = fix or f"--{name}-port (0 picks a free port)"
        raise ServeError(
            f"The {name} listener cannot listen on {host}:{port} ({exc.strerror}). Change "
            f"{fix} or stop the process that holds it."
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


def _bind_all(
    host: str, ports: dict[str, int], console: ConsoleSettings | None
) -> dict[str, socket.socket]:
    """Bind all three listeners (and the console's, when configured) before anything else
    happens, so a taken port stops ``serve`` with one sentence and nothing changed (no store
    touched, no endpoints published)."""
    socks: dict[str, socket.socket] = {}
    try:
        for name in ("api", "telemetry", "control"):
            socks[name] = _bind(name, host, ports[name])
        if console is not None:
            socks["console"] = _bind(
                "console",
                console.host,
                ports.get("console", console.port),
                "[console] listen in coordinator.toml (port 0 picks a free port)",
            )
    except ServeError:
        _close(socks)
        raise
    return socks


def _close(socks: dict[str, socket.socket]) -> None:
    for sock in socks.values():
        sock.close()  # already closed by its server when it ran; a no-op then


async def _advertise(
    opts: ServeOptions,
    config: CoordinatorConfig,
    socks: dict[str, socket.socket],
    tls_paths: TlsPaths,
) -> Advertised:
    """The addresses serve hands out, checked against what this machine holds and covered by
    the server certificate (coordinator/server/advertise.py); :class:`ServeError` when they cannot
    be."""
    ports = {name: socks[name].getsockname()[1] for name in ("api", "telemetry", "control")}
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
    ports = {"api": opts.api_port, "telemetry": opts.telemetry_port, "control": opts.control_port}
    socks = _bind_all(opts.host, ports, config.console)
    exporter: RunningListener | None = None
    view = LeaderView(me="")
    try:
        # Before the TLS context is loaded: a dev certificate may be reissued to cover them.
        advertised = await _advertise(opts, config, socks, tls_paths)
        ports = {name: sock.getsockname()[1] for name, sock in socks.items()}
        ctx = server_context(tls_paths)
        console_ctx, console_address = None, ""
        if config.console is not None:
            console_ctx = server_context(tls_paths, ("http/1.1",))
            port = socks["console"].getsockname()[1]
            console_address = f"https://{join_host_port(config.console.host, port)}"
        exporter = _start_metrics(config)
        watch_leadership(view)
        setting = Setting(
            state_dir, opts.host, opts.heartbeat_interval_s, opts.heartbeat_timeout_s,
            opts.prepare_timeout_s, config, url, tls_paths, advertised, ctx, exporter, notifier,
            Peers(), console_ctx, console_address,
        )  # fmt: skip
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, tg.cancel_scope, notifier)
            tg.start_soon(notifier.keep_watchdog)
            if url is None:
                view.role = "single"
                await lead(setting, socks, None)
            else:
                await _stand_by_and_lead(setting, socks, ports, view)
            tg.cancel_scope.cancel()
    finally:
        _close(socks)
        with anyio.CancelScope(shield=True):
            if exporter is not None:
                # shutdown() waits for the server thread's poll loop: off the event loop.
                await anyio.to_thread.run_sync(exporter.close)
        log.info("coordinator stopped state_dir=%s", state_dir)


async def _stand_by_and_lead(
    setting: Setting,
    socks: dict[str, socket.socket] | None,
    ports: dict[str, int],
    view: LeaderView,
) -> None:
    """Coordinators sharing a PostgreSQL store: stand by until this one takes the lease, lead
    until it loses it, stand by again; until cancelled."""
    assert setting.url is not None
    advertised = setting.advertised
    facts = CoordinatorFacts(
        id=coordinator_id(setting.state_dir),
        host=socket.gethostname(),
        pid=os.getpid(),
        version=control_protocol.release(),
        api_address=advertised.api,
        control_address=advertised.control,
        telemetry_address=advertised.telemetry,
        metrics_address=setting.exporter.address if setting.exporter is not None else "",
    )
    view.me = facts.id
    first = True
    said = ""
    while True:
        try:
            desk = await LeaseDesk.open(setting.url)
        except StoreUnavailable as exc:
            if first:
                raise ServeError(str(exc)[:1].upper() + str(exc)[1:]) from None
            if str(exc) != said:  # once per cause, not once per poll
                log.warning("store unreachable; standing by reason=%s", exc)
                said = str(exc)
            await anyio.sleep(setting.config.leader.poll_s)
            continue
        said = ""
        try:
            await desk.register(facts)
            first = False
            leadership = Leadership(desk, facts, setting.config.leader, view, setting.peers)
            setting.notifier.ready(f"standing by: another coordinator leads ({facts.id})")
            won = await leadership.campaign()
            leadership.took(won)
            await leadership.roll_call()  # the lists handed out name every coordinator
            log.info("took the lease over; leading now me=%s term=%d from=%s why=%s", facts.id,
                     won.term, won.previous or "-", won.why)  # fmt: skip
            socks = socks or _bind_all(setting.host, ports, setting.config.console)
            why = await lead(setting, socks, Lease(leadership, won))
            socks = None  # closed by their servers; the next round binds them again
            view.role = "standby"
            log.warning("stepped down; standing by me=%s term=%d why=%s", facts.id, won.term, why)
        except StoreUnavailable as exc:
            log.warning("lease connection lost; standing by again reason=%s", exc)
        finally:
            with anyio.CancelScope(shield=True):
                await desk.close()
