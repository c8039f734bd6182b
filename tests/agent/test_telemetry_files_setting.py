"""node.toml's [telemetry] max_files, and the output directory each member's collector is told
to follow. The collector's command line is built from a real journal's member record."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuneplane.agent import config
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.collectors import CollectorSupervisor
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import MemberKey, NewMember


def test_max_files_becomes_the_run_default(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[telemetry]\nmax_files = 64\nsystem_interval_s = 2\n")
    assert config.default_map(config.load(path))["run"] == {
        "telemetry_max_files": 64,
        "system_interval_s": 2.0,
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[telemetry]\nmax_files = 0\n", "'telemetry.max_files' is 0; give 1 to 100000"),
        ("[telemetry]\nmax_files = 1000000\n", "'telemetry.max_files' is 1000000; give 1"),
        ('[telemetry]\nmax_files = "64"\n', "'telemetry.max_files' must be"),
        ("[telemetry]\nmax_files = 6.5\n", "'telemetry.max_files' must be"),
    ],
)
def test_a_bad_max_files_is_refused_naming_the_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(config.NodeConfigError, match=re.escape(expected)):
        config.load(path)
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", "--config", str(path), "doctor"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert str(path) in done.stderr and expected in done.stderr


async def test_the_collector_follows_the_members_output_dir_with_the_cap(tmp_path: Path) -> None:
    key = MemberKey("run-000000000001", 1, 0)
    out_dir = tmp_path / "out" / "run-000000000001" / "attempt-1" / "member-0"
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        try:
            new = NewMember(key, 1, (0,), str(tmp_path / "member"), str(out_dir), 5, ())
            await journal.create_member(new, 1)
            record = await journal.member(key)
        finally:
            await journal.close()
    assert record is not None
    supervisor = CollectorSupervisor.under(
        tmp_path / "state", journal, tmp_path / "ca.pem", system_interval_s=0, max_files=7
    )
    supervisor._write_credential(key, "tpc_test", "127.0.0.1:7443")
    args = supervisor._args(record)
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--telemetry-dir"] == str(out_dir / "telemetry")
    assert flags["--out-dir"] == str(out_dir)
    assert flags["--max-files"] == "7"
