"""The shipped systemd units, checked by systemd's own tools (no running systemd needed).

``systemd-analyze verify`` loads each unit as systemd would (unknown keys, bad values, a
missing binary are errors); ``systemd-analyze security --offline=true`` rates its sandbox, and the
rating may not get worse than it is today. The binaries under /opt/tuneplane do not exist here,
so each unit is checked as a copy pointing at this checkout's installed commands. Where systemd's
tools are missing the tests skip with a sentence (under CI=true they fail).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.accounts import require

UNITS = Path(__file__).resolve().parents[2] / "packaging" / "systemd"
INSTALLED = "/opt/tuneplane/bin/"
# Exposure ratings (0 safest, 10 least safe) measured when each unit was hardened. The Node's
# agent must stay root to switch members' accounts, so its floor is higher.
MAX_EXPOSURE = {"tuneplane-node.service": 7.0, "tuneplane-coordinator.service": 2.5}


def _analyze() -> str:
    found = shutil.which("systemd-analyze")
    require(found is not None, "systemd-analyze (Debian's systemd package)")
    assert found is not None
    return found


def _local_copy(unit: str, tmp_path: Path) -> Path:
    """The unit with its ExecStart pointing at this environment's command of the same name."""
    text = (UNITS / unit).read_text()
    bin_dir = Path(sys.executable).parent
    copy = tmp_path / unit
    copy.write_text(text.replace(INSTALLED, f"{bin_dir}/"))
    return copy


@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_the_unit_loads_cleanly(unit: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [_analyze(), "verify", str(_local_copy(unit, tmp_path))],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert unit not in done.stderr, done.stderr


@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_the_units_sandbox_does_not_get_weaker(unit: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [_analyze(), "security", "--offline=true", str(_local_copy(unit, tmp_path))],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
    assert found, done.stdout + done.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE[unit], done.stdout


def test_the_node_unit_never_kills_members_and_writes_only_its_roots() -> None:
    """KillMode=process keeps members alive across agent restarts; the roots the agent is told
    to use are exactly the ones the sandbox leaves writable."""
    text = (UNITS / "tuneplane-node.service").read_text()
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and line[0].isalpha()
    )
    assert settings["KillMode"] == "process"
    assert settings["ProtectSystem"] == "strict"
    assert settings["StateDirectoryMode"] == "0700"
    start = settings["ExecStart"].split()
    roots = {start[start.index(flag) + 1] for flag in ("--work-root", "--out-root")}
    assert roots == set(settings["ReadWritePaths"].split())
