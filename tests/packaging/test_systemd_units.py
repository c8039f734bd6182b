"""The shipped systemd files, checked by systemd's own tools (no running systemd needed).

``systemd-analyze verify`` loads each unit as systemd would (unknown keys, bad values, a
missing binary are errors); ``systemd-analyze security --offline=true`` rates its sandbox, and the
rating may not get worse than it is today. The binaries under /opt/tuneplane do not exist here,
so each unit is checked as a copy pointing at this checkout's installed commands.
``systemd-sysusers`` and ``systemd-tmpfiles`` apply the sysusers.d and tmpfiles.d files to an
empty root directory, and the accounts and directories they make are the ones the units and the
agent use. Where systemd's tools are missing the tests skip with a sentence (under CI=true they
fail).
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.accounts import require
from tuneplane.agent.config import default_policy

UNITS = Path(__file__).resolve().parents[2] / "packaging" / "systemd"
INSTALLED = "/opt/tuneplane/bin/"
# Exposure ratings (0 safest, 10 least safe) measured when each unit was hardened. The Node's
# agent must stay root to switch members' accounts, so its floor is higher.
MAX_EXPOSURE = {"tuneplane-node.service": 6.2, "tuneplane-coordinator.service": 1.3}
SYSUSERS = UNITS / "tuneplane.sysusers.conf"
TMPFILES = UNITS / "tuneplane.tmpfiles.conf"


def _tool(name: str) -> str:
    found = shutil.which(name)
    require(found is not None, f"{name} (Debian's systemd package)")
    assert found is not None
    return found


def _analyze() -> str:
    return _tool("systemd-analyze")


def _settings(unit: str) -> dict[str, str]:
    """The unit's ``Key=value`` lines (the last one wins, as in systemd for these keys)."""
    text = (UNITS / unit).read_text()
    return dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and line[0].isalpha()
    )


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
    settings = _settings("tuneplane-node.service")
    assert settings["KillMode"] == "process"
    assert settings["ProtectSystem"] == "strict"
    assert settings["StateDirectoryMode"] == "0700"
    start = settings["ExecStart"].split()
    roots = {start[start.index(flag) + 1] for flag in ("--work-root", "--out-root")}
    assert roots == set(settings["ReadWritePaths"].split())


@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_each_unit_says_when_it_is_ready_and_keeps_a_watchdog(unit: str) -> None:
    """Type=notify with the daemon's own READY=1 (agent/sd_notify.py), accepted from the main
    process only, and a watchdog the event loop keeps."""
    settings = _settings(unit)
    assert settings["Type"] == "notify"
    assert settings["NotifyAccess"] == "main"
    assert int(settings["WatchdogSec"]) >= 10


def test_the_coordinator_runs_as_its_own_account_with_nothing_to_spare() -> None:
    settings = _settings("tuneplane-coordinator.service")
    assert (settings["User"], settings["Group"]) == ("tuneplane", "tuneplane")
    assert settings["CapabilityBoundingSet"] == ""
    assert settings["NoNewPrivileges"] == "yes"
    assert settings["ProtectSystem"] == "strict"
    assert "ReadWritePaths" not in settings  # StateDirectory= is its one writable place
    assert settings["RestrictAddressFamilies"].split() == ["AF_INET", "AF_INET6", "AF_UNIX"]


def _apply(tmp_path: Path) -> Path:
    """An empty root with the sysusers.d and then the tmpfiles.d file applied to it."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for tool, conf, extra in (
        ("systemd-sysusers", SYSUSERS, []),
        ("systemd-tmpfiles", TMPFILES, ["--create"]),
    ):
        done = subprocess.run(
            [_tool(tool), f"--root={root}", *extra, str(conf)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{tool}: {done.stderr}"
    return root


def _accounts(root: Path) -> dict[str, list[str]]:
    lines = (root / "etc" / "passwd").read_text().splitlines()
    return {line.split(":")[0]: line.split(":") for line in lines}


def test_sysusers_makes_the_coordinators_account_and_the_agents_default_pool(
    tmp_path: Path,
) -> None:
    accounts = _accounts(_apply(tmp_path))
    pool = default_policy(0).pool
    assert set(accounts) == {"tuneplane", *pool}
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "root" / "etc" / "group").read_text().splitlines()
    }
    for name, (_, _, uid, gid, _, _, shell) in accounts.items():
        # System accounts with no way in, each alone in its own group.
        assert 0 < int(uid) < 1000 and shell == "/usr/sbin/nologin", accounts[name]
        assert groups[name][2] == gid and groups[name][3] == "", groups[name]


def test_tmpfiles_makes_the_directories_the_units_use_with_their_owners_and_modes(
    tmp_path: Path,
) -> None:
    root = _apply(tmp_path)
    uid = {name: int(entry[2]) for name, entry in _accounts(root).items()}
    node = _settings("tuneplane-node.service")
    coordinator = _settings("tuneplane-coordinator.service")
    start = node["ExecStart"].split()
    expected = {
        f"/var/lib/{coordinator['StateDirectory']}": (
            int(coordinator["StateDirectoryMode"], 8), uid[coordinator["User"]],
        ),
        f"/var/lib/{node['StateDirectory']}": (int(node["StateDirectoryMode"], 8), 0),
        start[start.index("--state-dir") + 1]: (int(node["StateDirectoryMode"], 8), 0),
        **{start[start.index(flag) + 1]: (0o711, 0) for flag in ("--work-root", "--out-root")},
        "/etc/tuneplane": (0o755, 0),
    }  # fmt: skip
    for path, (mode, owner) in expected.items():
        st = (root / path.lstrip("/")).stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (mode, owner), path
