"""node.toml supplies option defaults; a typo or wrong type is an error naming file and key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tuneplane.agent import config


def _node(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_settings_become_defaults_of_the_commands_that_take_them(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('state_dir = "/srv/tp"\nout_root = "/data/out"\n')
    defaults = config.default_map(config.load(path))
    assert defaults["run"] == {"state_dir": "/srv/tp", "out_root": "/data/out"}
    assert defaults["status"] == {"state_dir": "/srv/tp"}
    assert defaults["journal"]["members"] == {"state_dir": "/srv/tp"}
    assert "out_root" not in defaults["enroll"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('state_dirr = "/x"\n', "unknown key 'state_dirr'"),
        ("out_root = 3\n", "'out_root' must be a str"),
        ("state_dir = \n", "is not valid TOML"),
    ],
)
def test_bad_files_are_refused_with_the_key_named(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(config.NodeConfigError, match=expected):
        config.load(path)
    done = _node("--config", str(path), "doctor")
    assert done.returncode == 1
    assert str(path) in done.stderr and expected in done.stderr


def test_the_file_sets_the_state_dir_and_a_flag_wins(tmp_path: Path) -> None:
    from_file, from_flag = tmp_path / "from-file", tmp_path / "from-flag"
    path = tmp_path / "node.toml"
    path.write_text(f'state_dir = "{from_file}"\n')
    assert str(from_file / "node.json") in _node("--config", str(path), "doctor").stdout
    done = _node("--config", str(path), "doctor", "--state-dir", str(from_flag))
    assert str(from_flag / "node.json") in done.stdout
    assert str(from_file) not in done.stdout
