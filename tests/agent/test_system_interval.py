"""node.toml's [telemetry] system_interval_s, and what the agent tells each member's collector.

The collector's command line is built from a real journal's member record, as the agent builds it.
"""

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

UUIDS = ("GPU-1111aaaa-1111-2222-3333-444444444444", "GPU-2222bbbb-1111-2222-3333-444444444444")


def test_the_interval_becomes_the_run_default(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[telemetry]\nsystem_interval_s = 2\n")
    assert config.default_map(config.load(path))["run"] == {"system_interval_s": 2.0}
    path.write_text("[telemetry]\nsystem_interval_s = 0.5\n")
    assert config.default_map(config.load(path))["run"] == {"system_interval_s": 0.5}
    path.write_text("[telemetry]\n")
    assert "run" not in config.default_map(config.load(path))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[telemetry]\nsystem_interval_s = "5"\n', "'telemetry.system_interval_s' must be"),
        ("[telemetry]\nsystem_interval_s = -1\n", "give 0 (no GPU and process samples)"),
        ("[telemetry]\nsystem_interval_s = 7200\n", "to 3600 seconds"),
        ("[telemetry]\ninterval = 5\n", "unknown key 'telemetry.interval'"),
        ("telemetry = 5\n", "'telemetry' must be a table"),
    ],
)
def test_a_bad_interval_is_refused_naming_the_key(tmp_path: Path, text: str, expected: str) -> None:
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


async def test_the_collector_is_told_the_members_gpus_runner_and_nvml(tmp_path: Path) -> None:
    key = MemberKey("run-000000000001", 1, 0)
    member_dir = tmp_path / "members" / str(key)
    script = tmp_path / "nvml.json"
    release = tmp_path / "gpu-release.json"
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        try:
            # The member was given index 1 then index 0: its rank order is kept.
            new = NewMember(key, 1, (1, 0), str(member_dir), str(tmp_path / "out"), 5, UUIDS)
            await journal.create_member(new, 1)
            record = await journal.member(key)
        finally:
            await journal.close()
    assert record is not None

    root, ca = tmp_path, tmp_path / "ca.pem"
    scripted = CollectorSupervisor.under(
        root, journal, ca, system_interval_s=0.25, scripted_nvml=script, gpu_release_file=release
    )
    assert scripted._system_args(record) == [
        "--system-interval", "0.25", "--member-dir", str(member_dir),
        "--gpu", UUIDS[0], "--gpu", UUIDS[1],
        "--scripted-nvml", str(script), "--gpu-release-file", str(release),
    ]  # fmt: skip
    # Simulated GPUs: nothing to read through NVML, the process tree still sampled.
    simulated = CollectorSupervisor.under(root, journal, ca, system_interval_s=5, sample_gpus=False)
    assert simulated._system_args(record) == [
        "--system-interval", "5", "--member-dir", str(member_dir),
    ]  # fmt: skip
    off = CollectorSupervisor.under(root, journal, ca, system_interval_s=0)
    assert off._system_args(record) == []
