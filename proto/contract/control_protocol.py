"""The control protocol's version, its capabilities and the version-skew policy.

Rules (docs/operator.md, "Upgrades and version skew"; docs/protocol.md, "Versions"):
- Hello and Welcome each carry the sender's protocol version and capabilities. A message with no
  version (0 on the wire) comes from 0.1.x, which speaks protocol 1 and has no capabilities.
- The policy, as Kubernetes has for kubelets: a Node's agent may be at most
  :data:`AGENT_SKEW` protocol versions older than the coordinators, and never newer. Coordinators
  are upgraded first (one at a time, through a failover), then the agents in place. A
  coordinator refuses an agent outside the policy with a sentence naming both releases and
  protocols, before anything of the Node is recorded.
- A capability names something a side may send only to a peer that announced it. A coordinator
  never sends an agent a message or field the agent did not announce; an agent uses what the
  coordinator announced, and only that.
- Pure: no I/O. The agent's and the coordinator's shells call :func:`judge_agent` and
  :func:`spoken`.
"""

from __future__ import annotations

import enum
import importlib.metadata
from collections.abc import Mapping

import attrs

#: The control protocol this release speaks. Protocol 1 is 0.1.x's (no version on the wire).
PROTOCOL = 2

#: What a Hello or Welcome without a version speaks: 0.1.x, before versions were carried.
UNVERSIONED = 1

#: Connect's request metadata saying the agent's protocol and release, so a coordinator can
#: refuse it before any Hello (0.1.x agents send neither: they are judged by their Hello).
PROTOCOL_HEADER = "tuneplane-protocol"
VERSION_HEADER = "tuneplane-agent-version"
#: Connect's request metadata: the agent's capabilities, comma-separated, as its Hello will say
#: them; what the coordinator may do before that Hello (answer with a place in line).
CAPABILITIES_HEADER = "tuneplane-capabilities"

#: A Connect refused as busy answers with initial metadata first: :data:`BUSY_HEADER` (the
#: sentence) and, once the coordinator has measured how fast it welcomes Nodes,
#: :data:`COME_BACK_HEADER` (milliseconds until the Node's turn, coordinator/hello_gate.py). An
#: agent that reads them resets the stream and dials again then; UNAVAILABLE follows for one
#: that does not (0.1.x). Not trailers: grpclib's server resets the stream right behind
#: non-OK trailers, and its client then reports a bare reset, losing them.
BUSY_HEADER = "tuneplane-busy"
COME_BACK_HEADER = "tuneplane-come-back-ms"
#: The longest wait a busy refusal may name that an agent takes as said.
COME_BACK_CAP_S = 120.0

#: A Connect of an agent that announced :attr:`Capability.QUEUED_CONNECT`, authenticated and
#: waiting for a turn, answers with initial metadata first: :data:`QUEUED_HEADER` (a sentence)
#: and :data:`WAIT_HEADER` (milliseconds the coordinator expects the wait to take). The agent
#: then waits that much longer for its Welcome, up to :data:`QUEUED_CAP_S` in all, instead of
#: giving up after its usual Welcome timeout and dialing again.
QUEUED_HEADER = "tuneplane-queued"
WAIT_HEADER = "tuneplane-wait-ms"
#: The longest wait a place in line may name that an agent takes as said.
QUEUED_CAP_S = 120.0

#: How many protocol versions older than the coordinators an agent may be.
AGENT_SKEW = 1

#: The oldest agent protocol these coordinators accept.
OLDEST_AGENT_PROTOCOL = PROTOCOL - AGENT_SKEW


class Capability(enum.StrEnum):
    """Things a side may send only to a peer that announced it."""

    #: The agent takes a ``Coordinators`` message mid-session (the coordinators sharing the
    #: store changed) and stores the list as it stores Welcome's; an agent without it learns
    #: the list at its next Welcome.
    COORDINATORS_UPDATE = "coordinators-update"
    #: The coordinator judges every Hello by this policy (and says so in Welcome), so a Node
    #: it welcomed is within it.
    VERSION_SKEW_POLICY = "version-skew-policy"
    #: The agent (announcing it in Connect's request metadata too) waits for its Welcome as
    #: long as a place in line says (:data:`QUEUED_HEADER`), so a coordinator in a reconnect
    #: storm keeps it in line instead of refusing it as busy.
    QUEUED_CONNECT = "queued-connect"
    #: The coordinator takes ``PrepareProgress`` (a preparing member's runtime image pull) and
    #: shows it with the member; an agent sends it to no other coordinator.
    PREPARE_PROGRESS = "prepare-progress"


#: What this release's agent announces in Hello.
AGENT_CAPABILITIES: tuple[str, ...] = (
    Capability.COORDINATORS_UPDATE.value,
    Capability.QUEUED_CONNECT.value,
)

