"""The tailer's identity core, without files: renames, truncation, reuse and rotated copies."""

from __future__ import annotations

from tuneplane.collector.tracking import (
    HEAD_BYTES,
    Adopted,
    FileStat,
    Moved,
    NotFollowed,
    Opened,
    Restarted,
    SkippedCopy,
    Tracker,
    Vanished,
)

A = b'{"step": 0, "loss": 1.0, "wall_time": 1700000000.1}\n'
B = b'{"step": 0, "loss": 9.0, "wall_time": 1700000099.9}\n'


def stat(path: str, ino: int, content: bytes) -> FileStat:
    return FileStat(path, 1, ino, len(content), content[:HEAD_BYTES])


def test_new_files_open_streams_and_empty_ones_wait() -> None:
    tracker = Tracker()
    assert tracker.observe([stat("m.jsonl", 10, A), stat("e.jsonl", 11, b"")]) == [
        Opened("m.jsonl", "m.jsonl")
    ]
    assert tracker.observe([stat("m.jsonl", 10, A * 2), stat("e.jsonl", 11, B)]) == [
        Opened("e.jsonl", "e.jsonl")
    ]


def test_rename_keeps_the_stream() -> None:
    tracker = Tracker()
    tracker.observe([stat("m.jsonl", 10, A)])
    tracker.advance("m.jsonl", len(A), len(A))
    changes = tracker.observe([stat("m.jsonl.1", 10, A), stat("m.jsonl", 12, B)])
    assert changes == [Moved("m.jsonl", "m.jsonl", "m.jsonl.1"), Opened("m.jsonl#1", "m.jsonl")]
    assert tracker.streams["m.jsonl"].position == len(A)


def test_truncation_and_inode_reuse_restart_from_zero() -> None:
    tracker = Tracker()
    tracker.observe([stat("m.jsonl", 10, A * 3)])
    tracker.advance("m.jsonl", len(A) * 3, len(A) * 3)
    changes = tracker.observe([stat("m.jsonl", 10, A)])
    assert changes == [
        Restarted("m.jsonl", "m.jsonl#1", "m.jsonl", "truncated", len(A), 3 * len(A))
    ]
    assert tracker.streams["m.jsonl#1"].position == 0
    # The file is deleted and its inode handed to a new file with other bytes.
    tracker.advance("m.jsonl#1", len(A), len(A))
    changes = tracker.observe([stat("other.jsonl", 10, B * 2)])
    assert changes == [
        Restarted("m.jsonl#1", "other.jsonl", "other.jsonl", "replaced", 2 * len(B), len(A))
    ]


def test_copytruncate_adopts_the_copy_at_the_old_position() -> None:
    tracker = Tracker()
    tracker.observe([stat("m.jsonl", 10, A * 2)])
    tracker.advance("m.jsonl", len(A) * 2, len(A) * 2)
    # The copy appears while the original is intact: it waits, it is not read twice.
    assert tracker.observe([stat("m.jsonl", 10, A * 3), stat("m.jsonl.1", 20, A * 3)]) == []
    # The original is truncated: the copy continues the old stream where it stopped.
    changes = tracker.observe([stat("m.jsonl", 10, B), stat("m.jsonl.1", 20, A * 3)])
    assert changes == [
        Restarted("m.jsonl", "m.jsonl#1", "m.jsonl", "truncated", len(B), 2 * len(A)),
        Adopted("m.jsonl", "m.jsonl.1"),
    ]
    adopted = tracker.streams["m.jsonl"]
    assert (adopted.inode, adopted.path, adopted.position) == ((1, 20), "m.jsonl.1", 2 * len(A))


