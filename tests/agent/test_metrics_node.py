"""The Node's metrics where they are observed: the session's heartbeat RTT (pure), a real
journal's COMMIT timing and counts, GPUs by state and health, real collector spools, and the
[metrics] table of node.toml."""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import pytest

from tuneplane.agent import config as node_config
from tuneplane.agent import messages as m
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.inventory import SimulatedGpus, simulated_inventory
from tuneplane.agent.journal import Journal
from tuneplane.agent.metrics import SNAPSHOT, gpu_counts, read_spools, refresh_snapshot
from tuneplane.agent.metrics_listener import MetricsListener
from tuneplane.agent.session import ControlSession, HeartbeatAcked, Send
from tuneplane.collector.points import ReadWarning, ScalarPoint
from tuneplane.collector.spool import SPOOL_FILE, Spool

INV = simulated_inventory("node-a", SimulatedGpus("h200", 3))
WELCOME = m.Welcome(heartbeat_interval_ms=500, heartbeat_timeout_ms=3000, server_time_ms=0)


def test_the_acknowledgement_of_the_latest_heartbeat_carries_its_round_trip() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    s.receive(0.0, WELCOME)
    (beat,) = s.tick(0.5, 0, INV)
    assert isinstance(beat, Send) and isinstance(beat.message, m.Heartbeat)
    seq = beat.message.seq
    assert s.receive(0.75, m.HeartbeatAck(seq)) == [HeartbeatAcked(seq, 0.25)]
    # An acknowledgement of an older beat (a late one) gives no RTT: its send time is gone.
    s.tick(1.0, 0, INV)
    assert s.receive(1.1, m.HeartbeatAck(seq)) == [HeartbeatAcked(seq, None)]


def test_gpus_are_counted_by_owner_and_health() -> None:
    first, second, third = INV.gpus
    inventory = attrs.evolve(
        INV, gpus=(first, attrs.evolve(second, healthy=False, health_reason="XID 79"), third)
    )
    # The first owned by UUID, the third by index (a reservation made before UUIDs).
    counts = gpu_counts(inventory, {first.uuid}, {third.index})
    assert counts == {
        ("owned", "healthy"): 2,
        ("owned", "unhealthy"): 0,
        ("free", "healthy"): 0,
        ("free", "unhealthy"): 1,
    }


async def test_a_journal_write_reports_its_commit_time_and_counts_read_back(
    tmp_path: Path,
) -> None:
    seen: list[float] = []
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        try:
            assert await journal.counts() == ({}, 0)
            journal.on_commit = seen.append
            await journal.set_meta("probe", "1")
            await journal.node_event(0, "probe")
        finally:
            await journal.close()
    assert len(seen) == 2 and all(0 < s < 5 for s in seen)


def _point(offset: int) -> ScalarPoint:
    return ScalarPoint("a.jsonl", "loss", offset, time.time(), 0.5, offset, 0, "src")


def test_undelivered_spools_are_summed_and_drained_or_broken_ones_skipped(
    tmp_path: Path,
) -> None:
    root = tmp_path / "collectors"
    assert read_spools(root).spools == 0  # no collector ever ran
    for name, points, lost, drained in (
        ("run-a.1.0", 3, 1, False),
        ("run-b.1.0", 2, 0, False),
        ("run-c.1.0", 7, 2, True),
    ):
        folder = root / name
        folder.mkdir(parents=True)
        spool = Spool.open(folder / SPOOL_FILE)
        warnings = [ReadWarning("a.jsonl", 100 + i, "bad-line", "unreadable") for i in range(lost)]
        spool.append([_point(i) for i in range(points)], warnings)
        spool.close()
        if drained:
            (folder / "drained").write_text("")
    broken = root / "run-d.1.0"
    broken.mkdir()
    (broken / SPOOL_FILE).write_bytes(b"not a database" * 100)
    figures = read_spools(root)
    assert (figures.spools, figures.points, figures.data_loss_warnings) == (2, 5, 1)


def _node_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_metrics_are_off_without_the_table_and_loopback_by_default(tmp_path: Path) -> None:
    assert node_config.metrics_settings(node_config.load(_node_toml(tmp_path, ""))) is None
    settings = node_config.load(_node_toml(tmp_path, "[metrics]\n"))
    assert node_config.metrics_settings(settings) == MetricsListener("127.0.0.1", 7447)
    settings = node_config.load(_node_toml(tmp_path, '[metrics]\nhost = "::"\nport = 9100\n'))
    assert node_config.metrics_settings(settings) == MetricsListener("::", 9100)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("metrics = 1\n", "'metrics' must be a table"),
        ('[metrics]\nport = "80"\n', "[metrics] port = '80' must be a whole number"),
        ("[metrics]\nport = true\n", "[metrics] port = True must be a whole number"),
        ('[metrics]\nhost = "my-host"\n', "[metrics] host = 'my-host' is not an IP address"),
        ("[metrics]\nbind = 1\n", "[metrics] has unknown key(s) bind"),
    ],
)
def test_wrong_metrics_settings_are_refused_naming_the_file_and_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = _node_toml(tmp_path, text)
    with pytest.raises(node_config.NodeConfigError) as refused:
        node_config.load(path)
    assert str(refused.value).startswith(f"{path}: ")
    assert expected in str(refused.value)


async def test_a_snapshot_read_that_fails_keeps_the_last_one_and_never_raises(
    tmp_path: Path,
) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        await journal.node_event(0, "probe")
        assert await refresh_snapshot(journal, INV, tmp_path / "collectors")
        good = SNAPSHOT.latest
        assert good is not None and good.gpus[("free", "healthy")] == 3
        await journal.close()
        # The journal is gone (a disk error would look the same): the agent carries on.
        assert not await refresh_snapshot(journal, INV, tmp_path / "collectors")
        assert SNAPSHOT.latest is good
