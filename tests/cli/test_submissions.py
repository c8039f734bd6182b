"""Preview files: round trip, lookup by id or path, and damaged files refused with a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneplane.coordinator.cli import submissions
from tuneplane.coordinator.cli.project import Project, ProjectError, init_project
from tuneplane.coordinator.values.jobs import Preview, PreviewSummary, Receipt


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return init_project(tmp_path / "proj", "demo")


def _record(receipt: Receipt | None = None) -> submissions.Submission:
    preview = Preview(
        preview_id="pv-1",
        digest="sha256:ab",
        resolved_jobspec_json="{}",
        summary=PreviewSummary("default", "node", "h200", 2, 2, "h200:4"),
        created_at_ms=5,
    )
    return submissions.Submission(
        format=submissions.FORMAT,
        coordinator="127.0.0.1:1",
        project="demo",
        experiment="hello",
        retry_key=submissions.new_retry_key(),
        preview=preview,
        receipt=receipt,
    )


def test_round_trip_and_private_mode(project: Project) -> None:
    path = submissions.path_for(project, "pv-1")
    record = _record()
    submissions.save(path, record)
    assert submissions.load(path) == record
    assert path.stat().st_mode & 0o777 == 0o600
    receipt = Receipt("run-1", "pv-1", "sha256:ab", record.retry_key, 9, True)
    with_receipt = _record(receipt)
    submissions.save(path, with_receipt)
    assert submissions.load(path).receipt == receipt
    assert [p.name for p in path.parent.iterdir()] == ["pv-1.json"]


def test_retry_keys_are_fresh() -> None:
    keys = {submissions.new_retry_key() for _ in range(100)}
    assert len(keys) == 100


def test_locate_by_id_or_path(project: Project, tmp_path: Path) -> None:
    assert submissions.locate("pv-1", project) == project.data_dir / "submissions" / "pv-1.json"
    assert submissions.locate("elsewhere/pv-1.json", None) == Path("elsewhere/pv-1.json")
    with pytest.raises(ProjectError, match="no project here"):
        submissions.locate("pv-1", None)
    with pytest.raises(ProjectError, match="is not a preview id"):
        submissions.path_for(project, "..")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{", "not readable JSON"),
        ('{"format": "other"}', "not a TunePlane preview file"),
        (json.dumps({"format": submissions.FORMAT, "coordinator": "x"}), "is damaged"),
    ],
)
def test_damaged_files_are_refused(project: Project, content: str, expected: str) -> None:
    path = submissions.path_for(project, "pv-1")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ProjectError, match=expected) as info:
        submissions.load(path)
    assert "Preview again with `tp submit <experiment> --preview`" in str(info.value)


def test_missing_file(project: Project) -> None:
    with pytest.raises(ProjectError, match="does not exist"):
        submissions.load(submissions.path_for(project, "pv-404"))
