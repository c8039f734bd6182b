"""The coordinator's in-memory book of image preparations (coordinator/preparations.py): a
Node's PrepareProgress shows with a member its Job places on that Node, only while preparing."""

from __future__ import annotations

import attrs

from tuneplane.coordinator.cli.render import preparation_text
from tuneplane.coordinator.preparations import PreparationBook
from tuneplane.coordinator.values.jobs import Attempt, ImagePreparation, Job, Member, MemberKey

IMAGE = "image:registry.example/team/pytorch@sha256:" + "a" * 64
PULLING = ImagePreparation(IMAGE, 312 << 20, 1 << 30, 2, 9, "pulling", 1_700_000_000_000)


def _job(state: str = "preparing", node_id: str = "node-a") -> Job:
    member = Member(0, node_id, state, False, 0, 0, "", (0,), ())
    attempt = Attempt(1, "preparing", (member,), "", 0, 0)
    return Job(run_id="run-1", project="p", experiment="e", owner="o", state="preparing",
               fleet="f", profile="h200", method_id="custom/custom", preview_id="pv",
               digest="d", init_from="", created_at_ms=0, attempts=(attempt,))  # fmt: skip


def _shown(book: PreparationBook, job: Job) -> ImagePreparation | None:
    return book.shown(job).attempts[0].members[0].preparation


def test_a_report_shows_with_its_preparing_member_and_is_forgotten_after() -> None:
    book = PreparationBook()
    book.record("node-a", MemberKey("run-1", 1, 0), PULLING)
    assert _shown(book, _job()) == PULLING
    assert _shown(book, _job(state="prepared")) is None
    assert _shown(book, _job()) is None  # forgotten once the member moved on


def test_another_nodes_report_never_shows_and_the_book_is_bounded() -> None:
    book = PreparationBook(max_entries=2)
    book.record("node-b", MemberKey("run-1", 1, 0), PULLING)
    assert _shown(book, _job(node_id="node-a")) is None
    for n in (1, 2, 3):
        book.record("node-a", MemberKey(f"run-{n}", 1, 0), attrs.evolve(PULLING, layers_done=n))
    assert _shown(book, _job()) is None  # run-1's report was the oldest of three: dropped
    assert book.shown(attrs.evolve(_job(), run_id="run-2")).attempts[0].members[0].preparation


def test_tp_job_show_tells_the_pull_in_words() -> None:
    assert preparation_text(PULLING) == (f"pulling {IMAGE}: 312.0 MiB of 1024.0 MiB, 2 of 9 layers")
