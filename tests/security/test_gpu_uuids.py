"""A coordinator's Prepare whose GPU UUIDs do not match the Node's cards is refused, nothing held.

A real agent, enrolled with a real coordinator, then served by the stand-in of
``hostile_control.py`` (mode ``uuids``): it names the Node's GPU 0 with another card's UUID, then
with one UUID too many, then correctly. The first two are refused with a sentence naming the
index and both UUIDs; neither holds the GPU (the third, correct one gets it) nor writes a file.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.security.hostile_control import SIMULATED_UUID
from tests.security.test_bad_input import _hostile_control


def test_prepare_with_gpu_uuids_that_do_not_match_is_refused_and_holds_nothing(
    tmp_path: Path,
) -> None:
    with _hostile_control(tmp_path, "uuids", timeout=120) as (seen, agent):
        by_run = {r["run_id"]: r for r in seen["replies"]}
        wrong = by_run["run-wrong-uuid"]
        assert not wrong["ok"], by_run
        assert wrong["reason"] == (
            f"GPU 0 was placed as GPU-not-this-card but this Node's GPU 0 is {SIMULATED_UUID} now "
            "(that card is not in this Node's inventory any more); the GPU order changed, so "
            "the Job must be placed again."
        )
        two = by_run["run-two-uuids"]
        assert not two["ok"] and "names 1 GPU indexes but 2 GPU UUIDs" in two["reason"], by_run
        # The GPU stayed free: the correct Prepare after them got it.
        assert by_run["run-right-uuid"]["ok"], by_run
        with sqlite3.connect(f"file:{agent.journal_path}?mode=ro", uri=True) as db:
            owners = db.execute("SELECT gpu_uuid, gpu_index, member_key FROM gpu_ownership")
            assert owners.fetchall() == [(SIMULATED_UUID, 0, "run-right-uuid.1.0")]
            states = dict(db.execute("SELECT run_id, state FROM members").fetchall())
        assert states == {
            "run-wrong-uuid": "aborted", "run-two-uuids": "aborted", "run-right-uuid": "prepared",
        }  # fmt: skip
        # Refused before any file of the member was written.
        for run_id in ("run-wrong-uuid", "run-two-uuids"):
            member_dir = agent.state_dir / "members" / f"{run_id}.1.0"
            assert not (member_dir / "jobspec.json").exists()
