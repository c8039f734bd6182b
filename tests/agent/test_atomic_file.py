"""The one atomic file write (agent/atomic_file.py), on real files: whole or not at all, the
mode it is asked for whatever the umask, and no temporary file left when a step fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.accounts import require
from tuneplane.agent.atomic_file import fsync_dir, write_atomic, write_json_atomic

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """A umask that would take every bit the writer asks for from group and others."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_holds_the_bytes_and_nothing_else_is_left(tmp_path: Path) -> None:
    target = tmp_path / "node.json"
    write_atomic(target, b"x" * 300_000)
    assert target.read_bytes() == b"x" * 300_000
    assert entries(tmp_path) == ["node.json"]


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o640])
def test_the_file_gets_exactly_the_mode_asked_whatever_the_umask(
    tmp_path: Path, strict_umask: None, mode: int
) -> None:
    target = tmp_path / "file"
    write_atomic(target, b"a", mode)
    assert mode_of(target) == mode
    # Replacing a file with looser bits gives the new mode, not the old one.
    target.chmod(0o666)
    write_atomic(target, b"b", mode)
    assert (mode_of(target), target.read_bytes()) == (mode, b"b")


def test_a_reader_of_the_old_file_keeps_reading_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "status.json"
    write_atomic(target, b"old")
    with target.open("rb") as reader:
        write_atomic(target, b"new")
        assert reader.read() == b"old"
    assert target.read_bytes() == b"new"


def test_a_failed_rename_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    # A non-empty directory cannot be replaced by a file: the rename, the last step, fails.
    target = tmp_path / "control.token"
    target.mkdir()
    (target / "inside").write_bytes(b"kept")
    with pytest.raises(OSError):
        write_atomic(target, b"secret", 0o600)
    assert entries(tmp_path) == ["control.token"]
    assert (target / "inside").read_bytes() == b"kept"


def test_a_failed_write_leaves_the_old_content_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.json"
    write_atomic(target, b"before")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"before"
    assert entries(tmp_path) == ["checkpoint.json"]


def test_a_missing_directory_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "file", b"x")
    assert entries(tmp_path) == []


def test_a_symlink_in_place_of_the_temporary_name_is_never_followed(tmp_path: Path) -> None:
    """The temporary file is created exclusively under a name no one can guess: an attacker's
    link in the directory is neither written through nor replaced."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (tmp_path / ".file.tmp").symlink_to(victim)
    write_atomic(tmp_path / "file", b"data")
    assert victim.read_bytes() == b"untouched"
    assert (tmp_path / "file").read_bytes() == b"data"
    assert entries(tmp_path) == [".file.tmp", "file", "victim"]


def test_parents_are_made_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "experiments" / "sft" / "config.yaml"
    with pytest.raises(FileNotFoundError):
        write_atomic(target, b"a: 1\n")
    write_atomic(target, b"a: 1\n", parents=True)
    assert target.read_bytes() == b"a: 1\n"
    assert entries(target.parent) == ["config.yaml"]


def test_json_is_sorted_indented_and_ends_with_a_newline(tmp_path: Path) -> None:
    target = tmp_path / "lease.json"
    write_json_atomic(target, {"b": 1, "a": [1, 2]}, 0o600)
    text = target.read_text()
    assert text == json.dumps({"a": [1, 2], "b": 1}, indent=2) + "\n"
    assert mode_of(target) == 0o600


def test_writers_racing_on_one_file_leave_one_whole_version(tmp_path: Path) -> None:
    target = tmp_path / "raced"
    versions = [bytes([n]) * 100_000 for n in range(8)]
    failures: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(20):
                write_atomic(target, data)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(v,)) for v in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert target.read_bytes() in versions
    assert entries(tmp_path) == ["raced"]


def test_fsync_dir_refuses_a_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(plain)
    fsync_dir(tmp_path)


# Writes three files into a new a/b and one into a, with one DirSync, then flushes it.
_BATCH = """
import sys
from pathlib import Path
from tuneplane.agent.atomic_file import DirSync, make_dirs, write_atomic
root = Path(sys.argv[1])
synced = DirSync()
make_dirs(root / "a" / "b", synced)
for name in ("x", "y", "z"):
    write_atomic(root / "a" / "b" / name, name.encode(), dir_sync=synced)
write_atomic(root / "a" / "w", b"w", dir_sync=synced)
synced.flush()
"""


def test_a_dir_sync_fsyncs_each_changed_directory_once_after_its_last_entry(
    tmp_path: Path,
) -> None:
    """Watched with strace on a real process: every file is fsynced before its rename, and
    every directory that got an entry (a rename or a new directory) is fsynced exactly once,
    after the last entry it got; the deferred fsyncs lose no durability, only repeats."""
    require(
        shutil.which("strace") is not None,
        "strace to watch the fsync calls; install the distribution's strace package",
    )
    root = (tmp_path / "root").resolve()
    root.mkdir()
    trace = tmp_path / "trace"
    subprocess.run(
        ["strace", "-f", "-y", "-o", str(trace), "-e", "trace=fsync,rename,mkdir",
         sys.executable, "-c", _BATCH, str(root)],
        check=True, timeout=60, capture_output=True,
    )  # fmt: skip
    steps: list[tuple[str, str]] = []
    for line in trace.read_text().splitlines():
        if found := re.search(r"fsync\(\d+<([^>]+)>\) = 0", line):
            steps.append(("fsync", found[1]))
        elif found := re.search(r'rename\("([^"]+)", "([^"]+)"\) = 0', line):
            steps.append(("rename", found[2]))
            assert ("fsync", found[1]) in steps, f"{found[1]} was renamed before its fsync"
        elif found := re.search(r'mkdir\("([^"]+)", \d+\) = 0', line):
            steps.append(("mkdir", found[1]))
    changed = {os.path.dirname(path) for kind, path in steps if kind in ("rename", "mkdir")}
    assert changed == {str(root), str(root / "a"), str(root / "a" / "b")}
    for directory in changed:
        synced_at = [i for i, step in enumerate(steps) if step == ("fsync", directory)]
        last_entry = max(i for i, (kind, path) in enumerate(steps)
                         if kind != "fsync" and os.path.dirname(path) == directory)  # fmt: skip
        assert len(synced_at) == 1 and synced_at[0] > last_entry, (directory, steps)
    assert (root / "a" / "b" / "y").read_bytes() == b"y"
