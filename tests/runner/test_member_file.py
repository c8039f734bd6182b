"""member.json: every wrong field is refused with a sentence naming the file and the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tuneplane.runner.member_file import (
    MemberFile,
    MemberFileError,
    ProcessEntry,
    parse_member_file,
    read_member_file,
)

GOOD = MemberFile(
    run_id="r-1",
    attempt=2,
    member_index=0,
    out_dir="/out",
    grace_period_s=30,
    stdout_path="/m/stdout.log",
    stderr_path="/m/stderr.log",
    processes=(ProcessEntry(("python3", "t.py"), {"A": "1"}, "/work", 0),),
)
SOURCE = Path("/m/member.json")


def test_round_trip() -> None:
    assert parse_member_file(SOURCE, json.loads(json.dumps(GOOD.to_json()))) == GOOD


def edited(path: list[Any], value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(GOOD.to_json())
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["attempt"], "2", "field 'attempt' = '2' is not an integer"),
        (["run_id"], KeyError, "field 'run_id' = None is missing"),
        (["out_dir"], "out", "field 'out_dir' = 'out' is not an absolute path"),
        (["format"], 9, "field 'format' = 9 is not 2"),
        (["grace_period_s"], -1, "field 'grace_period_s' = -1 is negative"),
        (["processes"], [], "field 'processes' = [] is empty"),
        (["procs"], [], "field 'procs' = [] is not a known field"),
        (["processes", 0, "argv"], [], "field 'processes[0].argv' = [] is not a non-empty"),
        (["processes", 0, "env"], {"A": 1}, "field 'processes[0].env' = {'A': 1} is not a map"),
        (["processes", 0, "local_rank"], 3, "field 'processes[0].local_rank' = 3 is not 0"),
    ],
)
def test_bad_fields_are_named(path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(MemberFileError) as caught:
        parse_member_file(SOURCE, edited(path, value))
    text = str(caught.value)
    assert text.startswith(f"{SOURCE}: {message}")
    assert "prepare the member again" in text


def test_missing_and_garbled_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(MemberFileError, match=r"member\.json does not exist"):
        read_member_file(tmp_path)
    (tmp_path / "member.json").write_text("{not json")
    with pytest.raises(MemberFileError, match="cannot be read as JSON"):
        read_member_file(tmp_path)
    (tmp_path / "member.json").write_text("[]")
    with pytest.raises(MemberFileError, match="field '<root>' = \\[\\] is not a JSON object"):
        read_member_file(tmp_path)
