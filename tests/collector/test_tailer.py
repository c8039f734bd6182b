"""The tailer on real files and a real writer process: appends, partial records, corruption,
rotation, copytruncate, reused inodes, drain and restart from the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import pytest
import trio
from tensorboardX.proto import event_pb2, summary_pb2

from tests.collector.tb_writers import tensorboard_scalars
from tuneplane.collector.batches import Batch
from tuneplane.collector.bound_notices import NOT_FOLLOWED, WALK_LIMITED
from tuneplane.collector.checkpoint import CheckpointError
from tuneplane.collector.files import Layout, ScanLimits
from tuneplane.collector.points import ReadWarning, ScalarPoint
from tuneplane.collector.tailer import Tailer
from tuneplane.collector.tfrecord import frame

DEADLINE = 20.0


@attrs.define
class Sink:
    """Stands in for the spool: keeps what it was given, commits unless told not to."""

    points: list[ScalarPoint] = attrs.field(factory=list)
    warnings: list[ReadWarning] = attrs.field(factory=list)
    batches: list[Batch] = attrs.field(factory=list)
    commit: bool = True


async def consume(tailer: Tailer, receive: trio.MemoryReceiveChannel[Batch], sink: Sink) -> None:
    async with receive:
        async for batch in receive:
            sink.points += batch.points
            sink.warnings += batch.warnings
            sink.batches.append(batch)
            if sink.commit:
                await tailer.commit(batch)


async def wait_for(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(DEADLINE):
        while not predicate():
            await trio.sleep(0.01)


async def polls(tailer: Tailer, count: int) -> None:
    """Wait until the tailer completed ``count`` more polls."""
    target = tailer.statistics().polls + count
    await wait_for(lambda: tailer.statistics().polls >= target)


async def tail(
    root: Path,
    checkpoint: Path,
    during: Callable[[Tailer, Sink], Awaitable[None]],
    *,
    commit: bool = True,
    layout: Layout | None = None,
    limits: ScanLimits | None = None,
    source_prefix: str = "",
) -> tuple[Tailer, Sink]:
    """Run a tailer on ``root`` while ``during`` acts, then signal writers done and drain."""
    tailer = Tailer(
        root, checkpoint, poll_interval=0.01, layout=layout, limits=limits,
        source_prefix=source_prefix,
    )  # fmt: skip
    sink = Sink(commit=commit)
    done = trio.Event()
    send, receive = trio.open_memory_channel[Batch](0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tailer.run, send, done)
        nursery.start_soon(consume, tailer, receive, sink)
        await during(tailer, sink)
        done.set()
    return tailer, sink


def event(step: int, value: float, tag: str = "loss") -> bytes:
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
    return frame(
        event_pb2.Event(
            wall_time=1700000000.0 + step, step=step, summary=summary
        ).SerializeToString()
    )


def line(step: int) -> bytes:
    return f'{{"step": {step}, "loss": {step / 10}}}\n'.encode()


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(data)


def steps(sink: Sink) -> list[int]:
    return sorted(p.step for p in sink.points)


WRITER = textwrap.dedent(
    """
    import sys, time
    from tensorboardX import SummaryWriter
    from tuneplane.report import finish, init, log

    logdir = sys.argv[1]
    writer = SummaryWriter(logdir + "/tb", flush_secs=3600)
    init({"lr": 0.1}, dir=logdir)
    for step in range(200):
        writer.add_scalar("train/loss", 1.0 / (step + 1), step)
        writer.add_scalar("train/lr", 0.1 * 0.99 ** step, step)
        log({"eval/acc": step / 200}, step=step)
        if step % 20 == 19:
            writer.flush()
            time.sleep(0.02)
    writer.close()
    finish()
    """
)


async def test_follows_a_writer_process_to_the_end(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()

    async def run_writer(tailer: Tailer, sink: Sink) -> None:
        # The tailer is already polling when the writer starts and sees files appear mid-run.
        await polls(tailer, 2)
        await trio.run_process([sys.executable, "-c", WRITER, str(root)])

    tailer, sink = await tail(root, tmp_path / "ckpt.json", run_writer)
    assert sink.warnings == []
    expected = tensorboard_scalars(root / "tb")
    got: dict[str, list[tuple[int, float, float]]] = {}
    for p in sink.points:
        if p.source.startswith("tb/"):
            assert p.wall_time is not None
            got.setdefault(p.tag, []).append((p.step, p.wall_time, p.value))
    # The event file's directory is its run, as TensorBoard names it, in front of its tags.
    assert got == {f"tb/{tag}": values for tag, values in expected.items()}
    acc = [p for p in sink.points if p.tag == "eval/acc"]
    assert [p.step for p in acc] == list(range(200))
    assert acc[0].source == "report.rank0.jsonl"
    keys = [p.dedup_key for p in sink.points]
    assert len(keys) == len(set(keys)) == 600
    stats = tailer.statistics()
    assert stats.batches_committed == stats.batches_sent
    assert stats.points == 600


async def test_half_written_record_is_waited_for_then_read(tmp_path: Path) -> None:
    root = tmp_path / "tb"
    root.mkdir()
    path = root / "events.out.tfevents.1.host"
    second = event(1, 0.5)

    async def writer(tailer: Tailer, sink: Sink) -> None:
        path.write_bytes(event(0, 1.0) + second[:20])
        await wait_for(lambda: len(sink.points) == 1)
        await polls(tailer, 3)
        assert len(sink.points) == 1 and sink.warnings == []
        append(path, second[20:])
        await wait_for(lambda: len(sink.points) == 2)

    _, sink = await tail(root, tmp_path / "ckpt.json", writer)
    assert [(p.step, p.value) for p in sink.points] == [(0, 1.0), (1, 0.5)]
    assert sink.warnings == []


async def test_corrupt_record_is_counted_and_later_ones_read(tmp_path: Path) -> None:
    root = tmp_path / "tb"
    root.mkdir()
    records = [bytearray(event(s, float(s))) for s in range(10)]
    records[4][-6] ^= 0xFF  # data byte of step 4: its data CRC no longer matches
    records[7][3] ^= 0xFF  # length of step 7: the reader must resync
    (root / "events.out.tfevents.2.host").write_bytes(b"".join(records))

    async def nothing(tailer: Tailer, sink: Sink) -> None:
        await polls(tailer, 1)

    tailer, sink = await tail(root, tmp_path / "ckpt.json", nothing)
    assert steps(sink) == [0, 1, 2, 3, 5, 6, 8, 9]
    offset4 = sum(len(r) for r in records[:4])
    offset7 = sum(len(r) for r in records[:7])
    assert [(w.kind, w.offset, w.source) for w in sink.warnings] == [
        ("bad-data-crc", offset4, "events.out.tfevents.2.host"),
        ("bad-length-crc", offset7, "events.out.tfevents.2.host"),
    ]
    assert tailer.statistics().data_loss_warnings == 2


async def test_rotation_by_rename_reads_everything_once(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    path = root / "metrics.jsonl"

    async def rotate(tailer: Tailer, sink: Sink) -> None:
        path.write_bytes(b"".join(line(s) for s in range(5)))
        await wait_for(lambda: len(sink.points) == 5)
        with path.open("ab") as old:
            os.rename(path, root / "metrics.jsonl.1")
            path.write_bytes(b"".join(line(s) for s in range(10, 13)))
            old.write(b"".join(line(s) for s in range(5, 8)))  # the writer's open handle
        await wait_for(lambda: len(sink.points) == 11)

    _, sink = await tail(root, tmp_path / "ckpt.json", rotate)
    assert steps(sink) == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12]
    sources = {(p.step, p.source_id, p.source) for p in sink.points}
    assert (6, "metrics.jsonl", "metrics.jsonl.1") in sources
    assert (11, "metrics.jsonl#1", "metrics.jsonl") in sources
    assert sink.warnings == []


async def test_copytruncate_loses_and_repeats_nothing(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    path = root / "metrics.jsonl"

    async def copytruncate(tailer: Tailer, sink: Sink) -> None:
        path.write_bytes(b"".join(line(s) for s in range(5)))
        await wait_for(lambda: len(sink.points) == 5)
        # What logrotate's copytruncate does, with lines landing just before the copy.
        append(path, line(5) + line(6))
        shutil.copyfile(path, root / "metrics.jsonl.1")
        os.truncate(path, 0)
        append(path, line(7) + line(8))
        await wait_for(lambda: len(sink.points) == 9)

    tailer, sink = await tail(root, tmp_path / "ckpt.json", copytruncate)
    assert steps(sink) == list(range(9))
    stats = tailer.statistics()
    assert stats.truncations + stats.replacements == 1
    assert stats.adoptions == 1
    assert [w.kind for w in sink.warnings] in (["truncated"], ["replaced"])
    assert not sink.warnings[0].data_loss


async def test_same_inode_with_new_bytes_starts_a_new_stream(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    path = root / "metrics.jsonl"

    async def reuse(tailer: Tailer, sink: Sink) -> None:
        path.write_bytes(line(1) + line(2))
        await wait_for(lambda: len(sink.points) == 2)
        inode = path.stat().st_ino
        # What a reused inode looks like from outside: same device and inode, other bytes,
        # and no shorter than what was read, so only the head tells them apart.
        with path.open("r+b") as handle:
            handle.write(b"".join(line(s) for s in (31, 32, 33)))
        assert path.stat().st_ino == inode
        await wait_for(lambda: len(sink.points) == 5)

    tailer, sink = await tail(root, tmp_path / "ckpt.json", reuse)
    assert steps(sink) == [1, 2, 31, 32, 33]
    assert tailer.statistics().replacements == 1
    assert {p.source_id for p in sink.points if p.step > 30} == {"metrics.jsonl#1"}


async def test_restart_rereads_only_what_was_not_committed(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    path = root / "metrics.jsonl"
    checkpoint = tmp_path / "ckpt.json"
    path.write_bytes(b"".join(line(s) for s in range(4)))

    async def read_all(tailer: Tailer, sink: Sink) -> None:
        await wait_for(lambda: len(sink.points) == 4)

    # First run: the consumer never made anything durable (a crash before the spool wrote).
    _, lost = await tail(root, checkpoint, read_all, commit=False)
    assert checkpoint.exists()  # the stream table was saved before any point went out
    _, again = await tail(root, checkpoint, read_all)
    assert [p.dedup_key for p in again.points] == [p.dedup_key for p in lost.points]
    append(path, line(4) + line(5))

    async def more(tailer: Tailer, sink: Sink) -> None:
        await wait_for(lambda: len(sink.points) == 2)

    _, third = await tail(root, checkpoint, more)
    assert steps(third) == [4, 5]


async def test_commit_is_idempotent_and_cumulative(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    checkpoint = tmp_path / "ckpt.json"
    (root / "a.jsonl").write_bytes(line(1))
    (root / "b.jsonl").write_bytes(line(2))

    async def read_both(tailer: Tailer, sink: Sink) -> None:
        await wait_for(lambda: len(sink.points) == 2)

    tailer, sink = await tail(root, checkpoint, read_both, commit=False)
    last = sink.batches[-1]
    await tailer.commit(last)
    before = checkpoint.read_bytes()
    await tailer.commit(last)
    await tailer.commit(sink.batches[0])
    assert checkpoint.read_bytes() == before
    _, after = await tail(root, checkpoint, lambda t, s: polls(t, 1))
    assert after.points == []


async def test_drain_reports_a_half_written_last_line(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    (root / "m.jsonl").write_bytes(line(1) + b'{"step": 2, "lo')

    _, sink = await tail(root, tmp_path / "ckpt.json", lambda t, s: polls(t, 2))
    assert steps(sink) == [1]
    assert [(w.kind, w.line) for w in sink.warnings] == [("truncated-line", 2)]


async def test_tailer_refuses_another_directory_s_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt.json"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m.jsonl").write_bytes(line(1))
    await tail(tmp_path / "a", checkpoint, lambda t, s: polls(t, 1))
    with pytest.raises(CheckpointError, match="give each member its own checkpoint"):
        Tailer(tmp_path / "b", checkpoint)
    checkpoint.write_text("{not json")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        Tailer(tmp_path / "a", checkpoint)


async def test_checkpoint_reaches_the_end_even_without_points(tmp_path: Path) -> None:
    root = tmp_path / "telemetry"
    root.mkdir()
    path = root / "m.jsonl"
    checkpoint = tmp_path / "ckpt.json"

    async def hparams_last(tailer: Tailer, sink: Sink) -> None:
        path.write_bytes(line(1))
        await wait_for(lambda: len(sink.points) == 1)
        append(path, b'{"hparams": {"lr": 0.1}}\n')  # read only by the drain; no points

    _, sink = await tail(root, checkpoint, hparams_last)
    assert sink.batches[-1].points == [] and sink.batches[-1].warnings == []
    (stream,) = json.loads(checkpoint.read_text())["tracker"]["streams"]
    assert stream["committed"] == path.stat().st_size


OUT_WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    from tensorboardX import SummaryWriter
    from tuneplane.report import finish, init, log

    out = sys.argv[1]
    # The script's own log directory and TENSORBOARD_LOGDIR's run sub-directory, both made
    # after the tailer started, and a data file of the researcher's own that is not metrics.
    mine = SummaryWriter(out + "/tb/run1", flush_secs=3600)
    logdir = SummaryWriter(out + "/tensorboard/run2", flush_secs=3600)
    init(dir=out + "/eval")
    os.makedirs(out + "/data", exist_ok=True)
    with open(out + "/data/train.jsonl", "w") as data:
        data.write(json.dumps({"step": 1, "loss": 5.0}) + "\\n")
    for step in range(100):
        mine.add_scalar("loss", 1.0 / (step + 1), step)
        logdir.add_scalar("loss", 2.0 / (step + 1), step)
        log({"acc": step / 100}, step=step)
        if step % 20 == 19:
            mine.flush()
            logdir.flush()
            time.sleep(0.02)
    mine.close()
    logdir.close()
    finish()
    """
)


