"""``tuneplane-collector inspect`` as a real process: JSON lines, the table, and bad paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.collector.tb_writers import write_simple
from tuneplane.collector.tfrecord import frame


def collector(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def make_run(root: Path) -> None:
    write_simple(root / "tb", {"loss": [(0, 1.0), (1, 0.5)]})
    (root / "metrics.jsonl").write_bytes(
        b'{"step": 0, "metrics": {"acc": 0.25}, "wall_time": 1700000000.5}\n'
        b"oops\n"
        b'{"step": 1, "acc": "high"}\n'
    )
    (root / "notes.txt").write_text("not telemetry")


def test_inspect_json_lines_cover_points_and_warnings(tmp_path: Path) -> None:
    make_run(tmp_path)
    done = collector("inspect", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    points = [r for r in records if r["type"] == "point"]
    warnings = [r for r in records if r["type"] == "warning"]
    assert [(p["source"], p["tag"], p["step"], p["value"]) for p in points] == [
        ("metrics.jsonl", "acc", 0, 0.25),
        # The event file's directory is its run, in front of its tags, as the collector ships.
        (points[1]["source"], "tb/loss", 0, 1.0),
        (points[1]["source"], "tb/loss", 1, 0.5),
    ]
    assert points[1]["source"].startswith("tb/events.out.tfevents.")
    assert points[0]["wall_time"] == 1700000000.5 and points[0]["offset"] == 0
    assert [(w["source"], w["line"], w["kind"], w["data_loss"]) for w in warnings] == [
        ("metrics.jsonl", 2, "malformed-line", True),
        ("metrics.jsonl", 3, "non-numeric", True),
    ]


def test_inspect_table_names_the_corruption(tmp_path: Path) -> None:
    bad = bytearray(frame(b"\x10\x01"))
    bad[-1] ^= 1
    path = tmp_path / "events.out.tfevents.9.host"
    path.write_bytes(bytes(bad))
    done = collector("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "data loss (bad-data-crc) events.out.tfevents.9.host at byte 0" in done.stdout
    assert "0 points, 1 warnings (1 data loss)" in done.stdout


def test_inspect_refuses_what_is_not_telemetry(tmp_path: Path) -> None:
    make_run(tmp_path)
    done = collector("inspect", str(tmp_path / "notes.txt"))
    assert done.returncode == 2
    assert "is not a telemetry file" in done.stderr
    missing = collector("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr


def test_inspect_an_output_dir_reads_what_the_collector_follows(tmp_path: Path) -> None:
    write_simple(tmp_path / "tb" / "run1", {"loss": [(0, 1.0)]})
    write_simple(tmp_path / "tensorboard", {"lr": [(0, 0.25)]})
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "metrics.jsonl").write_bytes(b'{"step": 0, "acc": 0.5}\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(b'{"step": 0, "loss": 9.0}\n')
    done = collector("inspect", str(tmp_path), "--output-dir", "--json")
    assert done.returncode == 0, done.stderr
    points = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted((p["tag"], p["value"]) for p in points) == [
        ("acc", 0.5),
        ("lr", 0.25),
        ("tb/run1/loss", 1.0),
    ]
    done = collector("inspect", str(tmp_path / "data" / "train.jsonl"), "--output-dir")
    assert done.returncode == 2
    assert "is not a directory; --output-dir takes a member's $TUNEPLANE_OUT_DIR" in done.stderr


# What `tuneplane-collector run` imports before it follows anything (collector/cli.py: run).
_RUN_IMPORTS = """
import sys
import tuneplane.collector.cli
from tuneplane.collector import files, options, service, ship_wire, spool, system_sampler
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] == "rich")))
"""


def test_a_members_collector_does_not_import_the_inspect_table() -> None:
    """Every member runs a collector: rich, for `inspect`'s table alone, stays out of it."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN_IMPORTS], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
