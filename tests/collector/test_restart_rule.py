"""The restart rule, pure: the collector's marks plus the coordinator's place rule keep exactly
the points a plain replay of TensorBoard's reader keeps, whatever the events and files.

The model is the reader's algorithm written the simple way (a list of points, filtered in place
when a purge happens); the system under test is :class:`RunState` per file (each new file
starting from :func:`opening_state`) emitting marks, then :func:`orphaned` deciding each point
from its place alone, as the store does.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import RecordWriter

from tests.collector.tb_writers import tensorboard_scalars
from tuneplane.collector.tb_runs import RunState, opening_state, parse_file_version
from tuneplane.coordinator.orphans import Restart, SeriesRule, orphaned, place

TAGS = ("loss", "acc", "lr")


@attrs.frozen
class Ev:
    step: int
    file_version: str | None = None
    start: bool = False
    # None: no summary; otherwise (tag, value) pairs (an empty summary is still a summary).
    values: tuple[tuple[str, float], ...] | None = None


events = st.builds(
    Ev,
    step=st.integers(-3, 12),
    file_version=st.sampled_from([None, None, None, "brain.Event:2", "brain.Event:1", "x"]),
    start=st.booleans(),
    values=st.none()
    | st.lists(
        st.tuples(st.sampled_from(TAGS), st.floats(allow_nan=False, width=32)), max_size=3
    ).map(tuple),
)
# A run directory: files in name order, each a list of events.
runs = st.lists(st.lists(events, max_size=12), min_size=1, max_size=3)


def model(files: list[list[Ev]]) -> list[tuple[str, int, float]]:
    """plugin_event_accumulator's purge logic, replayed over the files in order."""
    kept: list[tuple[str, int, float]] = []
    version: float | None = None
    seen_start = False
    most_recent = -1
    for file in files:
        for ev in file:
            if ev.file_version is not None:
                version = parse_file_version(ev.file_version)
            if version and version >= 2:
                if ev.start:
                    if seen_start:
                        kept = [p for p in kept if p[1] < ev.step]
                    seen_start = True
            elif ev.values is not None and ev.step < most_recent:
                tags = {t for t, _ in ev.values}
                kept = [p for p in kept if p[0] not in tags or p[1] < ev.step]
            if ev.values is not None:
                most_recent = ev.step
                kept += [(t, ev.step, v) for t, v in ev.values]
    return kept


def system(files: list[list[Ev]]) -> list[tuple[str, int, float]]:
    """Per-file decoding with the carried state, then the coordinator's place rule."""
    points: list[tuple[str, str, int, int, float]] = []  # (source, tag, offset, step, value)
    restarts: list[Restart] = []
    snapshots: list[tuple[str, dict[str, object]]] = []
    for number, file in enumerate(files):
        source = f"tb/run/events.out.tfevents.{number:03d}"
        state = RunState.from_json(opening_state(source, snapshots).get("run"))
        for offset, ev in enumerate(file):
            tags = None if ev.values is None else tuple(t for t, _ in ev.values)
            orphans = state.event(
                ev.step, file_version=ev.file_version, session_start=ev.start, summary_tags=tags
            )
            if orphans is not False:
                restarts.append(
                    Restart(
                        source, offset, ev.step, None if orphans is None else frozenset(orphans)
                    )
                )
            for tag, value in ev.values or ():
                points.append((source, tag, offset, ev.step, value))
        snapshots.append((source, {"run": state.to_json()}))
    return [
        (tag, step, value)
        for source, tag, offset, step, value in points
        if not orphaned(restarts, source, tag, offset, step)
    ]