async def test_an_output_directory_is_followed_in_its_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "telemetry").mkdir(parents=True)

    async def run_writer(tailer: Tailer, sink: Sink) -> None:
        await polls(tailer, 2)
        await trio.run_process([sys.executable, "-c", OUT_WRITER, str(out)])

    layout = Layout.output_dir("telemetry")
    _, sink = await tail(out, tmp_path / "ckpt.json", run_writer, layout=layout)
    assert sink.warnings == []
    got: dict[str, list[tuple[int, float]]] = {}
    for p in sink.points:
        got.setdefault(p.tag, []).append((p.step, p.value))
    # Two writers' "loss" stay apart, each under its run, as TensorBoard shows them.
    assert sorted(got) == ["eval/acc", "run2/loss", "tb/run1/loss"]
    for tag, logdir in (
        ("tb/run1/loss", out / "tb" / "run1"),
        ("run2/loss", out / "tensorboard" / "run2"),
    ):
        (values,) = tensorboard_scalars(logdir).values()
        assert got[tag] == [(step, value) for step, _, value in values]
    assert [p.step for p in sink.points if p.tag == "eval/acc"] == list(range(100))
    assert {p.source for p in sink.points if p.tag == "eval/acc"} == {"eval/report.rank0.jsonl"}


async def test_a_source_prefix_changes_the_source_ids_and_keeps_the_tags(tmp_path: Path) -> None:
    """A requeued Slurm run's collector (``restart-1/``): the same files, the same tags (with
    their run), other dedup keys; the first run's collector (no prefix) keeps the files' paths."""
    out = tmp_path / "out"
    (out / "telemetry").mkdir(parents=True)
    (out / "tb" / "run1").mkdir(parents=True)
    (out / "telemetry" / "m.jsonl").write_bytes(line(1) + line(2))
    (out / "tb" / "run1" / "events.out.tfevents.1.host").write_bytes(event(1, 0.5))
    layout = Layout.output_dir("telemetry")

    async def nothing(tailer: Tailer, sink: Sink) -> None:
        await polls(tailer, 2)

    seen: dict[str, set[tuple[str, str, str]]] = {}
    for prefix in ("", "restart-1/"):
        _, sink = await tail(out, tmp_path / f"ckpt{len(prefix)}.json", nothing, layout=layout,
                             source_prefix=prefix)  # fmt: skip
        seen[prefix] = {(p.source_id, p.source, p.tag) for p in sink.points}
    assert seen[""] == {
        ("telemetry/m.jsonl", "telemetry/m.jsonl", "loss"),
        ("tb/run1/events.out.tfevents.1.host", "tb/run1/events.out.tfevents.1.host",
         "tb/run1/loss"),
    }  # fmt: skip
    assert seen["restart-1/"] == {(f"restart-1/{i}", s, t) for i, s, t in seen[""]}


