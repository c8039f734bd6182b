"""Which files under a member's output directory are telemetry, how their runs are named, and
the bounds of the search, on real directory trees."""

from __future__ import annotations

import os
from pathlib import Path

from tuneplane.collector.files import Layout, ScanLimits, discover, open_under

OUT = Layout.output_dir("telemetry")


def touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_event_files_anywhere_jsonl_only_where_it_is_telemetry(tmp_path: Path) -> None:
    for rel in (
        "telemetry/metrics.jsonl",  # any JSONL in the telemetry directory
        "telemetry/sub/data.jsonl",
        "tensorboard/events.out.tfevents.1.host",
        "tensorboard/run1/events.out.tfevents.2.host",
        "tb/events.out.tfevents.3.host",  # the script's own log directory
        "eval/report.rank3.jsonl",  # tuneplane.report.init(dir=...)
        "eval/report.rank3.jsonl.1",
        # Not telemetry: the researcher's own JSONL, compressed rotations, hidden files.
        "data/train.jsonl",
        "report.rank0.jsonl.gz",
        "tb/.events.out.tfevents.4.host",
        "checkpoints/model.safetensors",
    ):
        touch(tmp_path / rel)
    found = discover(tmp_path, OUT, ScanLimits())
    assert found.files == [
        ("telemetry/metrics.jsonl", "jsonl"),
        ("telemetry/sub/data.jsonl", "jsonl"),
        ("tensorboard/events.out.tfevents.1.host", "tfevents"),
        ("tensorboard/run1/events.out.tfevents.2.host", "tfevents"),
        ("eval/report.rank3.jsonl", "jsonl"),
        ("eval/report.rank3.jsonl.1", "jsonl"),
        ("tb/events.out.tfevents.3.host", "tfevents"),
    ]
    assert not found.depth_limited and not found.entries_limited


def test_runs_are_directories_relative_to_the_nearest_log_directory() -> None:
    assert OUT.run("telemetry/report.rank0.jsonl") == ""
    assert OUT.run("telemetry/tb/events.out.tfevents.1") == "tb"
    assert OUT.run("tensorboard/events.out.tfevents.1") == ""
    assert OUT.run("tensorboard/lr_0.1/train/events.out.tfevents.1") == "lr_0.1/train"
    assert OUT.run("tb/events.out.tfevents.1") == "tb"
    assert OUT.run("events.out.tfevents.1") == ""
    # A name that only starts like a log directory is not inside it.
    assert OUT.run("telemetry2/events.out.tfevents.1") == "telemetry2"
    # A stream renamed after a restart keeps its run (the suffix is on the base name).
    assert OUT.run("tb/run1/events.out.tfevents.1#2") == "tb/run1"
    assert Layout().run("tb/events.out.tfevents.1") == "tb"


def test_depth_and_entries_bounds_are_reported(tmp_path: Path) -> None:
    touch(tmp_path / "telemetry" / "report.rank0.jsonl")
    touch(tmp_path / "z" / "b" / "c" / "events.out.tfevents.1")
    found = discover(tmp_path, OUT, ScanLimits(max_depth=2))
    assert found.files == [("telemetry/report.rank0.jsonl", "jsonl")]
    assert found.depth_limited and not found.entries_limited
    # A checkpoint directory with many entries: the log directories were searched first.
    for i in range(50):
        touch(tmp_path / "ckpt" / f"shard-{i:03}.bin")
    found = discover(tmp_path, OUT, ScanLimits(max_entries=20))
    assert found.files == [("telemetry/report.rank0.jsonl", "jsonl")]
    assert found.entries_limited


def test_links_and_special_files_are_never_read(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere" / "report.rank0.jsonl"
    touch(secret, b'{"step": 1, "stolen": 1}\n')
    out = tmp_path / "out"
    touch(out / "telemetry" / "report.rank1.jsonl")
    os.symlink(secret, out / "telemetry" / "report.rank0.jsonl")
    os.symlink(secret.parent, out / "tensorboard")
    os.mkfifo(out / "telemetry" / "fifo.jsonl")
    found = discover(out, OUT, ScanLimits())
    assert found.files == [
        ("telemetry/fifo.jsonl", "jsonl"),
        ("telemetry/report.rank1.jsonl", "jsonl"),
    ]
    # The FIFO is found by name but never opened for reading (that would block).
    assert open_under(out, "telemetry/fifo.jsonl") is None
    assert open_under(out, "telemetry/report.rank0.jsonl") is None
    assert open_under(out, "tensorboard/report.rank0.jsonl") is None
    handle = open_under(out, "telemetry/report.rank1.jsonl")
    assert handle is not None
    with handle:
        assert handle.read() == b"x"
