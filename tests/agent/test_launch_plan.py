"""plan_processes: the environment each launcher gives its local processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent.launch_plan import (
    LaunchPlanError,
    ProcessSpec,
    UnknownLauncher,
    plan_processes,
)

BASE = {"TUNEPLANE_RUN_ID": "r-1", "TUNEPLANE_ATTEMPT": "2", "PATH": "/usr/bin"}


def plan(
    launcher: str,
    gpus: tuple[str, ...],
    member_index: int = 0,
    member_count: int = 1,
) -> tuple[ProcessSpec, ...]:
    return plan_processes(
        launcher=launcher,
        entrypoint=("python3", "train.py"),
        gpu_uuids=gpus,
        member_index=member_index,
        member_count=member_count,
        master_addr="10.0.0.1",
        master_port=29500,
        base_env=BASE,
        cwd=Path("/srv/work"),
    )


def test_member_launcher_runs_one_process_with_all_gpus() -> None:
    (spec,) = plan("member", ("GPU-a", "GPU-b"), member_index=1, member_count=3)
    assert spec.argv == ("python3", "train.py")
    assert spec.cwd == "/srv/work"
    assert spec.local_rank == 0
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert spec.env["NNODES"] == "3"
    assert spec.env["NODE_RANK"] == "1"
    assert spec.env["NPROC_PER_NODE"] == "2"
    assert spec.env["MASTER_ADDR"] == "10.0.0.1"
    assert spec.env["MASTER_PORT"] == "29500"
    assert spec.env["TUNEPLANE_RUN_ID"] == "r-1"
    assert "RANK" not in spec.env


def test_member_launcher_without_gpus_hides_every_gpu() -> None:
    (spec,) = plan("member", ())
    assert spec.env["CUDA_VISIBLE_DEVICES"] == ""
    assert spec.env["NPROC_PER_NODE"] == "0"


def test_process_group_gives_each_gpu_its_own_process() -> None:
    specs = plan("process-group", ("GPU-a", "GPU-b"), member_index=1, member_count=2)
    assert [s.local_rank for s in specs] == [0, 1]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["GPU-a", "GPU-b"]
    assert [s.env["RANK"] for s in specs] == ["2", "3"]
    assert {s.env["WORLD_SIZE"] for s in specs} == {"4"}
    assert {s.env["LOCAL_WORLD_SIZE"] for s in specs} == {"2"}
    assert {s.env["NODE_RANK"] for s in specs} == {"1"}


def test_process_group_without_gpus_runs_one_process() -> None:
    (spec,) = plan("process-group", ())
    assert spec.env["RANK"] == "0"
    assert spec.env["WORLD_SIZE"] == "1"
    assert spec.env["CUDA_VISIBLE_DEVICES"] == ""


def test_launcher_variables_win_over_base_env() -> None:
    specs = plan_processes(
        launcher="process-group",
        entrypoint=("x",),
        gpu_uuids=("GPU-a",),
        member_index=0,
        member_count=1,
        master_addr="h",
        master_port=1,
        base_env={"RANK": "99", "CUDA_VISIBLE_DEVICES": "all"},
        cwd=Path("/"),
    )
    assert specs[0].env["RANK"] == "0"
    assert specs[0].env["CUDA_VISIBLE_DEVICES"] == "GPU-a"


def test_unknown_launcher_is_a_typed_error_naming_it() -> None:
    with pytest.raises(UnknownLauncher, match=r"'mpirun'.*'member', 'process-group'"):
        plan("mpirun", ())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"member_index": 2, "member_count": 2}, "member_index is 2"),
        ({"member_count": 0}, "member_count is 0"),
        ({"gpus": ("GPU-a", "GPU-a")}, "repeated GPU UUID"),
    ],
)
def test_bad_arguments_are_refused_with_a_sentence(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"gpus": (), "member_index": 0, "member_count": 1, **kwargs}
    with pytest.raises(LaunchPlanError, match=match):
        plan("process-group", **args)  # type: ignore[arg-type]


def test_empty_entrypoint_and_bad_port_are_refused() -> None:
    with pytest.raises(LaunchPlanError, match="entrypoint is empty"):
        plan_processes("member", (), (), 0, 1, "h", 1, {}, Path("/"))
    with pytest.raises(LaunchPlanError, match="master_port is 0"):
        plan_processes("member", ("x",), (), 0, 1, "h", 0, {}, Path("/"))


@given(
    members=st.integers(min_value=1, max_value=8),
    gpus_per_member=st.integers(min_value=0, max_value=8),
)
def test_process_group_ranks_cover_the_world_exactly_once(
    members: int, gpus_per_member: int
) -> None:
    ranks: list[int] = []
    for index in range(members):
        gpus = tuple(f"GPU-{index}-{g}" for g in range(gpus_per_member))
        specs = plan("process-group", gpus, member_index=index, member_count=members)
        nproc = max(gpus_per_member, 1)
        assert [s.local_rank for s in specs] == list(range(nproc))
        assert [int(s.env["LOCAL_RANK"]) for s in specs] == list(range(nproc))
        world = {int(s.env["WORLD_SIZE"]) for s in specs}
        assert world == {members * nproc}
        visible = [s.env["CUDA_VISIBLE_DEVICES"] for s in specs]
        assert visible == (list(gpus) if gpus else [""])
        ranks += [int(s.env["RANK"]) for s in specs]
    assert sorted(ranks) == list(range(members * max(gpus_per_member, 1)))


@given(
    launcher=st.sampled_from(["member", "process-group"]),
    extra=st.dictionaries(
        st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=8).filter(
            lambda k: (
                not k.startswith(("RANK", "LOCAL_", "WORLD_", "NODE_", "NNODES", "MASTER_"))
                and k not in {"CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE"}
            )
        ),
        st.text(max_size=8),
        max_size=5,
    ),
)
def test_base_env_passes_through(launcher: str, extra: dict[str, str]) -> None:
    specs = plan_processes(launcher, ("x",), ("GPU-a",), 0, 1, "h", 2, extra, Path("/w"))
    for spec in specs:
        assert {k: spec.env[k] for k in extra} == extra