async def test_the_file_cap_is_said_once_and_survives_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for name in ("a", "b", "c"):
        (out / "telemetry" / name).mkdir(parents=True)
        (out / "telemetry" / name / "m.jsonl").write_bytes(line(1))
    checkpoint = tmp_path / "ckpt.json"
    layout = Layout.output_dir("telemetry")
    limits = ScanLimits(max_files=2)

    async def more(tailer: Tailer, sink: Sink) -> None:
        await polls(tailer, 3)
        append(out / "telemetry" / "a" / "m.jsonl", line(2))
        await polls(tailer, 2)

    tailer, sink = await tail(out, checkpoint, more, layout=layout, limits=limits)
    (notice,) = sink.warnings
    assert notice.kind == NOT_FOLLOWED and notice.data_loss
    assert notice.source == "telemetry/c/m.jsonl"
    assert "1 telemetry file(s) are not followed" in notice.message
    assert tailer.statistics().files_not_followed == 1
    assert sorted((p.tag, p.step) for p in sink.points) == [("a/loss", 1), ("a/loss", 2),
                                                            ("b/loss", 1)]  # fmt: skip
    # A restarted tailer (same checkpoint) follows the same files and does not say it again.
    append(out / "telemetry" / "b" / "m.jsonl", line(2))
    again, sink = await tail(
        out, checkpoint, lambda t, s: polls(t, 2), layout=layout, limits=limits
    )
    assert sink.warnings == []
    assert [(p.tag, p.step) for p in sink.points] == [("b/loss", 2)]
    assert again.statistics().files_not_followed == 1


async def test_a_walk_cut_short_is_said_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "telemetry").mkdir(parents=True)
    (out / "telemetry" / "m.jsonl").write_bytes(line(1))
    deep = out / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "events.out.tfevents.1.host").write_bytes(event(1, 0.5))
    layout = Layout.output_dir("telemetry")
    limits = ScanLimits(max_depth=2)
    tailer, sink = await tail(
        out, tmp_path / "ckpt.json", lambda t, s: polls(t, 3), layout=layout, limits=limits
    )
    (notice,) = sink.warnings
    assert notice.kind == WALK_LIMITED and notice.data_loss
    assert "directories at most 2 deep" in notice.message
    assert [(p.tag, p.step) for p in sink.points] == [("loss", 1)]
    assert tailer.statistics().walk_limited