#: What this release's coordinator announces in Welcome.
COORDINATOR_CAPABILITIES: tuple[str, ...] = (
    Capability.COORDINATORS_UPDATE.value,
    Capability.VERSION_SKEW_POLICY.value,
    Capability.PREPARE_PROGRESS.value,
)


def release() -> str:
    """The installed TunePlane release (the package's version), said in Hello and Welcome."""
    try:
        return importlib.metadata.version("tuneplane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def from_metadata(metadata: Mapping[str, str]) -> Peer | None:
    """The agent as Connect's request metadata says it (None when it says nothing, as 0.1.x
    agents do); a protocol that is not a number is taken as unversioned."""
    said = metadata.get(PROTOCOL_HEADER)
    if said is None:
        return None
    try:
        wire = max(int(said), 0)
    except ValueError:
        wire = 0
    capabilities = [c.strip() for c in metadata.get(CAPABILITIES_HEADER, "").split(",")]
    return Peer.said(metadata.get(VERSION_HEADER, ""), wire, [c for c in capabilities if c])


def queued_for(metadata: Mapping[str, str] | None) -> float | None:
    """Seconds the place in line that initial ``metadata`` gives expects to wait (capped at
    :data:`QUEUED_CAP_S`; the cap when it names none that reads as milliseconds), or None when
    the Connect was not put in line."""
    if metadata is None or QUEUED_HEADER not in metadata:
        return None
    try:
        ms = int(metadata.get(WAIT_HEADER, ""))
    except ValueError:
        return QUEUED_CAP_S
    return min(max(ms, 0) / 1000, QUEUED_CAP_S)


def come_back_in(metadata: Mapping[str, str] | None) -> float | None:
    """Seconds until the turn a busy refusal's initial ``metadata`` names, or None when it
    names none (no rate measured yet, an older coordinator, no refusal) or none that reads as a
    number of milliseconds; capped at :data:`COME_BACK_CAP_S`."""
    said = None if metadata is None else metadata.get(COME_BACK_HEADER)
    if said is None:
        return None
    try:
        ms = int(said)
    except ValueError:
        return None
    return min(max(ms, 0) / 1000, COME_BACK_CAP_S)


def spoken(wire_protocol: int) -> int:
    """The protocol a Hello or Welcome speaks, from its field (0: unversioned, 0.1.x)."""
    return wire_protocol or UNVERSIONED


@attrs.frozen
class Peer:
    """What one side said of itself in Hello or Welcome."""

    version: str
    protocol: int
    capabilities: frozenset[str] = frozenset()

    @classmethod
    def said(cls, version: str, wire_protocol: int, capabilities: list[str]) -> Peer:
        return cls(version or "unknown", spoken(wire_protocol), frozenset(capabilities))

    def can(self, capability: Capability) -> bool:
        return capability.value in self.capabilities

    @property
    def text(self) -> str:
        return f"{self.version} (control protocol {self.protocol})"


#: A peer that has said nothing of itself yet.
UNKNOWN_PEER = Peer("unknown", UNVERSIONED)


def judge_agent(agent: Peer, coordinator_version: str) -> str | None:
    """None when ``agent`` is within the policy for these coordinators; otherwise the refusal,
    a sentence naming both releases and protocols and what to upgrade."""
    here = f"coordinator {coordinator_version} (control protocol {PROTOCOL})"
    if agent.protocol > PROTOCOL:
        return (
            f"This Node's agent {agent.text} is newer than {here}: an agent is never newer than "
            "the coordinators it connects to. Upgrade the coordinators first, one at a time "
            'through a failover, then the agents (docs/operator.md, "Upgrades and version '
            'skew").'
        )
    if agent.protocol < OLDEST_AGENT_PROTOCOL:
        return (
            f"This Node's agent {agent.text} is too old for {here}, which accepts agents of "
            f"control protocol {OLDEST_AGENT_PROTOCOL} to {PROTOCOL}. Upgrade tuneplane-node on "
            'this Node; its members keep running (docs/operator.md, "Upgrades and version '
            'skew").'
        )
    return None


def coordinator_warning(coordinator: Peer, agent_version: str) -> str | None:
    """None when a Welcome's coordinator is within the policy for this agent; otherwise a
    sentence for the agent's log (a coordinator older than the policy cannot refuse us itself:
    the session goes on with what both sides speak)."""
    if coordinator.protocol >= PROTOCOL:
        return None
    return (
        f"The coordinator {coordinator.text} is older than this Node's agent {agent_version} "
        f"(control protocol {PROTOCOL}), outside the version-skew policy: upgrade the "
        "coordinators before the agents. The session goes on with what both speak."
    )
