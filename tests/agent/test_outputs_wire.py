"""The outputs listener's framing as pure functions: round trips, bounds and malformed input."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent import outputs_wire as ow

GRANT = "ab" * 32


def _request(**changes: object) -> dict[str, object]:
    data: dict[str, object] = {
        "op": "file", "run_id": "r-1", "attempt": 1, "member_index": 0,
        "out_dir": "/srv/out/r-1/attempt-1/member-0", "grant": GRANT,
        "expires_at_ms": 1_700_000_000_000, "path": "ckpt/model.bin",
    }  # fmt: skip
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}


def _payload(data: object) -> bytes:
    return json.dumps(data).encode()


names = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/\\"),
    min_size=1,
    max_size=20,
).filter(lambda p: p not in (".", ".."))


@given(
    op=st.sampled_from(ow.OPS),
    run_id=st.text(
        alphabet=st.characters(categories=("L", "N", "P", "S", "Zs"), exclude_characters="\x00"),
        min_size=1,
        max_size=ow.MAX_RUN_ID_CHARS,
    ),
    attempt=st.integers(0, 2**31 - 1),
    member_index=st.integers(0, 2**31 - 1),
    out_dir=st.lists(names, min_size=1, max_size=5).map(lambda p: "/" + "/".join(p)),
    grant=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    expires_at_ms=st.integers(0, 2**63 - 1),
    path=st.lists(names, min_size=1, max_size=5).map("/".join),
)
def test_any_request_round_trips(
    op: str, run_id: str, attempt: int, member_index: int, out_dir: str, grant: str,
    expires_at_ms: int, path: str,
) -> None:  # fmt: skip
    request = ow.Request(op, run_id, attempt, member_index, out_dir, grant, expires_at_ms,
                         path if op == "file" else "")  # fmt: skip
    framed = ow.encode_request(request)
    size = ow.body_length(framed[:4], ow.MAX_REQUEST_BYTES, "request")
    assert size == len(framed) - 4
    assert ow.decode_request(framed[4:]) == request


@given(size=st.integers(0, 2**40), error=st.text(max_size=3000))
def test_any_response_round_trips(size: int, error: str) -> None:
    for response in (ow.Response(True, size=size), ow.Response(False, error=error)):
        framed = ow.encode_response(response)
        body = framed[4 : 4 + ow.body_length(framed[:4], 10**9, "response")]
        decoded = ow.decode_response(body)
        assert decoded.ok == response.ok
        assert decoded.size == response.size
        assert decoded.error == response.error[: ow.MAX_ERROR_CHARS]


def test_a_length_over_the_bound_is_refused_from_the_prefix_alone() -> None:
    prefix = (ow.MAX_REQUEST_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(ow.FrameTooLarge, match=f"at most {ow.MAX_REQUEST_BYTES}"):
        ow.body_length(prefix, ow.MAX_REQUEST_BYTES, "request")
    with pytest.raises(ow.MalformedFrame, match="empty"):
        ow.body_length(b"\0\0\0\0", ow.MAX_REQUEST_BYTES, "request")
    with pytest.raises(ow.MalformedFrame, match="length prefix"):
        ow.body_length(b"\0\0", ow.MAX_REQUEST_BYTES, "request")
    with pytest.raises(ow.FrameTooLarge):
        ow.decode_request(b" " * (ow.MAX_REQUEST_BYTES + 1))


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (_request(path="../../credentials/control.token"), "'..' part"),
        (_request(path="/etc/passwd"), "starts with /"),
        (_request(path="a\\b"), "backslash"),
        (_request(path="a\nb"), "control character"),
        (_request(path=None), "path must be a non-empty string"),
        (_request(op="manifest"), "A manifest request names no path"),
        (_request(op="delete"), "op must be one of manifest, file"),
        (_request(grant="AB" * 32), "64 lowercase hex"),
        (_request(grant="ab" * 31), "64 lowercase hex"),
        (_request(grant=None), "64 lowercase hex"),
        (_request(out_dir="relative/out"), "absolute path"),
        (_request(out_dir="/x\x00y"), "out_dir must be"),
        (_request(attempt=True), "attempt must be an integer"),
        (_request(attempt=-1), "attempt must be an integer"),
        (_request(member_index="0"), "member_index must be an integer"),
        (_request(expires_at_ms=1.5), "expires_at_ms must be an integer"),
        (_request(run_id=""), "run_id must be"),
        (_request(run_id="r" * (ow.MAX_RUN_ID_CHARS + 1)), "run_id must be"),
        ({**_request(), "follow_links": True}, "unknown fields: follow_links"),
        ([1, 2], "not an object"),
    ],
)
def test_a_malformed_request_is_a_sentence(data: object, said: str) -> None:
    with pytest.raises(ow.MalformedFrame) as caught:
        ow.decode_request(_payload(data))
    assert said in str(caught.value)
    assert str(caught.value).endswith((".", ".'", "py."))


@pytest.mark.parametrize("payload", [b"\xff\xfe", b"{not json", b"", b"null"])
def test_bytes_that_are_not_json_are_refused(payload: bytes) -> None:
    with pytest.raises(ow.MalformedFrame):
        ow.decode_request(payload)
    with pytest.raises(ow.MalformedFrame):
        ow.decode_response(payload)


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_a_frame_error(payload: bytes) -> None:
    for decode in (ow.decode_request, ow.decode_response):
        with contextlib.suppress(ow.FrameError):
            decode(payload)


@pytest.mark.parametrize(
    "data",
    [
        {"ok": True},
        {"ok": True, "size": -1},
        {"ok": True, "size": True},
        {"ok": True, "size": 3, "error": "x"},
        {"ok": False},
        {"ok": "yes", "error": "x"},
        {"ok": False, "error": 5},
    ],
)
def test_a_malformed_response_is_refused(data: object) -> None:
    with pytest.raises(ow.MalformedFrame):
        ow.decode_response(_payload(data))
