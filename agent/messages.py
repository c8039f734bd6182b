"""The control-session messages as the agent's own frozen values (no betterproto here).

Rules: :mod:`tuneplane.agent.wire_convert` converts between these and the generated protobuf
classes; everything else in the agent speaks only these. Times are epoch milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .inventory import Inventory
from .journal_records import MemberKey, PendingReport
from .member_state import MemberState

# --- coordinator -> node ------------------------------------------------------------------------


@attrs.frozen
class Welcome:
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    server_time_ms: int
    # The lifetime of the credential this stream was opened with; 0: none stated (no renewal).
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    # The control address to dial from now on; "" when the coordinator names none.
    control_address: str = ""
    # Every coordinator sharing the store (high availability), the leader first; empty with one.
    coordinators: tuple[str, ...] = ()
    # The coordinator's release, control protocol (0: unversioned, 0.1.x) and capabilities
    # (proto/contract/control_protocol.py).
    coordinator_version: str = ""
    protocol: int = 0
    capabilities: tuple[str, ...] = ()


@attrs.frozen
class HeartbeatAck:
    seq: int


@attrs.frozen
class ReportAck:
    report_seq: int
    refused: str = ""  # the coordinator's sentence when it refused the report (it changed nothing)


@attrs.frozen
class Rendezvous:
    master_addr: str
    master_port: int


@attrs.frozen
class InitFromFetch:
    """Where the Node holding a Derivation's source serves it, and the grant to fetch it with
    (agent/outputs_fetch.py); made by the coordinator when it sent the Prepare."""

    address: str
    cert_sha256: str
    grant: str = attrs.field(repr=False)
    grant_expires_at_ms: int


@attrs.frozen
class Prepare:
    key: MemberKey
    jobspec_json: str
    member_count: int
    gpu_indexes: tuple[int, ...]
    pick_rendezvous: bool
    capsule_digests: Mapping[str, str]
    capsule_files: Mapping[str, bytes]
    # The TunePlane user who submitted the Job ("" from an older coordinator).
    owner: str = ""
    # The UUID of each of gpu_indexes as the coordinator last saw it (() from an older one).
    gpu_uuids: tuple[str, ...] = ()
    # Member 0 (pick_rendezvous): the secret its rendezvous listener proves itself with. Every
    # other member: with ``rendezvous``, what it must reach before it may be prepared
    # (agent/rendezvous.py). "" and None from an older coordinator: nothing is checked.
    rendezvous_nonce: str = attrs.field(default="", repr=False)
    rendezvous: Rendezvous | None = None
    # A Derivation whose source is on another Node's disk: how to fetch it. None when the
    # source is on a shared output root, or when the coordinator knows no way to fetch it.
    init_from_fetch: InitFromFetch | None = None


@attrs.frozen
class Commit:
    key: MemberKey
    rendezvous: Rendezvous | None
    # For the member's collector (agent/collectors.py): empty from a coordinator without one.
    collector_credential: str = ""
    telemetry_address: str = ""
    # The other coordinators' telemetry gateways, tried in order when telemetry_address fails
    # (coordinators sharing one store); () from a single coordinator.
    telemetry_fallbacks: tuple[str, ...] = ()


@attrs.frozen
class Abort:
    key: MemberKey
    reason: str


@attrs.frozen
class Cancel:
    key: MemberKey
    reason: str
    grace_period_s: int
    # The coordinator declared the member lost while this Node was away: its Job no longer waits
    # for it. Stopped like any cancelled member; the journal records the declaration.
    declared_lost: bool = False


@attrs.frozen
class LogAck:
    """The coordinator holds the stream up to ``offset`` (and its end when ``eof``)."""

    key: MemberKey
    stream: str
    offset: int
    eof: bool


@attrs.frozen
class CredentialIssued:
    """A successor control credential, answering :class:`CredentialRenewal` ``request_id``."""

    request_id: int
    credential: str = attrs.field(repr=False)
    issued_at_ms: int
    expires_at_ms: int


@attrs.frozen
class ControlAddress:
    """The control address to dial from now on (agent/control_address.py)."""

    address: str


@attrs.frozen
class Coordinators:
    """The coordinators sharing the store changed (the leader first; empty: one): sent only to
    an agent that announced ``coordinators-update``."""

    addresses: tuple[str, ...]


@attrs.frozen
class Queued:
    """Not a message: the initial metadata of a Connect the coordinator put in line, busy in a
    reconnect storm (``tuneplane-queued``). The Welcome is expected in about ``wait_s``."""

    wait_s: float
    sentence: str


Incoming = (
    Welcome
    | Queued
    | ControlAddress
    | Coordinators
    | HeartbeatAck
    | ReportAck
    | Prepare
    | Commit
    | Abort
    | Cancel
    | LogAck
    | CredentialIssued
)
MemberCommand = Prepare | Commit | Abort | Cancel

# --- node -> coordinator ------------------------------------------------------------------------


@attrs.frozen
class OutputsService:
    """Where this Node serves its ended members' outputs (agent/outputs_server.py)."""

    address: str
    cert_sha256: str
    # Shared with the coordinator only, which signs fetch grants with it.
    grant_key: bytes = attrs.field(repr=False)


@attrs.frozen
class Hello:
    node_id: str
    agent_version: str
    inventory: Inventory
    held: tuple[tuple[MemberKey, MemberState], ...]
    # The control address this stream was dialed at.
    dialed_address: str = ""
    # None when node.toml turns the outputs listener off.
    outputs: OutputsService | None = None
    # The control protocol this agent speaks and what it takes (proto/contract/control_protocol.py).
    protocol: int = 0
    capabilities: tuple[str, ...] = ()


@attrs.frozen
class Heartbeat:
    seq: int
    sent_at_ms: int
    # Only when the inventory changed since the coordinator last saw it.
    inventory: Inventory | None = None


@attrs.frozen
class Report:
    report: PendingReport


@attrs.frozen
class PrepareReply:
    key: MemberKey
    ok: bool
    reason: str
    rendezvous: Rendezvous | None
    # Member 0: a listener on the rendezvous port answers the other members' probes.
    rendezvous_held: bool = False


@attrs.frozen
class PrepareProgress:
    """How far a preparing member's runtime image is (agent/members_image.py): bytes of its
    blobs on disk and layers verified, of all it needs, and the phase (``pulling``,
    ``unpacking``). Sent only to a coordinator that announced ``prepare-progress``."""

    key: MemberKey
    image: str
    bytes_done: int
    bytes_total: int
    layers_done: int
    layers_total: int
    phase: str


@attrs.frozen
class DecisionQuery:
    key: MemberKey


@attrs.frozen
class LogChunk:
    """Bytes of a member's ``stdout.log`` or ``stderr.log`` starting at ``offset``."""

    key: MemberKey
    stream: str
    offset: int
    data: bytes
    eof: bool


@attrs.frozen
class CredentialRenewal:
    """Ask for a successor control credential."""

    request_id: int


@attrs.frozen
class CredentialStored:
    """The successor of ``request_id`` is durably stored and in use: retire the old one."""

    request_id: int


Outgoing = (
    Hello
    | Heartbeat
    | Report
    | PrepareReply
    | PrepareProgress
    | DecisionQuery
    | LogChunk
    | CredentialRenewal
    | CredentialStored
)
