"""Telemetry decoding speed: our event-file reader against TensorBoard's loader, and JSONL.

Both readers decode the same file in the same process; each figure is the median of several
runs. ``TUNEPLANE_BENCH_SCALARS`` sets the number of scalars (default 1000000: our goal, at least
25x TensorBoard's loader, is set on a file of a million scalars).

Then delivery (bench/_delivery.py): the bounded query over a ``TUNEPLANE_BENCH_SERIES``-point
series (default 1000000), and write-to-queryable latency through a real coordinator, agent and
collector at ``TUNEPLANE_BENCH_RATE`` points/s (default 10000) for ``TUNEPLANE_BENCH_SECONDS``
(default 20).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboardX.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2

from bench._delivery import downsampling, end_to_end
from tuneplane.collector.files import read_file
from tuneplane.collector.tfrecord import frame

TAGS = ("train/loss", "train/lr", "eval/loss", "eval/acc")
#: What our reader should reach against TensorBoard's loader on the same file.
GOAL_SPEED_UP = 25


def write_event_file(path: Path, scalars: int) -> None:
    """Half TF1 simple_value, half new-style tensor scalars (metadata on first value only)."""
    chunks = [
        frame(
            event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
        )
    ]
    seen: set[str] = set()
    for i in range(scalars):
        tag = TAGS[i % len(TAGS)]
        step = i // len(TAGS)
        value = 1.0 / (step + 1)
        if tag.startswith("train/"):
            item = summary_pb2.Summary.Value(tag=tag, simple_value=value)
        else:
            tensor = tensor_pb2.TensorProto(
                dtype=1, tensor_shape=tensor_shape_pb2.TensorShapeProto()
            )
            tensor.float_val.append(value)
            item = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
            if tag not in seen:
                item.metadata.plugin_data.plugin_name = "scalars"
                seen.add(tag)
        event = event_pb2.Event(
            wall_time=1.7e9 + i, step=step, summary=summary_pb2.Summary(value=[item])
        )
        chunks.append(frame(event.SerializeToString()))
    path.write_bytes(b"".join(chunks))


def write_jsonl(path: Path, lines: int) -> None:
    with path.open("w") as handle:
        for step in range(lines):
            record = {
                "step": step,
                "metrics": {"train/loss": 1.0 / (step + 1), "train/lr": 1e-4},
                "wall_time": 1.7e9 + step,
            }
            handle.write(json.dumps(record) + "\n")


def ours(path: Path) -> int:
    points, warnings = read_file(path, path.name)
    if warnings:
        raise RuntimeError(f"benchmark file decoded with warnings: {warnings[0].describe()}")
    return len(points)


def tensorboard(path: Path) -> int:
    count = 0
    for event in EventFileLoader(str(path)).Load():
        if event.HasField("summary"):
            count += len(event.summary.value)
    return count


def median_seconds(fn: Callable[[Path], int], path: Path, runs: int, expect: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        got = fn(path)
        times.append(time.perf_counter() - start)
        if got != expect:
            raise RuntimeError(f"{fn.__name__} decoded {got} scalars, expected {expect}")
    return statistics.median(times)


def main() -> int:
    scalars = int(os.environ.get("TUNEPLANE_BENCH_SCALARS", "1000000"))
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events.out.tfevents.bench"
        write_event_file(events, scalars)
        size = events.stat().st_size
        ours_s = median_seconds(ours, events, 5, scalars)
        tb_s = median_seconds(tensorboard, events, 3, scalars)
        print(f"event file: {scalars} scalars, {size / 1e6:.1f} MB")
        print(f"  tuneplane reader   {scalars / ours_s:12,.0f} scalars/s  ({ours_s:.3f} s)")
        print(f"  tensorboard loader {scalars / tb_s:12,.0f} scalars/s  ({tb_s:.3f} s)")
        print(f"  speed-up           {tb_s / ours_s:12.1f}x  (goal: at least {GOAL_SPEED_UP}x)")
        lines = scalars // 2
        jsonl = Path(tmp) / "metrics.jsonl"
        write_jsonl(jsonl, lines)
        jsonl_s = median_seconds(ours, jsonl, 5, lines * 2)
        print(f"jsonl: {lines} lines, {jsonl.stat().st_size / 1e6:.1f} MB")
        print(f"  tuneplane reader   {lines / jsonl_s:12,.0f} lines/s    ({jsonl_s:.3f} s)")
        series = int(os.environ.get("TUNEPLANE_BENCH_SERIES", "1000000"))
        query_s = downsampling(Path(tmp), series)
        print(f"tp metrics downsampling: {series} points -> at most 1000 buckets (store query)")
        print(f"  median             {query_s:12.3f} s")
        rate = int(os.environ.get("TUNEPLANE_BENCH_RATE", "10000"))
        seconds = int(os.environ.get("TUNEPLANE_BENCH_SECONDS", "20"))
        e2e = end_to_end(Path(tmp), rate, seconds)
        print(f"end to end at {rate} points/s for {seconds} s (write -> queryable in the store)")
        print(f"  delivered          {e2e['stored']:12,.0f} of {e2e['written']:,.0f} points")
        print(f"  median latency     {e2e['median']:12.3f} s")
        print(f"  p99 latency        {e2e['p99']:12.3f} s")
        print(f"  max latency        {e2e['max']:12.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
