"""TFRecord framing: CRCs, waiting on a partial record, skipping and resyncing past corruption."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st
from tensorboardX.record_writer import masked_crc32c as tbx_masked_crc32c

from tuneplane.collector.tfrecord import RecordSplitter, frame, masked_crc32c


def records_of(data: bytes, *, final: bool = True) -> list[tuple[int, bytes]]:
    return RecordSplitter().split(data, 0, final=final).records


def test_masked_crc_matches_the_writer_s() -> None:
    for data in (b"", b"a", b"hello world" * 7, bytes(range(256))):
        assert masked_crc32c(data) == tbx_masked_crc32c(data)


def test_frames_round_trip_with_offsets() -> None:
    payloads = [b"one", b"", b"three" * 50]
    data = b"".join(frame(p) for p in payloads)
    assert records_of(data) == [(0, b"one"), (19, b""), (35, b"three" * 50)]


def test_partial_record_is_waited_for_then_resumed_from_its_start() -> None:
    data = frame(b"first") + frame(b"second record")
    cut = len(frame(b"first")) + 7
    splitter = RecordSplitter()
    head = splitter.split(data[:cut], 0)
    assert head.records == [(0, b"first")]
    assert head.corruptions == []
    assert head.consumed == len(frame(b"first"))
    tail = splitter.split(data[head.consumed :], head.consumed)
    assert tail.records == [(len(frame(b"first")), b"second record")]
    assert tail.consumed == len(data) - head.consumed


def test_a_partial_tail_of_a_finished_stream_is_reported_as_truncated() -> None:
    data = frame(b"first") + frame(b"second")[:9]
    split = RecordSplitter().split(data, 100, final=True)
    assert split.records == [(100, b"first")]
    assert [(c.offset, c.kind) for c in split.corruptions] == [(100 + 21, "truncated-record")]
    assert split.consumed == len(data)


def test_bad_data_crc_skips_one_record_only() -> None:
    good = [frame(b"a" * 10), frame(b"b" * 10), frame(b"c" * 10)]
    broken = bytearray(good[1])
    broken[14] ^= 0xFF
    data = good[0] + bytes(broken) + good[2]
    split = RecordSplitter().split(data, 0)
    assert [r for _, r in split.records] == [b"a" * 10, b"c" * 10]
    assert [(c.offset, c.kind) for c in split.corruptions] == [(len(good[0]), "bad-data-crc")]


def test_bad_length_crc_resyncs_to_the_next_valid_record() -> None:
    good = [frame(bytes([i]) * 40) for i in range(4)]
    broken = bytearray(good[1])
    broken[2] ^= 0x55  # the length is now wrong, and so is its CRC
    data = good[0] + bytes(broken) + good[2] + good[3]
    split = RecordSplitter().split(data, 0, final=True)
    assert [r[0] for _, r in split.records] == [0, 2, 3]
    assert [(c.offset, c.kind) for c in split.corruptions] == [(len(good[0]), "bad-length-crc")]


def test_garbage_longer_than_the_buffer_never_stalls() -> None:
    garbage = b"\xff" * 5000
    data = frame(b"x") + garbage + frame(b"y")
    splitter = RecordSplitter()
    records: list[tuple[int, bytes]] = []
    kinds: list[str] = []
    offset = 0
    pending = b""
    # Arrives in 100-byte pieces: the resync state carries across calls, one warning in all.
    for start in range(0, len(data), 100):
        buf = pending + data[start : start + 100]
        split = splitter.split(buf, offset)
        records += split.records
        kinds += [c.kind for c in split.corruptions]
        offset += split.consumed
        pending = buf[split.consumed :]
    assert [r for _, r in records] == [b"x", b"y"]
    assert kinds == ["bad-length-crc"]


def test_an_absurd_length_is_corruption_not_a_wait() -> None:
    header = struct.pack("<Q", 1 << 40)
    data = header + struct.pack("<I", masked_crc32c(header)) + frame(b"next")
    split = RecordSplitter().split(data, 0)
    assert [r for _, r in split.records] == [b"next"]
    assert [c.kind for c in split.corruptions] == ["bad-length-crc"]


@given(
    payloads=st.lists(st.binary(max_size=64), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)
def test_any_chunking_gives_the_same_records(payloads: list[bytes], cuts: list[int]) -> None:
    data = b"".join(frame(p) for p in payloads)
    whole = records_of(data)
    splitter = RecordSplitter()
    got: list[tuple[int, bytes]] = []
    offset = 0
    pending = b""
    bounds = sorted({min(c, len(data)) for c in cuts} | {len(data)})
    last = 0
    for bound in bounds:
        buf = pending + data[last:bound]
        last = bound
        split = splitter.split(buf, offset, final=bound == len(data))
        assert split.corruptions == []
        got += split.records
        offset += split.consumed
        pending = buf[split.consumed :]
    assert got == whole
    assert [p for _, p in whole] == payloads
