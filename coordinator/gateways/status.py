"""Typed errors -> gRPC status, once, at the edge of every listener.

Rules: every handler of every listener runs inside :func:`grpc_errors` (the listeners wrap each
handler, :mod:`~tuneplane.coordinator.gateways.message_limits`), so each typed error leaves as one
status code with its sentence. It sits with the gateways, not in ``wire/``, because it knows the
store's errors: ``tp`` shares ``wire/`` and never loads the store.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from grpclib import GRPCError
from grpclib.const import Status
from grpclib.exceptions import ProtocolError, StreamTerminatedError

from tuneplane.proto.contract.input_checks import InputRefused
from tuneplane.proto.contract.jobspec import JobSpecError

from ..auth import AuthError, PermissionDenied
from ..config import ConfigError
from ..image_pin import RuntimeImageRefused
from ..job_changes import TooManyWatches
from ..store.core import Conflict, EnrollRefused, NotFound
from ..wire.errors import BadMessage

log = logging.getLogger(__name__)

_PASSED_THROUGH = (GRPCError, StreamTerminatedError, ProtocolError)


def _only_grpc_error(group: BaseExceptionGroup[BaseException]) -> Exception | None:
    """A task group's failure that is only a chosen status or a peer that went away (a
    session's refusal, a Node that dropped): its first such error, else None."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if leaves and all(isinstance(leaf, _PASSED_THROUGH) for leaf in leaves):
        grpc = [leaf for leaf in leaves if isinstance(leaf, GRPCError)]
        first = (grpc or leaves)[0]
        assert isinstance(first, Exception)
        return first
    return None


@contextmanager
def grpc_errors() -> Iterator[None]:
    """Translate the coordinator's typed errors into gRPC status codes, once, at the edge.

    This is the one translator: every handler of every listener runs inside it. An exception
    nobody expected becomes INTERNAL with an error id that is also in the log, and the process
    keeps serving.
    """
    try:
        yield
    except _PASSED_THROUGH:
        # A status already chosen, or a peer that went away: grpclib handles both.
        raise
    except AuthError as exc:
        raise GRPCError(Status.UNAUTHENTICATED, str(exc)) from None
    except (PermissionDenied, EnrollRefused) as exc:
        raise GRPCError(Status.PERMISSION_DENIED, str(exc)) from None
    except JobSpecError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except BadMessage as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except TooManyWatches as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
    except NotFound as exc:
        raise GRPCError(Status.NOT_FOUND, str(exc)) from None
    except Conflict as exc:
        raise GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
    except ConfigError as exc:
        raise GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
    except RuntimeImageRefused as exc:
        raise GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
    except InputRefused as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except Exception as exc:
        single = _only_grpc_error(exc) if isinstance(exc, BaseExceptionGroup) else None
        if single is not None:
            raise single from None
        error_id = secrets.token_hex(6)
        log.exception("unexpected error in a call error_id=%s", error_id)
        raise GRPCError(
            Status.INTERNAL,
            f"The coordinator failed unexpectedly (error id {error_id}) and keeps serving. "
            "Tell the coordinator's operator the error id; its log holds the details.",
        ) from None
