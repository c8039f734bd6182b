"""How a failed gRPC call to the coordinator reads, one way for every client: the Node's control
stream, the collector's shipper and ``tp``.

Rules:
- :func:`classify` is the one table from what a call raised (a ``GRPCError`` and its status, a
  TLS, socket or HTTP/2 failure, a deadline) to a :class:`Kind`. A client catches exactly
  :data:`CALL_ERRORS` around a call, so anything else (a bug) propagates untouched.
- A status in :data:`REFUSAL_STATUSES` means the coordinator understood the call and said no:
  the same call is refused again, and what it said is a sentence for the user. Any other status
  means it could not serve the call now (UNAVAILABLE, INTERNAL, ...): worth retrying.
- :meth:`CallFailure.sentence` is the one wording of each kind. Each client passes what only it
  knows (what it dialed, which call, its deadline, where its CA and address are set) and maps
  the kind to its own error type; nothing here logs or retries.
- Shared runtime infrastructure: it lives in the agent, the lowest layer every client imports.
"""

from __future__ import annotations

import enum
import ssl
from pathlib import Path

import attrs
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

#: What a client catches around a call; :func:`classify` reads each of them.
CALL_ERRORS: tuple[type[BaseException], ...] = (
    GRPCError,
    OSError,  # includes ssl.SSLError, TimeoutError and the socket errors
    StreamTerminatedError,
    ProtocolError,
    EOFError,
    trio.TooSlowError,
)

#: Statuses that mean the coordinator understood the call and said no.
REFUSAL_STATUSES = frozenset(
    {
        Status.INVALID_ARGUMENT,
        Status.FAILED_PRECONDITION,
        Status.NOT_FOUND,
        Status.ALREADY_EXISTS,
        Status.PERMISSION_DENIED,
        Status.UNAUTHENTICATED,
        Status.RESOURCE_EXHAUSTED,
        Status.OUT_OF_RANGE,
        Status.ABORTED,
        Status.UNIMPLEMENTED,
    }
)


class Kind(enum.Enum):
    """What went wrong, as a client acts on it."""

    #: The coordinator answered and said no; the same call is refused again.
    REFUSED = "refused"
    #: The coordinator answered that it cannot serve the call now; retrying may help.
    UNAVAILABLE = "unavailable"
    #: No answer within the deadline.
    TIMED_OUT = "timed out"
    #: Its certificate does not verify against the CA given; retrying will not help.
    UNVERIFIED = "unverified"
    #: The TLS handshake failed otherwise (not a TLS listener, no common protocol).
    TLS_FAILED = "tls failed"
    #: No connection (refused, reset, no route, a name that does not resolve).
    UNREACHABLE = "unreachable"
    #: The connection broke in the middle of the call.
    BROKEN = "broken"


@attrs.frozen
class CallFailure:
    """One failed call: its :class:`Kind`, the gRPC status name ("" when the call got none) and
    what the coordinator said or what broke."""

    kind: Kind
    status: str = ""
    detail: str = ""

    @property
    def retry_helps(self) -> bool:
        """Whether the same call may succeed later (not a refusal, not a CA that does not match)."""
        return self.kind not in (Kind.REFUSED, Kind.UNVERIFIED)

    def sentence(
        self,
        where: str,
        call: str,
        deadline_s: float,
        ca_path: Path,
        ca_fix: str,
        address_check: str,
    ) -> str:
        """The failure as a sentence. ``where`` is what was dialed ("the coordinator at
        10.0.0.5:7444"), ``call`` the RPC, ``ca_path`` the CA it was verified against;
        ``ca_fix`` is the client's advice for a CA that does not match, ``address_check`` a
        "that ..." clause naming where its address is set ("that --gateway names the
        coordinator's telemetry listener")."""
        said = self.detail or f"gRPC status {self.status}"
        if self.kind is Kind.REFUSED:
            text = f"{where} refused {call} ({self.status}): {said}"
        elif self.kind is Kind.UNAVAILABLE:
            text = f"{where} could not serve {call} now ({self.status}: {said})"
        elif self.kind is Kind.TIMED_OUT:
            text = (
                f"{where} did not answer {call} within {deadline_s:g} s; check that it is "
                "running and reachable"
            )
        elif self.kind is Kind.UNVERIFIED:
            text = (
                f"TLS verification of {where} failed ({said}): its certificate does not verify "
                f"against the CA; it is not signed by the CA in {ca_path}. {_sentence(ca_fix)}"
            )
        elif self.kind is Kind.TLS_FAILED:
            text = f"TLS with {where} failed ({said}); check {address_check}"
        elif self.kind is Kind.UNREACHABLE:
            text = f"Cannot reach {where} ({said}); check that it is running and {address_check}"
        else:
            text = f"The connection to {where} broke during {call} ({said}); check {address_check}"
        return _sentence(text)


def classify(exc: BaseException) -> CallFailure:
    """The one table from what a call raised (one of :data:`CALL_ERRORS`) to a
    :class:`CallFailure`. Order matters: a certificate error is a TLS error is an ``OSError``."""
    if isinstance(exc, GRPCError):
        status = exc.status.name if isinstance(exc.status, Status) else str(exc.status)
        detail = exc.message or ""
        if exc.status in REFUSAL_STATUSES:
            return CallFailure(Kind.REFUSED, status, detail)
        if exc.status is Status.DEADLINE_EXCEEDED:
            return CallFailure(Kind.TIMED_OUT, status, detail)
        return CallFailure(Kind.UNAVAILABLE, status, detail)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return CallFailure(Kind.UNVERIFIED, detail=exc.verify_message or str(exc))
    if isinstance(exc, ssl.SSLError):
        # ``reason`` is set by the ssl module's own errors, not by every SSLError.
        return CallFailure(Kind.TLS_FAILED, detail=getattr(exc, "reason", None) or str(exc))
    if isinstance(exc, TimeoutError | trio.TooSlowError):
        return CallFailure(Kind.TIMED_OUT)
    if isinstance(exc, StreamTerminatedError | ProtocolError | EOFError):
        return CallFailure(Kind.BROKEN, detail=f"{type(exc).__name__}: {exc}".rstrip(": "))
    if isinstance(exc, OSError):
        return CallFailure(Kind.UNREACHABLE, detail=exc.strerror or type(exc).__name__)
    raise TypeError(f"{type(exc).__name__} is not a failed call; catch only CALL_ERRORS") from exc


def _sentence(text: str) -> str:
    """``text`` starting with a capital and ending with a full stop."""
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else text + "."
