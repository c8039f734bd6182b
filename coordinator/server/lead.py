"""What a leading coordinator runs: its stores, gateways, listeners, scheduler and flushers.

Rules:
- :func:`lead` runs from the moment this coordinator leads (at once on SQLite; on PostgreSQL
  once it took the lease, :mod:`.leadership`) until it is cancelled or loses the lease. One
  anyio task group owns everything long-lived: a task per listener, the scheduler, the heartbeat
  flusher, the lease's renewal.
- On PostgreSQL every store is fenced with the lease's term before anything is written; the
  first write is the takeover's decision. A write that meets another term (fenced), or a renewal
  that fails, ends the round: Node sessions are closed, the stores closed, the listeners closed,
  and ``serve`` stands by again.
- Leaving (cancelled, or the lease lost): Node sessions are closed (and their Nodes recorded
  disconnected), the last heartbeats stored, then the stores close; a clean stop then resigns
  the lease so a standby takes over at its next poll.
- ``endpoints.json`` and ``tp-context.json`` appear only after all three listeners (and the
  console's, when configured) accept, and go when the round ends.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import anyio
import attrs

from tuneplane.agent.metrics_listener import RunningListener
from tuneplane.agent.sd_notify import ServiceNotifier

from ..api.control_address import ControlAddressApi
from ..api.fleet import FleetService
from ..api.identity import IdentityApi
from ..api.job_watch import JobWatchApi
from ..api.jobs import ApiService
from ..api.lifecycle import LifecycleApi
from ..api.metrics import MetricsApi
from ..api.node_loss import MaxDisconnectWatch, NodeLossApi, NodeLossDesk
from ..catalogue import Catalogue
from ..clock import now_ms
from ..config import CoordinatorConfig
from ..console import ConsoleReads, console_app, run_console
from ..console.sessions import SessionBook
from ..gateways.collector_credentials import CollectorCredentials
from ..gateways.control import ControlGateway
from ..gateways.control_address import ControlAddressDesk
from ..gateways.heartbeats import HeartbeatBook, HeartbeatFlusher
from ..gateways.rate_limit import PeerRateLimit
from ..gateways.sessions import SessionRegistry
from ..gateways.telemetry import TelemetryGateway
from ..hello_gate import GateSettings
from ..job_changes import JobChanges
from ..preparations import PreparationBook
from ..store.core import Store
from ..store.handle import Fenced, StoreError, StoreUnavailable
from ..store.leadership_log import record_takeover
from ..store.logs import DB_NAME as LOGS_DB
from ..store.logs import LogStore
from ..store.telemetry import DB_NAME as TELEMETRY_DB
from ..store.telemetry import TelemetryStore
from ..store_location import PostgresUrl, store_where
from .advertise import Advertised
from .leadership import Leadership, Peers, Won
from .listeners import LISTEN_BACKLOG, bounded, run_listener
from .metrics_export import count_store_retry, refresh_gauges
from .scheduler import Scheduler
from .slurm_executor import SlurmExecutor
from .state_dir import Endpoints, coordinator_where, publish, withdraw
from .tls import TlsPaths

log = logging.getLogger(__name__)

#: How long a coordinator stepping down waits for its Node sessions to close.
STEP_DOWN_S = 3.0


@attrs.frozen
class Setting:
    """Everything a round of leading needs that ``serve`` set up once."""

    state_dir: Path
    host: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    prepare_timeout_s: float
    config: CoordinatorConfig
    url: PostgresUrl | None
    tls_paths: TlsPaths
    advertised: Advertised
    ctx: ssl.SSLContext
    exporter: RunningListener | None
    notifier: ServiceNotifier
    peers: Peers
    # The console's TLS context (ALPN http/1.1); None: [console] is off.
    console_ctx: ssl.SSLContext | None = None
    # Where the console listens, https://HOST:PORT ("" when off); published once it accepts.
    console_address: str = ""


@attrs.frozen
class Lease:
    """The lease a round runs under (PostgreSQL only)."""

    leadership: Leadership
    won: Won


def admission_listener(scheduler: Scheduler, slurm: SlurmExecutor) -> Callable[[str, str], None]:
    """What the API calls with a newly admitted Job's run id and its Fleet's backend: the Node
    scheduler plans the Job (its pass reads only Jobs of Node Fleets); the Slurm executor is
    woken only for a Job on a Slurm Fleet, since a pass for any other read its queue and found
    nothing (two reads and a wake-up per admission, issue 13)."""

    def admitted(run_id: str, backend: str) -> None:
        scheduler.admitted(run_id)
        if backend == "slurm":
            slurm.wake()

    return admitted


async def lead(setting: Setting, socks: dict[str, socket.socket], lease: Lease | None) -> str:
    """Lead until cancelled (returns ""), or until the lease is lost (returns why)."""
    lost: list[str] = []
    try:
        await _lead(setting, socks, lease, lost)
    except* Fenced as group:
        lost.append(str(group.exceptions[0]))
    return lost[0] if lost else ""


async def _lead(
    setting: Setting,
    socks: dict[str, socket.socket],
    lease: Lease | None,
    lost: list[str],
) -> None:
    state_dir, url = setting.state_dir, setting.url
    store = await Store.open(coordinator_where(state_dir, url))
    store.retry_observers.append(count_store_retry)
    telemetry_store: TelemetryStore | None = None
    log_store: LogStore | None = None
    scope = anyio.CancelScope()

    def step_down(why: str, reachable: bool = True) -> None:
        if not lost:
            lost.append(why)
        scope.cancel()
        if not reachable:
            # Cut off from the database: writes in flight (a Node session's last record, say)
            # would each wait on a dead link and hold the listeners open.
            for opened in (store, telemetry_store, log_store):
                if opened is not None:
                    opened.cut_off()

    try:
        telemetry_store = await TelemetryStore.open(store_where(state_dir, url, TELEMETRY_DB))
        telemetry_store.retry_observers.append(count_store_retry)
        log_store = await LogStore.open(store_where(state_dir, url, LOGS_DB))
        log_store.retry_observers.append(count_store_retry)
        if lease is not None:
            for fenced in (store, telemetry_store, log_store):
                fenced.fence(
                    lease.won.term,
                    lambda: step_down("a write found another coordinator's term"),
                    lease.leadership.settings.ttl_s,
                )
            await record_takeover(store, lease.won, lease.leadership.facts.id, now_ms())
        with scope:
            await _run(setting, socks, lease, store, telemetry_store, log_store, step_down, lost)
    finally:
        with anyio.CancelScope(shield=True):
            # Stepping down, the database may be out of reach too: drop the connections.
            for opened in (telemetry_store, log_store, store):
                if opened is not None:
                    await (opened.abandon() if lost else opened.close())
            withdraw(state_dir, os.getpid())
            if lease is not None and not lost:
                await _resign(lease)


async def _resign(lease: Lease) -> None:
    facts, term = lease.leadership.facts, lease.won.term
    try:
        if await lease.leadership.desk.resign(facts.id, term):
            log.info("lease resigned; a standby takes over at its next poll term=%d", term)
    except StoreError as exc:
        log.warning("lease not resigned; a standby takes over when it expires reason=%s", exc)


async def _run(
    setting: Setting,
    socks: dict[str, socket.socket],
    lease: Lease | None,
    store: Store,
    telemetry_store: TelemetryStore,
    log_store: LogStore,
    step_down: Callable[[str, bool], None],
    lost: list[str],
) -> None:
    config, advertised, tls_paths = setting.config, setting.advertised, setting.tls_paths
    catalogue = Catalogue.bundled()
    collectors = CollectorCredentials(telemetry_store)
    await store.mark_all_disconnected(now_ms())
    registry = SessionRegistry()
    scheduler = Scheduler(
        store,
        registry,
        catalogue,
        setting.prepare_timeout_s,
        quotas=config.quotas,
        loader_env_runtimes=config.loader_env_runtimes,
    )
    slurm = SlurmExecutor(store, catalogue, log_store, collectors, tls_paths.ca_cert)

    admitted = admission_listener(scheduler, slurm)

    def wake_both() -> None:
        scheduler.wake()
        slurm.wake()

    preparations = PreparationBook()
    api = ApiService(store, config, catalogue, admitted, log_store, preparations)
    # Every Job is written in this process: its committed changes wake the WatchJob streams.
    changes = JobChanges(config.limits.job_watches)
    store.commit_observers.append(changes.changed)
    watches = JobWatchApi(store, api.job_view, changes, config.limits.job_watch_fallback_s)
    addresses = ControlAddressDesk(store, registry, tls_paths.server_cert)
    await addresses.load()
    heartbeats = HeartbeatBook()
    flusher = HeartbeatFlusher(heartbeats, store, setting.heartbeat_interval_s, collectors)
    fleets = FleetService(store, config.quotas, scheduler.wake, heartbeats)
    control = ControlGateway(
        store,
        registry,
        scheduler.wake,
        setting.heartbeat_interval_s,
        setting.heartbeat_timeout_s,
        collectors,
        log_store,
        heartbeats=heartbeats,
        credential_lifetime_s=config.node_credential_lifetime_s,
        enroll_limit=PeerRateLimit(config.limits.enroll_burst, config.limits.enroll_per_second),
        addresses=addresses,
        preparations=preparations,
        gate=GateSettings(
            config.limits.connects_at_once,
            config.limits.connect_wait_s,
            max_queue_s=config.limits.connect_queue_s,
        ),
    )
    identity = IdentityApi(store, registry)
    address_api = ControlAddressApi(store, addresses)
    lifecycle = LifecycleApi(store, log_store, registry, wake_both)
    loss_desk = NodeLossDesk(store, registry, scheduler.wake, collectors)
    node_loss = NodeLossApi(store, loss_desk)
    loss_watch = MaxDisconnectWatch(store, registry, loss_desk, config.fleets)
    telemetry = TelemetryGateway(store, collectors)
    metrics = MetricsApi(store, telemetry_store)
    host, ctx = setting.host, setting.ctx
    api_services = [api, watches, fleets, metrics, lifecycle, identity, node_loss, address_api]
    async with anyio.create_task_group() as tg:
        try:
            if lease is not None:
                tg.start_soon(lease.leadership.keep, lease.won, step_down)
            for sock in socks.values():
                sock.listen(LISTEN_BACKLOG)  # bound since serve started; accepting from now on
            await tg.start(
                run_listener, "api", bounded("api", api_services, config.limits), host,
                socks["api"], ctx,
            )  # fmt: skip
            # Telemetry before control: every Commit a Node receives names the gateway,
            # at its advertised address (never the bind address: 0.0.0.0 reaches nobody).
            await tg.start(
                run_listener, "telemetry", bounded("telemetry", [telemetry], config.limits),
                host, socks["telemetry"], ctx,
            )  # fmt: skip
            collectors.telemetry_address = advertised.telemetry
            _share_peers(setting, collectors, addresses)
            await tg.start(
                run_listener, "control", bounded("control", [control], config.limits), host,
                socks["control"], ctx,
            )  # fmt: skip
            if setting.console_ctx is not None and config.console is not None:
                reads = ConsoleReads(store, telemetry_store, fleets, lifecycle, config.quotas)
                app, console = console_app(
                    reads,
                    SessionBook(config.console.session_lifetime_s * 1000),
                    config.console.max_streams,
                )
                await tg.start(
                    run_console, app, console, config.console.host, socks["console"],
                    setting.console_ctx,
                )  # fmt: skip
            tg.start_soon(scheduler.run)
            tg.start_soon(slurm.run)
            if setting.exporter is not None:
                tg.start_soon(refresh_gauges, store)
            tg.start_soon(flusher.run)
            tg.start_soon(loss_watch.run)
            _announce(setting)
            if lease is not None:

                def peers_changed() -> None:
                    _share_peers(setting, collectors, addresses)
                    _publish(setting)
                    log.info("coordinators changed; addresses republished api=%s",
                             ",".join(setting.peers.api))  # fmt: skip

                lease.leadership.on_peers = peers_changed
            await anyio.sleep_forever()
        finally:
            # A stop waits for every session's bookkeeping; stepping down (the lease lost, the
            # database perhaps out of reach, every write refused anyway) waits a bounded time.
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(STEP_DOWN_S if lost else math.inf),
            ):
                await registry.close_all()
                # Every session is closed: no heartbeat arrives after this last batch.
                try:
                    await flusher.flush()
                except (Fenced, StoreUnavailable) as exc:
                    log.warning("last heartbeats not stored reason=%s", exc)


def _share_peers(
    setting: Setting, collectors: CollectorCredentials, addresses: ControlAddressDesk
) -> None:
    """Hand every coordinator's addresses out from now on: the control addresses in every
    Welcome, the other telemetry gateways in every Commit."""
    own = setting.advertised.telemetry
    collectors.telemetry_fallbacks = tuple(a for a in setting.peers.telemetry if a != own)
    control = setting.peers.control
    addresses.share_coordinators(control if len(control) > 1 else ())


def _publish(setting: Setting) -> None:
    """Write endpoints.json and tp-context.json, naming every coordinator's API address."""
    advertised, exporter = setting.advertised, setting.exporter
    publish(
        setting.state_dir,
        Endpoints(
            api=advertised.api,
            control=advertised.control,
            telemetry=advertised.telemetry,
            ca=str(setting.tls_paths.ca_cert),
            pid=os.getpid(),
            metrics=exporter.address if exporter is not None else "",
            api_addresses=setting.peers.api or (advertised.api,),
            console=setting.console_address,
        ),
    )


def _announce(setting: Setting) -> None:
    """Publish the endpoints and tell systemd and the log that this coordinator serves."""
    advertised = setting.advertised
    _publish(setting)
    log.info(
        "coordinator ready api=%s control=%s telemetry=%s console=%s state_dir=%s store=%s",
        advertised.api,
        advertised.control,
        advertised.telemetry,
        setting.console_address or "-",
        setting.state_dir,
        setting.url or "sqlite",
    )
    # Every listener accepts and the store is open: systemd may start what needs us.
    setting.notifier.ready(
        f"serving api={advertised.api} control={advertised.control} "
        f"telemetry={advertised.telemetry}"
    )
