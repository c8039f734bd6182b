"""Output manifests and their use at Prepare, on real files: what a member left is listed with
sizes and sha256, bounded; a Derivation's copy is verified file by file against it, and every
refusal names the file and leaves no half-copied directory."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.agent import journal_read, wire_convert
from tuneplane.agent import messages as m
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.init_from import INIT_FROM_DIR, materialise_init_from
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import Exit, MemberKey, NewMember
from tuneplane.agent.member_state import MemberEvent as E
from tuneplane.agent.outputs_manifest import read_manifest, write_manifest
from tuneplane.agent.prepare import PrepareRefused
from tuneplane.proto.contract.derivation_source import (
    InitFromSource,
    ManifestSummary,
    manifest_path,
)

pytestmark = pytest.mark.timeout(60)

CKPT = os.urandom(3 * 1024 * 1024 + 17)  # more than one read chunk


def _outputs(out_root: Path) -> Path:
    out = out_root / "run-a" / "attempt-1" / "member-0"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "model.bin").write_bytes(CKPT)
    (out / "notes.txt").write_text("step 7\n")
    return out


def _source(out: Path, sha256: str, files: int = 2) -> InitFromSource:
    return InitFromSource("run-a", 1, 0, str(out), sha256, files, len(CKPT) + 7)


def test_manifest_lists_regular_files_with_sizes_and_digests(tmp_path: Path) -> None:
    out = _outputs(tmp_path / "out")
    (out / "link").symlink_to("/etc/passwd")
    os.link(out / "notes.txt", out / "notes-again.txt")
    summary = write_manifest(out, "run-a", 1, 0)
    data = Path(manifest_path(str(out))).read_bytes()
    assert Path(manifest_path(str(out))).stat().st_mode & 0o777 == 0o600
    assert summary.problem == ""
    assert summary.sha256 == hashlib.sha256(data).hexdigest()
    manifest = read_manifest(data, "test")
    assert [(e.path, e.size) for e in manifest.files] == [("ckpt/model.bin", len(CKPT))]
    assert manifest.files[0].sha256 == hashlib.sha256(CKPT).hexdigest()
    assert (summary.files, summary.bytes) == (1, len(CKPT))
    skipped = json.loads(data)["skipped"]
    assert "link: not a regular file" in skipped
    assert {"notes-again.txt: has 2 hard links", "notes.txt: has 2 hard links"} <= set(skipped)
    # Written again, the same directory gives the same bytes (a replay after a crash).
    assert write_manifest(out, "run-a", 1, 0) == summary


def test_past_its_bounds_no_manifest_is_written_and_the_summary_says_why(tmp_path: Path) -> None:
    out = _outputs(tmp_path / "out")
    assert write_manifest(out, "run-a", 1, 0).problem == ""
    summary = write_manifest(out, "run-a", 1, 0, max_files=1)
    assert summary.sha256 == "" and summary.files == 0
    assert "holds more than 1 files" in summary.problem and str(out) in summary.problem
    assert not Path(manifest_path(str(out))).exists()
    summary = write_manifest(out, "run-a", 1, 0, max_bytes=1024)
    assert "holds more than 1024 bytes" in summary.problem


def test_init_from_copies_and_verifies_every_file(tmp_path: Path) -> None:
    out_root = tmp_path / "out"
    out = _outputs(out_root)
    summary = write_manifest(out, "run-a", 1, 0)
    dest = tmp_path / "work" / INIT_FROM_DIR
    copied = materialise_init_from(_source(out, summary.sha256), out_root, dest)
    assert copied == len(CKPT) + 7
    assert (dest / "ckpt" / "model.bin").read_bytes() == CKPT
    assert (dest / "notes.txt").read_text() == "step 7\n"
    assert not dest.with_name(dest.name + ".partial").exists()
    # Repeating the step (a re-Prepare) redoes it over what is there, and over a stale partial.
    dest.with_name(dest.name + ".partial").mkdir()
    (dest / "extra").write_text("left by a crash")
    materialise_init_from(_source(out, summary.sha256), out_root, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["ckpt", "notes.txt"]


@pytest.mark.parametrize("tamper", ["changed", "missing", "longer", "link", "fifo"])
def test_a_tampered_source_file_is_refused_naming_it(tmp_path: Path, tamper: str) -> None:
    out_root = tmp_path / "out"
    out = _outputs(out_root)
    summary = write_manifest(out, "run-a", 1, 0)
    model = out / "ckpt" / "model.bin"
    if tamper == "changed":
        model.write_bytes(b"X" + CKPT[1:])
    elif tamper == "missing":
        model.unlink()
    elif tamper == "longer":
        model.write_bytes(CKPT + b"!")
    elif tamper == "link":
        model.unlink()
        model.symlink_to(tmp_path / "elsewhere")
        (tmp_path / "elsewhere").write_bytes(CKPT)
    else:
        # A FIFO with no writer would block a plain open forever.
        model.unlink()
        os.mkfifo(model)
    dest = tmp_path / "work" / INIT_FROM_DIR
    with pytest.raises(PrepareRefused, match=r"The file ckpt/model\.bin of run run-a's outputs"):
        materialise_init_from(_source(out, summary.sha256), out_root, dest)
    assert not dest.exists()


def test_a_changed_manifest_or_a_source_outside_the_out_root_is_refused(tmp_path: Path) -> None:
    out_root = tmp_path / "out"
    out = _outputs(out_root)
    summary = write_manifest(out, "run-a", 1, 0)
    dest = tmp_path / "work" / INIT_FROM_DIR
    manifest = Path(manifest_path(str(out)))
    manifest.write_bytes(manifest.read_bytes().replace(b"step", b"step"))
    with pytest.raises(PrepareRefused, match="was changed after the run ended: its sha256 is"):
        materialise_init_from(_source(out, "0" * 64), out_root, dest)
    with pytest.raises(PrepareRefused, match="not inside this Node's output root"):
        materialise_init_from(_source(out, summary.sha256), tmp_path / "other", dest)
    manifest.unlink()
    with pytest.raises(PrepareRefused, match="is missing on this Node"):
        materialise_init_from(_source(out, summary.sha256), out_root, dest)
    assert not dest.exists()


def test_an_unwritable_manifest_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    # The out dir's parent is a file: the manifest beside it cannot be written.
    (tmp_path / "attempt-1").write_text("not a directory")
    summary = write_manifest(tmp_path / "attempt-1" / "member-0", "run-a", 1, 0)
    assert summary.sha256 == "" and "could not be written" in summary.problem


_NAMES = st.text(alphabet="abcxyz019._-", min_size=1, max_size=8).filter(
    lambda n: n not in (".", "..")
)
_TREES = st.dictionaries(
    st.lists(_NAMES, min_size=1, max_size=3).map("/".join),
    st.binary(max_size=3000),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(tree=_TREES)
def test_any_tree_is_listed_exactly_and_copied_byte_for_byte(tree: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out_root = Path(tmp) / "out"
        out = out_root / "run-a" / "attempt-1" / "member-0"
        out.mkdir(parents=True)
        written: dict[str, bytes] = {}
        for rel, data in tree.items():
            path = out / rel
            # A name that is already a file (or a folder) cannot also be the other.
            if any(p.is_file() for p in path.parents) or path.is_dir():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written[rel] = data
        summary = write_manifest(out, "run-a", 1, 0)
        manifest = read_manifest(Path(manifest_path(str(out))).read_bytes(), "test")
        assert [e.path for e in manifest.files] == sorted(written)
        assert all(e.sha256 == hashlib.sha256(written[e.path]).hexdigest() for e in manifest.files)
        assert (summary.files, summary.bytes) == (len(written), sum(map(len, written.values())))
        assert write_manifest(out, "run-a", 1, 0) == summary
        dest = Path(tmp) / "work" / INIT_FROM_DIR
        materialise_init_from(_source(out, summary.sha256), out_root, dest)
        copied = {
            p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()
        }
        assert copied == written


async def test_the_exit_report_keeps_its_manifest_in_the_journal_and_on_the_wire(
    tmp_path: Path,
) -> None:
    key = MemberKey("run-a", 1, 0)
    summary = ManifestSummary(2, 1234, "ab" * 32)
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        try:
            await journal.create_member(NewMember(key, 1, (0,), "/m", "/o/member-0", 5), 1)
            for step, event in enumerate((E.PREPARE_SUCCEEDED, E.COMMIT_RECEIVED,
                                          E.SPAWN_REQUESTED, E.RUNNER_STARTED)):  # fmt: skip
                await journal.transition(key, event, 2 + step)
            _, report = await journal.transition(
                key, E.EXIT_OBSERVED, 9, exit=Exit(0, None), manifest=summary.to_json()
            )
            assert report is not None and report.manifest == summary.to_json()
            # Unacknowledged, it is what a resend (after a restart) carries.
            pending = (await journal.pending_reports())[-1]
            assert pending == report
        finally:
            await journal.close()
    sent = wire_convert.to_wire(m.Report(pending)).report.output_manifest
    assert (sent.files, sent.bytes, sent.sha256, sent.problem) == (2, 1234, "ab" * 32, "")
    with journal_read.open_readonly(tmp_path / "journal.db") as db:
        (row,) = [r for r in map(journal_read.report_json, journal_read.pending_reports(db))
                  if r["state"] == "exited"]  # fmt: skip
        exited = journal_read.events(db, kinds=("exit-observed",))
    assert row["output_manifest"] == attrs.asdict(summary)
    assert exited[0]["details"]["output_manifest"] == attrs.asdict(summary)
