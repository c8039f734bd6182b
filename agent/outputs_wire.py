"""The outputs listener's framing (sans-IO): requests and responses as bytes, and back.

Rules:
- Every frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON (one object).
  A request is at most :data:`MAX_REQUEST_BYTES`, a response header at most
  :data:`MAX_RESPONSE_BYTES`; the length is checked before a byte of the body is read.
- A request names one source member (run id, attempt, member index), the output directory the
  holder's journal must hold for it, the grant and its expiry, and what it wants: ``manifest``
  (the member's output manifest) or ``file`` (``path``, a plain relative name the manifest lists).
  Each request carries its grant: the holder decides every one on its own.
- A response header is ``{"ok": true, "size": N}`` followed by exactly N raw bytes, or
  ``{"ok": false, "error": SENTENCE}`` followed by nothing (the holder then hangs up).
- Anything else is a :class:`FrameError` whose ``str()`` is a sentence; nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from tuneplane.proto.contract.input_checks import InputRefused, check_file_name

MAX_REQUEST_BYTES = 8 * 1024
MAX_RESPONSE_BYTES = 8 * 1024
MAX_ERROR_CHARS = 2000
MAX_RUN_ID_CHARS = 128
MAX_OUT_DIR_CHARS = 4096
PREFIX_BYTES = 4
OPS = ("manifest", "file")
_GRANT = re.compile(r"^[0-9a-f]{64}$")
_REQUEST_KEYS = frozenset(
    {"op", "run_id", "attempt", "member_index", "out_dir", "grant", "expires_at_ms", "path"}
)


class FrameError(Exception):
    """Bytes that are not a frame of this protocol; ``str()`` says what was wrong."""


class FrameTooLarge(FrameError):
    """A length prefix above the bound: refused before the body is read."""


class MalformedFrame(FrameError):
    """A frame whose body is not the JSON object the protocol expects."""


@attrs.frozen
class Request:
    op: str
    run_id: str
    attempt: int
    member_index: int
    out_dir: str
    grant: str = attrs.field(repr=False)
    expires_at_ms: int
    path: str = ""

    @property
    def member(self) -> str:
        """The source member as the journal names it (``run/attempt/index``)."""
        return f"{self.run_id}/{self.attempt}/{self.member_index}"


@attrs.frozen
class Response:
    ok: bool
    size: int = 0
    error: str = ""


def frame(payload: bytes) -> bytes:
    """``payload`` behind its length prefix."""
    return len(payload).to_bytes(PREFIX_BYTES, "big") + payload


def body_length(prefix: bytes, limit: int, what: str) -> int:
    """The body length a 4-byte prefix announces; :class:`FrameTooLarge` above ``limit``."""
    if len(prefix) != PREFIX_BYTES:
        raise MalformedFrame(f"The {what} ended inside its length prefix.")
    size = int.from_bytes(prefix, "big")
    if size > limit:
        raise FrameTooLarge(f"The {what} announces {size} bytes; at most {limit} are accepted.")
    if size == 0:
        raise MalformedFrame(f"The {what} is empty.")
    return size


def _object(payload: bytes, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedFrame(f"The {what} is not UTF-8 JSON ({exc}).") from None
    if not isinstance(raw, dict):
        raise MalformedFrame(f"The {what} is JSON but not an object.")
    return raw


def _int(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    value = raw.get(key)
    if type(value) is not int or not low <= value <= high:
        raise MalformedFrame(f"The request's {key} must be an integer from {low} to {high}.")
    return value


def _text(raw: dict[str, Any], key: str, limit: int) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        raise MalformedFrame(
            f"The request's {key} must be a non-empty string of at most {limit} characters."
        )
    return value


def encode_request(request: Request) -> bytes:
    data: dict[str, Any] = attrs.asdict(request)
    if request.op != "file":
        del data["path"]
    return frame(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())


def decode_request(payload: bytes) -> Request:
    """The request ``payload`` (a frame's body) holds; :class:`MalformedFrame` saying why not."""
    if len(payload) > MAX_REQUEST_BYTES:
        raise FrameTooLarge(f"The request holds {len(payload)} bytes; at most "
                            f"{MAX_REQUEST_BYTES} are accepted.")  # fmt: skip
    raw = _object(payload, "request")
    extra = sorted(set(raw) - _REQUEST_KEYS)
    if extra:
        raise MalformedFrame(f"The request has unknown fields: {', '.join(extra)}.")
    op = raw.get("op")
    if op not in OPS:
        raise MalformedFrame(f"The request's op must be one of {', '.join(OPS)}.")
    grant = raw.get("grant")
    if not isinstance(grant, str) or not _GRANT.match(grant):
        raise MalformedFrame("The request's grant must be 64 lowercase hex digits.")
    out_dir = _text(raw, "out_dir", MAX_OUT_DIR_CHARS)
    if not out_dir.startswith("/"):
        raise MalformedFrame("The request's out_dir must be an absolute path.")
    path = ""
    if op == "file":
        path = _text(raw, "path", MAX_OUT_DIR_CHARS)
        try:
            check_file_name(path, "The requested path")
        except InputRefused as exc:
            raise MalformedFrame(str(exc)) from None
    elif "path" in raw:
        raise MalformedFrame("A manifest request names no path.")
    return Request(
        op=op,
        run_id=_text(raw, "run_id", MAX_RUN_ID_CHARS),
        attempt=_int(raw, "attempt", 0, 2**31 - 1),
        member_index=_int(raw, "member_index", 0, 2**31 - 1),
        out_dir=out_dir,
        grant=grant,
        expires_at_ms=_int(raw, "expires_at_ms", 0, 2**63 - 1),
        path=path,
    )


def encode_response(response: Response) -> bytes:
    if response.ok:
        data: dict[str, Any] = {"ok": True, "size": response.size}
    else:
        data = {"ok": False, "error": response.error[:MAX_ERROR_CHARS]}
    return frame(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())


def decode_response(payload: bytes) -> Response:
    """The response header ``payload`` holds; :class:`MalformedFrame` saying why not."""
    raw = _object(payload, "response")
    ok = raw.get("ok")
    if ok is True:
        size = raw.get("size")
        if type(size) is not int or size < 0 or set(raw) != {"ok", "size"}:
            raise MalformedFrame("The response says ok but gives no size of at least 0.")
        return Response(True, size=size)
    error = raw.get("error")
    if ok is not False or not isinstance(error, str) or set(raw) != {"ok", "error"}:
        raise MalformedFrame("The response is neither ok with a size nor an error sentence.")
    return Response(False, error=error[:MAX_ERROR_CHARS])
