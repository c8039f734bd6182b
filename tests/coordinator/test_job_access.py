"""The pure rule for who may read a Job, and the project's share list as tp reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneplane.coordinator.auth import PermissionDenied
from tuneplane.coordinator.cli.project import ProjectError, load_project
from tuneplane.coordinator.job_access import JobAccess, check_read, may_read
from tuneplane.coordinator.store.access import share_list
from tuneplane.coordinator.values.users import User

JOB = JobAccess("run-1", "alice", ("carol",))


@pytest.mark.parametrize(
    ("name", "role", "allowed"),
    [
        ("alice", "researcher", True),
        ("carol", "researcher", True),
        ("bob", "researcher", False),
        ("root", "admin", True),
        ("Carol", "researcher", False),
    ],
)
def test_owner_shared_users_and_admins_read_nobody_else(
    name: str, role: str, allowed: bool
) -> None:
    user = User(name, role, 0)
    assert may_read(JOB, user) is allowed
    if allowed:
        check_read(JOB, user, "logs")
    else:
        with pytest.raises(PermissionDenied, match=r"belongs to alice.*may not read its logs"):
            check_read(JOB, user, "logs")


def test_the_stored_share_list_is_read_defensively() -> None:
    assert share_list('{"share_with": ["carol", "dave"]}') == ("carol", "dave")
    assert share_list("{}") == ()
    assert share_list('{"share_with": "carol"}') == ()
    assert share_list('{"share_with": ["carol", 7]}') == ("carol",)
    assert share_list("not json") == ()
    assert share_list("[]") == ()


def test_tuneplane_yaml_share_with(tmp_path: Path) -> None:
    project_file = tmp_path / "tuneplane.yaml"
    project_file.write_text("name: demo\n")
    assert load_project(tmp_path).share_with == ()
    project_file.write_text("name: demo\nshare_with: [carol, dave, carol]\n")
    assert load_project(tmp_path).share_with == ("carol", "dave")
    for bad, why in (("carol", "must be a list"), ("[Carol]", "'Carol', which is not a user")):
        project_file.write_text(f"name: demo\nshare_with: {bad}\n")
        with pytest.raises(ProjectError, match=why):
            load_project(tmp_path)
