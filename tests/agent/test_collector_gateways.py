"""A Commit's telemetry gateway and its fallbacks reach the member's collector: kept in the
collector's collector.json (so a collector a restarted agent starts gets them too) and passed
as ``--gateway``, the Commit's first. A real journal holds the member."""

from __future__ import annotations

import json
from pathlib import Path

from tuneplane.agent import messages as m
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.collectors import CONFIG_FILE, CollectorSupervisor
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import MemberKey, MemberRecord, NewMember

KEY = MemberKey("run-000000000001", 1, 0)


def _gateways(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--gateway"]


async def _committed(tmp_path: Path, command: m.Commit) -> tuple[CollectorSupervisor, MemberRecord]:
    out_dir = tmp_path / "out"
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        try:
            new = NewMember(KEY, 1, (0,), str(tmp_path / "member"), str(out_dir), 5, ())
            await journal.create_member(new, 1)
            supervisor = CollectorSupervisor.under(
                tmp_path / "state", journal, tmp_path / "ca.pem", system_interval_s=0
            )
            await supervisor.accept_commit(command)
            record = await journal.member(KEY)
        finally:
            await journal.close()
    assert record is not None
    return supervisor, record


async def test_the_collector_is_given_the_gateway_then_each_fallback(tmp_path: Path) -> None:
    commit = m.Commit(KEY, None, "tpc_test", "10.0.0.1:7445", ("10.0.0.2:7445", "10.0.0.3:7445"))
    supervisor, record = await _committed(tmp_path, commit)
    config = json.loads((supervisor.directory(KEY) / CONFIG_FILE).read_text())
    assert config["fallbacks"] == ["10.0.0.2:7445", "10.0.0.3:7445"]
    # What a restarted agent's supervisor reads: the same file, the same command line.
    again = CollectorSupervisor.under(tmp_path / "state", supervisor.journal, tmp_path / "ca.pem")
    for each in (supervisor, again):
        assert _gateways(each._args(record)) == [
            "10.0.0.1:7445",
            "10.0.0.2:7445",
            "10.0.0.3:7445",
        ]


async def test_a_repeated_commit_replaces_the_gateways(tmp_path: Path) -> None:
    first = m.Commit(KEY, None, "tpc_one", "10.0.0.1:7445", ("10.0.0.2:7445",))
    supervisor, record = await _committed(tmp_path, first)
    supervisor._write_credential(KEY, "tpc_two", "10.0.0.2:7445", ("10.0.0.1:7445",))
    assert _gateways(supervisor._args(record)) == ["10.0.0.2:7445", "10.0.0.1:7445"]


async def test_a_collector_json_from_before_fallbacks_gives_one_gateway(tmp_path: Path) -> None:
    supervisor, record = await _committed(tmp_path, m.Commit(KEY, None, "tpc_x", "10.0.0.1:7445"))
    path = supervisor.directory(KEY) / CONFIG_FILE
    path.write_text(json.dumps({"gateway": "10.0.0.1:7445", "ca": str(tmp_path / "ca.pem")}))
    assert _gateways(supervisor._args(record)) == ["10.0.0.1:7445"]
