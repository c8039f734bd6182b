"""What every layer of the ``tuneplane-node run`` daemon builds on: its state, the status file
it keeps writing, and this Node's address.

Rules: :class:`DaemonBase` starts nothing; the daemon's one nursery (daemon.py) owns every task
the layers run. What one layer reads or sets of another's is public here; a layer's own helpers
stay private to its module.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import trio

from tuneplane.collector.defaults import DEFAULT_MAX_FILES, SYSTEM_INTERVAL_S
from tuneplane.proto.contract import control_protocol

from . import messages as m
from . import prepare
from .atomic_file import write_json_atomic
from .collectors import CollectorSupervisor
from .config import WorkloadPolicy
from .daemon_status import Status, inventory_summary
from .image_access import RegistryAccess
from .image_store import default_image_root
from .inventory_source import InventorySource
from .journal import Journal
from .logship import LogShipper
from .members import MemberManager
from .members_base import now_ms
from .outputs_server import Bound as OutputsBound
from .session import ControlSession
from .state_dir import NodeConfig, StateDir
from .wire import Endpoint
from .wire_control import ControlStream

AGENT_VERSION = control_protocol.release()
INVENTORY_INTERVAL_S = 30.0
STATUS_INTERVAL_S = 1.0
#: How often a reconnect backoff looks for a credential replaced by a re-enrolment.
CREDENTIAL_POLL_S = 0.5
COMMAND_QUEUE = 256


class DaemonBase:
    """What every layer of the daemon shares: its configuration, the current inventory and
    status, the journal and member manager once open, and the control session's state.

    The bottom layer of :class:`~tuneplane.agent.daemon.Daemon` (daemon.py composes the layers:
    inventory, session). What a layer reads or sets of another's is public here.
    """

    def __init__(
        self,
        state: StateDir,
        node: NodeConfig,
        credential: str,
        source: InventorySource,
        out_root: Path,
        *,
        work_root: Path,
        policy: WorkloadPolicy,
        inventory_interval_s: float = INVENTORY_INTERVAL_S,
        system_interval_s: float = SYSTEM_INTERVAL_S,
        telemetry_max_files: int = DEFAULT_MAX_FILES,
        outputs: OutputsBound | None = None,
        registries: Mapping[str, RegistryAccess] | None = None,
        image_root: Path | None = None,
        image_max_bytes: int | None = None,
    ) -> None:
        self.state = state
        self.node = node
        self.credential = credential
        self.source = source
        self.out_root = out_root
        self.work_root = work_root
        self.policy = policy
        self.inventory_interval_s = inventory_interval_s
        # Seconds between each member's GPU and process samples (node.toml [telemetry]).
        self.system_interval_s = system_interval_s
        # The most telemetry files one member's collector follows (node.toml [telemetry]).
        self.telemetry_max_files = telemetry_max_files
        # The outputs listener's bound socket (None: node.toml turns it off).
        self.outputs = outputs
        # How this Node reaches the registries runtime images come from (node.toml).
        self.registries = dict(registries or {})
        # Where runtime images are cached, beside the state dir (agent/members_base.py), and
        # node.toml's [images] max_size (None: no limit).
        self.image_root = image_root or default_image_root(state.root)
        self.image_max_bytes = image_max_bytes
        self.inventory_lock = trio.Lock()
        self.endpoint = Endpoint.parse(node.coordinator)
        self.ca_path = Path(node.ca)
        # A hung NVML at start-up reads "NVML unresponsive" instead of holding the agent.
        self.inventory = source.collect_within()
        self.status = Status(os.getpid(), node.node_id, node.coordinator, now_ms())
        self.status.agent_version = AGENT_VERSION
        self.status.protocol = control_protocol.PROTOCOL
        self.status.inventory = inventory_summary(self.inventory)
        self.status.work_root, self.status.out_root = str(work_root), str(out_root)
        self.status.image_root = str(self.image_root)
        if outputs is not None:
            self.status.outputs_listen = outputs.listen_address()
        self.journal: Journal | None = None
        self.manager: MemberManager | None = None
        self.logship: LogShipper | None = None
        self.collectors: CollectorSupervisor | None = None
        self.session: ControlSession | None = None
        self.stream: ControlStream | None = None
        self.wake = trio.Event()
        self.welcomed = False
        # Called after each status.json write (status_loop): cheap, synchronous, never raising.
        self.status_watchers: list[Callable[[], None]] = []
        # Where this Node renews in each credential's window: fixed per process, so a Fleet
        # spreads out and one Node does not wander.
        self.renewal_jitter = random.random()
        self.commands_send, self.commands_recv = trio.open_memory_channel[m.MemberCommand](
            COMMAND_QUEUE
        )
        # Set once the journal is replayed and live members re-attached (or safe mode entered),
        # right before the first connect: what READY=1 to systemd waits for (run_daemon).
        self.ready = trio.Event()

    def node_address(self) -> str:
        """This Node's own address, as seen on the route to the coordinator it dials."""
        return prepare.node_address(self.endpoint.host, self.endpoint.port)

    async def status_loop(self) -> None:
        """Write status.json every second while the daemon runs, then call each of
        :attr:`status_watchers` (the one loop that looks at the status every second)."""
        while True:
            self.write_status()
            for watcher in self.status_watchers:
                watcher()
            await trio.sleep(STATUS_INTERVAL_S)

    def write_status(self) -> None:
        """Write status.json now (atomically), stamped with the time."""
        data = attrs.asdict(self.status)
        data["updated_at_ms"] = now_ms()
        write_json_atomic(self.state.status_path, data)