@settings(max_examples=400, deadline=None)
@given(runs)
def test_marks_and_places_keep_what_tensorboard_keeps(files: list[list[Ev]]) -> None:
    assert sorted(system(files)) == sorted(model(files))


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(-5, 5)), max_size=8), st.data())
def test_series_rule_agrees_with_the_plain_definition(
    marks: list[tuple[int, int]], data: st.DataObject
) -> None:
    """One binary search per point equals "some later mark has a step at most the point's"."""
    source = "tb/run/events.out.tfevents.001"
    restarts = [Restart(source, offset, step, None) for offset, step in marks]
    later = data.draw(st.lists(st.integers(-5, 5), max_size=2))
    restarts += [Restart("tb/run/events.out.tfevents.002", 0, s, None) for s in later]
    restarts += [Restart("tb/other/events.out.tfevents.009", 0, -9, None)]
    rule = SeriesRule.build(source, "loss", restarts)
    for offset in range(22):
        for step in range(-6, 7):
            plain = any(step >= s for o, s in marks if o > offset) or any(step >= s for s in later)
            assert rule.orphaned(offset, step) == plain


def test_only_event_files_belong_to_a_run() -> None:
    """A START orphans nothing in a JSONL file or the system samples, wherever they sort."""
    start = [Restart("tb/events.out.tfevents.9", 50, 0, None)]
    assert orphaned(start, "tb/events.out.tfevents.1", "loss", 10, 5)
    assert not orphaned(start, "tb/a.jsonl", "loss", 10, 5)
    assert not orphaned(start, "system", "system/gpu0/util", 10, 5)


def test_a_file_read_again_after_truncation_comes_after_its_first_reading() -> None:
    assert place("tb/run/events.out.tfevents.1") == ("tb/run", ("events.out.tfevents.1", 0))
    assert place("tb/run/events.out.tfevents.1#2") == ("tb/run", ("events.out.tfevents.1", 2))
    assert place("a#b") == ("", ("a#b", 0))


def test_the_first_start_of_a_run_orphans_nothing_and_the_second_does() -> None:
    state = RunState()
    assert state.event(0, file_version="brain.Event:2") is False
    assert state.event(0, session_start=True) is False
    assert state.event(9, summary_tags=("loss",)) is False
    assert state.event(5, session_start=True) is None


def test_without_file_version_a_step_going_back_orphans_its_own_tags() -> None:
    state = RunState()
    assert state.event(9, summary_tags=("loss", "acc")) is False
    assert state.event(4, summary_tags=("loss",)) == ("loss",)
    # The step that went back is now the most recent one: 5 is not out of order.
    assert state.event(5, summary_tags=("acc",)) is False
    # Events without a summary neither purge nor move the most recent step.
    assert state.event(1) is False
    assert state.event(2, summary_tags=("acc",)) == ("acc",)


one_kind_events = st.one_of(
    st.builds(Ev, step=st.integers(0, 12), file_version=st.sampled_from(["brain.Event:2", "x"])),
    st.builds(Ev, step=st.integers(0, 12), start=st.just(True)),
    st.builds(
        Ev,
        step=st.integers(0, 12),
        values=st.lists(
            st.tuples(st.sampled_from(TAGS), st.integers(-100, 100).map(float)),
            min_size=1,
            max_size=3,
            unique_by=lambda tv: tv[0],
        ).map(tuple),
    ),
)


def write_events(path: Path, file: list[Ev]) -> None:
    """Real TFRecord-framed Event protos, one oneof field each, as writers put them."""
    writer = RecordWriter(str(path))
    for ev in file:
        event = event_pb2.Event(step=ev.step, wall_time=1.7e9 + ev.step)
        if ev.file_version is not None:
            event.file_version = ev.file_version
        elif ev.start:
            event.session_log.status = event_pb2.SessionLog.START
        else:
            for tag, value in ev.values or ():
                event.summary.value.add(tag=tag, simple_value=value)
        writer.write(event.SerializeToString())
    writer.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(one_kind_events, max_size=10), min_size=1, max_size=3))
def test_the_model_is_what_tensorboards_own_reader_keeps(files: list[list[Ev]]) -> None:
    """The model above against the real reader over real files, so the model cannot drift."""
    with tempfile.TemporaryDirectory() as tmp:
        for number, file in enumerate(files):
            write_events(Path(tmp) / f"events.out.tfevents.{number:03d}.host", file)
        read = tensorboard_scalars(Path(tmp), purge=True)
    got = sorted((tag, step, value) for tag, pts in read.items() for step, _, value in pts)
    assert got == sorted(model(files))
    assert got == sorted(system(files))
