"""What the Node boundary carries: a Node's inventory, the members it says it holds, its member
reports, and the orders the coordinator sends it (Prepare, Commit, Abort, Cancel).

Rules: frozen attrs values only (see :mod:`..values`); :mod:`..wire.control` converts them to
and from the control stream's messages. Secrets (a grant, a grant key, a rendezvous nonce, a
collector credential) are kept out of ``repr``, so a logged value never shows one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import attrs
import cattrs

from tuneplane.proto.contract.derivation_source import ManifestSummary

from .jobs import MemberKey

_CONVERTER = cattrs.Converter(forbid_extra_keys=False)


@attrs.frozen
class Gpu:
    """One GPU as its Node's inventory names it."""

    index: int
    series: str
    healthy: bool
    uuid: str = ""
    name: str = ""
    memory_bytes: int = 0
    mig_enabled: bool = False
    health_reason: str = ""


@attrs.frozen
class Inventory:
    """What a Node says it has: its GPUs (from NVML or a simulation) and the machine around them."""

    hostname: str
    gpus: tuple[Gpu, ...] = ()
    gpu_source: str = "none"
    cpu_count: int = 0
    memory_bytes: int = 0
    driver_version: str = ""
    cuda_version: str = ""

    def to_json(self) -> str:
        return json.dumps(_CONVERTER.unstructure(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        return _CONVERTER.structure(json.loads(text), cls)


@attrs.frozen
class HeldMember:
    """A member a Node says it holds (from Hello), with its last journaled state."""

    member: MemberKey
    state: str


@attrs.frozen
class Report:
    """One MemberReport as the control gateway hands it to the store."""

    report_seq: int
    member: MemberKey
    state: str
    at_ms: int
    reason: str = ""
    has_exit: bool = False
    exit_code: int = 0
    signal: int = 0
    out_dir: str = ""
    journal_id: str = ""  # the Node's journal that numbered it ("" from an older agent)
    # The member's output manifest, on an exit report from a Node that writes them.
    manifest: ManifestSummary | None = None


@attrs.frozen
class OutputsService:
    """Where a Node serves its ended members' outputs to other Nodes, as its Hello said
    (checked by :func:`tuneplane.coordinator.gateways.outputs_grants.check_service` before it is
    stored)."""

    address: str
    cert_sha256: str
    grant_key: bytes = attrs.field(repr=False)


@attrs.frozen
class InitFromFetch:
    """Where a Prepare's Derivation source is fetched from and the grant that lets the Node
    fetch it (made just before the Prepare is sent, :mod:`..outputs_grants`; never stored)."""

    address: str
    cert_sha256: str
    grant: str = attrs.field(repr=False)
    grant_expires_at_ms: int = 0


@attrs.frozen
class PrepareOrder:
    node_id: str
    member: MemberKey
    jobspec_json: str
    member_count: int
    gpu_indexes: tuple[int, ...]
    pick_rendezvous: bool
    capsule_files: Mapping[str, str]
    owner: str = ""
    # The UUIDs of gpu_indexes as the Node's inventory named them at placement ("" where it
    # named none); the Node refuses the Prepare when its GPU at an index has another UUID now.
    gpu_uuids: tuple[str, ...] = ()
    # The attempt's rendezvous nonce (member 0's listener proves itself with it), and for every
    # other member the rendezvous it must reach before it is prepared (coordinator/launch.py).
    rendezvous_nonce: str = attrs.field(default="", repr=False)
    master_addr: str = ""
    master_port: int = 0
    # Filled in just before sending (outputs_grants.py) when the JobSpec's Derivation source is
    # on another Node's disk (init_from_source.node_id); None otherwise or when that Node
    # serves no outputs now.
    init_from_fetch: InitFromFetch | None = None


@attrs.frozen
class CommitOrder:
    node_id: str
    member: MemberKey
    master_addr: str
    master_port: int
    # Filled in just before sending (collector_credentials.py): never stored in plain text.
    collector_credential: str = attrs.field(default="", repr=False)
    telemetry_address: str = ""
    # The other coordinators' telemetry gateways (HOST:PORT), tried in order when
    # telemetry_address refuses: the collector follows whichever coordinator leads.
    telemetry_fallbacks: tuple[str, ...] = ()


@attrs.frozen
class AbortOrder:
    node_id: str
    member: MemberKey
    reason: str


@attrs.frozen
class CancelOrder:
    """Stop a started member: SIGTERM to its processes, SIGKILL after ``grace_period_s``."""

    node_id: str
    member: MemberKey
    reason: str
    grace_period_s: int
    # The member was declared lost while its Node was away: the Node stops it all the same.
    declared_lost: bool = False


Order = PrepareOrder | CommitOrder | AbortOrder | CancelOrder