def test_a_copy_of_a_live_file_is_skipped_once_writers_are_done() -> None:
    tracker = Tracker()
    big = A * 40  # longer than the head, so the match is on a full KiB
    tracker.observe([stat("m.jsonl", 10, big)])
    assert tracker.observe([stat("m.jsonl", 10, big), stat("backup.jsonl", 20, big)]) == []
    changes = tracker.observe([stat("m.jsonl", 10, big), stat("backup.jsonl", 20, big)], final=True)
    assert changes == [SkippedCopy("m.jsonl", "backup.jsonl")]
    # A file that merely starts like another is read in its own right.
    tracker = Tracker()
    tracker.observe([stat("m.jsonl", 10, A)])
    changes = tracker.observe([stat("m.jsonl", 10, A), stat("n.jsonl", 30, A[:20])], final=True)
    assert changes == [Opened("n.jsonl", "n.jsonl")]


def test_vanished_streams_and_checkpoint_round_trip() -> None:
    tracker = Tracker()
    tracker.observe([stat("m.jsonl", 10, A)])
    tracker.streams["m.jsonl"].committed = 5
    assert tracker.observe([]) == [Vanished("m.jsonl", "m.jsonl")]
    restored = Tracker.from_json(tracker.to_json())
    stream = restored.streams["m.jsonl"]
    assert (stream.inode, stream.position, stream.head) == (None, 5, A)
    assert restored.generations == {"m.jsonl": 1}


def test_a_full_tracker_reports_new_files_and_keeps_following_its_own() -> None:
    tracker = Tracker()
    assert tracker.observe([stat("a.jsonl", 10, A)], max_live=1) == [Opened("a.jsonl", "a.jsonl")]
    tracker.advance("a.jsonl", len(A), len(A))
    # A second file is reported on every look and never opened, the first keeps its stream.
    for _ in range(2):
        changes = tracker.observe([stat("a.jsonl", 10, A * 2), stat("b.jsonl", 11, B)], max_live=1)
        assert changes == [NotFollowed("b.jsonl", 1)]
    assert list(tracker.streams) == ["a.jsonl"]
    # Once the first file is gone its place is free.
    assert tracker.observe([stat("b.jsonl", 11, B)], max_live=1) == [
        Vanished("a.jsonl", "a.jsonl"),
        Opened("b.jsonl", "b.jsonl"),
    ]


def test_a_full_tracker_still_adopts_the_copy_of_a_rotated_stream() -> None:
    tracker = Tracker()
    tracker.observe([stat("m.jsonl", 10, A)], max_live=1)
    tracker.advance("m.jsonl", len(A), len(A))
    # copytruncate: the original is truncated (a new stream at the same path), then its copy
    # appears; the copy continues the old stream although the tracker is full.
    assert tracker.observe([stat("m.jsonl", 10, b"")], max_live=1) == [
        Restarted("m.jsonl", "m.jsonl#1", "m.jsonl", "truncated", 0, len(A))
    ]
    changes = tracker.observe([stat("m.jsonl", 10, b""), stat("m.jsonl.1", 12, A * 2)], max_live=1)
    assert changes == [Adopted("m.jsonl", "m.jsonl.1")]


def test_a_source_prefix_goes_in_front_of_every_stream_opened_and_is_not_stored() -> None:
    tracker = Tracker(source_prefix="restart-1/")
    assert tracker.observe([stat("m.jsonl", 10, A)]) == [Opened("restart-1/m.jsonl", "m.jsonl")]
    tracker.advance("restart-1/m.jsonl", len(A) * 2, len(A) * 2)
    changes = tracker.observe([stat("m.jsonl", 10, B)])  # truncated: a new stream at the path
    assert changes == [
        Restarted("restart-1/m.jsonl", "restart-1/m.jsonl#1", "m.jsonl", "truncated", len(B),
                  2 * len(A))
    ]  # fmt: skip
    assert tracker.unprefixed("restart-1/m.jsonl#1") == "m.jsonl#1"
    # The checkpoint holds the ids as they are; the prefix is the collector's option.
    assert "source_prefix" not in tracker.to_json()
    again = Tracker.from_json(tracker.to_json(), "restart-1/")
    assert set(again.streams) == {"restart-1/m.jsonl", "restart-1/m.jsonl#1"}
    assert Tracker().to_json() == Tracker(source_prefix="").to_json()
