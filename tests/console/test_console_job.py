"""The Job page's decision log, logs (followed live) and Retry, and the Jobs list live, against a
real coordinator with a Node the test plays on its own thread (tests/support/live_node.py), so
alice's Job runs there and its log grows while a page is open.

Every refusal is checked twice: the answer refuses, and nothing changed (the Job's state and
attempts read over the gRPC Api as the admin, and its decision log).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from tests.console.test_console_browser import ARGS, CHROMIUM, _require_browser
from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.console import (
    ConsoleWorld,
    console_world,
    form_token,
    playwright_session,
    screenshot,
    sign_in,
    sign_in_page,
    sse_events,
)
from tests.support.live_node import LiveNode, live_node
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(300)

FIRST_LINES = "epoch 1: loss 0.9\nepoch 2: loss 0.7\n"


@attrs.frozen
class JobWorld:
    world: ConsoleWorld
    node: LiveNode
    running: v1.MemberRef  # alice's Job, running on the Node, its stdout FIRST_LINES so far
    ended: dict[str, str]  # label -> alice's Job, cancelled while queued


@pytest.fixture(scope="module")
def jw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobWorld]:
    root = tmp_path_factory.mktemp("console-job")
    with (
        console_world(root, (), heartbeat_timeout=3600) as world,
        live_node(world.coord, "host-live", world.tokens["alice"]) as node,
    ):
        running = node.call(node.run_job("vision", "k-running"))
        node.call(node.log(running, FIRST_LINES))

        async def queue_and_cancel() -> dict[str, str]:
            # The Node's one GPU is taken: these wait in the queue, and are cancelled there.
            found = {}
            async with api_client(
                world.coord.api, world.coord.ca_path, world.tokens["alice"]
            ) as api:
                for label in ("refused", "retried", "browser", "listed"):
                    receipt = await api.submit(jobspec(gpus=1, project="vision"), label)
                    found[label] = receipt.run_id
            return found

        ended = node.call(queue_and_cancel())
        for label, run_id in ended.items():
            if label != "listed":
                assert world.tp_cancel("alice", run_id, "to retry") == "cancelled"
        yield JobWorld(world, node, running, ended)


@contextmanager
def _signed_in(world: ConsoleWorld, who: str) -> Iterator[httpx.Client]:
    with world.client() as client:
        done = sign_in(client, world.tokens[who])
        assert done.status_code == 303, done.text
        yield client


def _csrf(client: httpx.Client) -> str:
    return str(client.get("/api/v1/session").json()["csrf_token"])


def _seen(world: ConsoleWorld, client: httpx.Client, run_id: str) -> tuple[Any, ...]:
    """What a refusal must leave as it was: the Job's state and attempts (gRPC, as the admin)
    and its decision log (as its owner reads it)."""
    decisions = client.get(f"/api/v1/jobs/{run_id}/decisions").json()["decisions"]
    job = client.get(f"/api/v1/jobs/{run_id}").json()["job"]
    return world.job_state(run_id), len(job["attempts"]), [d["id"] for d in decisions]


def test_the_decision_log_is_the_jobs_and_only_for_who_may_read_it(jw: JobWorld) -> None:
    run_id = jw.running.run_id
    with _signed_in(jw.world, "alice") as alice, _signed_in(jw.world, "bob") as bob:
        found = alice.get(f"/api/v1/jobs/{run_id}/decisions").json()
        assert found["older"] is False and found["decisions"]
        assert [d["id"] for d in found["decisions"]] == sorted(d["id"] for d in found["decisions"])
        kinds = [d["kind"] for d in found["decisions"]]
        assert kinds[:2] == ["admission", "reservation"] and "commit" in kinds, kinds
        page = alice.get(f"/jobs/{run_id}")
        assert page.status_code == 200 and "Decision log" in page.text
        assert found["decisions"][-1]["kind"] in page.text
        refused = bob.get(f"/api/v1/jobs/{run_id}/decisions")
        assert refused.status_code == 403 and "belongs to alice" in refused.json()["error"]
        assert "decisions" not in refused.json()


def test_logs_are_read_as_tp_logs_reads_them(jw: JobWorld) -> None:
    path = f"/api/v1/jobs/{jw.running.run_id}/logs"
    with _signed_in(jw.world, "alice") as alice, _signed_in(jw.world, "bob") as bob:
        page = alice.get(path).json()
        assert "".join(p["text"] for p in page["pieces"]) == FIRST_LINES
        assert page["next_offset"] == len(FIRST_LINES) and page["complete"] is False
        assert (page["attempt"], page["member_index"], page["member_state"]) == (1, 0, "running")
        part = alice.get(path, params={"max_bytes": 5}).json()
        assert "".join(p["text"] for p in part["pieces"]) == FIRST_LINES[:5]
        rest = alice.get(path, params={"from": part["next_offset"]}).json()
        assert "".join(p["text"] for p in rest["pieces"]) == FIRST_LINES[5:]
        for params, said in (
            ({"stream": "stdin"}, "stream"),
            ({"member": -1}, "Member is -1"),
            ({"from": "x"}, "From is 'x'"),
            ({"max_bytes": 0}, "Max_bytes is 0"),
        ):
            refused = alice.get(path, params=params)
            assert refused.status_code == 400 and said in refused.json()["error"], refused.text
        missing = alice.get(path, params={"member": 3})
        assert missing.status_code == 404 and "no member 3" in missing.json()["error"]
        # On the Job page a log that cannot be read is a sentence in its section; the rest stands.
        for params, said in (({"member": 3}, "no member 3"), ({"stream": "x"}, "not one of")):
            page = alice.get(f"/jobs/{jw.running.run_id}", params=params)
            assert page.status_code == 200 and said in page.text and "Decision log" in page.text
        refused = bob.get(path)
        assert refused.status_code == 403 and "epoch" not in refused.text
        refused = bob.get(f"{path}/events")
        assert refused.status_code == 403 and "epoch" not in refused.text


def test_another_users_retry_is_refused_and_changes_nothing(jw: JobWorld) -> None:
    run_id = jw.ended["refused"]
    with _signed_in(jw.world, "alice") as alice, _signed_in(jw.world, "bob") as bob:
        before = _seen(jw.world, alice, run_id)
        assert before[0] == "cancelled"
        refused = bob.post(f"/api/v1/jobs/{run_id}/retry", headers={"X-CSRF-Token": _csrf(bob)})
        assert refused.status_code == 403, refused.text
        assert "belongs to alice" in refused.json()["error"]
        form = bob.post(f"/jobs/{run_id}/retry", data={"csrf_token": form_token(
            bob.get("/jobs").text)})  # fmt: skip
        assert form.status_code == 403 and "Retry this Job" not in form.text
        # Alice's own retry without the session's CSRF token is refused too.
        for headers in ({}, {"X-CSRF-Token": "forged"}):
            refused = alice.post(f"/api/v1/jobs/{run_id}/retry", headers=headers)
            assert refused.status_code == 403 and "CSRF" in refused.json()["error"]
        refused = alice.post(f"/jobs/{run_id}/retry", data={"csrf_token": "forged"})
        assert refused.status_code == 403
        assert _seen(jw.world, alice, run_id) == before


def test_the_owner_retries_an_ended_job(jw: JobWorld) -> None:
    run_id = jw.ended["retried"]
    with _signed_in(jw.world, "alice") as alice:
        done = alice.post(f"/api/v1/jobs/{run_id}/retry", headers={"X-CSRF-Token": _csrf(alice)})
        assert done.status_code == 200, done.text
        assert done.json()["job"]["state"] == "queued" and done.json()["attempt"] == 1
        assert jw.world.job_state(run_id) == "queued"
        kinds = [d["kind"] for d in alice.get(f"/api/v1/jobs/{run_id}/decisions").json()[
            "decisions"]]  # fmt: skip
        assert kinds[-1] == "retry"
        again = alice.post(f"/api/v1/jobs/{run_id}/retry", headers={"X-CSRF-Token": _csrf(alice)})
        assert again.status_code == 409 and "has not ended" in again.json()["error"]


def test_the_new_streams_refuse_before_they_open(jw: JobWorld) -> None:
    run_id = jw.running.run_id
    streams = ("/api/v1/jobs/events", f"/api/v1/jobs/{run_id}/logs/events",
               f"/api/v1/jobs/{run_id}/metrics/events")  # fmt: skip
    with jw.world.client() as nobody:
        for path in streams:
            refused = nobody.get(path)
            assert refused.status_code == 401 and "Sign in" in refused.json()["error"]
    with _signed_in(jw.world, "bob") as bob:
        refused = bob.get(f"/api/v1/jobs/{run_id}/metrics/events")
        assert refused.status_code == 403 and "belongs to alice" in refused.json()["error"]
        refused = bob.get("/api/v1/jobs/events", params={"limit": 0})
        assert refused.status_code == 400 and "Limit is 0" in refused.json()["error"]
        runs = {"run": [f"run-{i}" for i in range(8)]}
        refused = bob.get(f"/api/v1/jobs/{run_id}/metrics/events", params=runs)
        assert refused.status_code == 400 and "at most 8" in refused.json()["error"]
    with (
        _signed_in(jw.world, "alice") as alice,
        alice.stream("GET", "/api/v1/jobs/events", params={"project": "vision"}) as stream,
    ):
        assert stream.headers["content-type"].startswith("text/event-stream")
        name, first = next(sse_events(stream.iter_lines()))
        assert name == "jobs"
        assert {j["run_id"] for j in first["jobs"]} == {run_id, *jw.ended.values()}


def _mark(page: Any) -> None:
    """A mark on this document: a reload would make a new one without it."""
    page.evaluate("document.documentElement.dataset.sameDocument = 'yes'")


def _same_document(page: Any) -> bool:
    return bool(page.evaluate("document.documentElement.dataset.sameDocument") == "yes")


def test_pages_follow_the_log_and_the_jobs_list_and_retry(jw: JobWorld, tmp_path: Path) -> None:
    _require_browser()
    from playwright.sync_api import expect

    w = jw.world
    run_id = jw.running.run_id
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = sign_in_page(browser, w.url, w.tokens["alice"])
            with page.expect_response(lambda r: "/logs/events" in r.url):
                page.goto(f"{w.url}/jobs/{run_id}")
            log = page.get_by_role("log")
            expect(log).to_have_text(FIRST_LINES)
            expect(page.get_by_role("heading", name="Decision log")).to_be_visible()
            _mark(page)
            jw.node.call(jw.node.log(jw.running, "epoch 3: loss 0.5\n"))
            expect(log).to_have_text(FIRST_LINES + "epoch 3: loss 0.5\n")
            assert _same_document(page)
            screenshot(page, tmp_path, "job-logs")

            # The Jobs list, filtered to queued Jobs: a cancel elsewhere takes one out of it.
            listed = jw.ended["listed"]
            with page.expect_response(lambda r: "/api/v1/jobs/events" in r.url):
                page.goto(f"{w.url}/jobs?state=queued")
            expect(page.get_by_role("link", name=listed)).to_be_visible()
            _mark(page)
            assert w.tp_cancel("alice", listed, "gone from the queued list") == "cancelled"
            expect(page.get_by_role("link", name=listed)).to_have_count(0)
            assert _same_document(page)

            # Retry from the page.
            ended = jw.ended["browser"]
            page.goto(f"{w.url}/jobs/{ended}")
            expect(page.locator("#job-state")).to_have_text("cancelled")
            page.get_by_role("button", name="Retry this Job").click()
            expect(page.locator("#job-state")).to_have_text("queued")
            expect(page.get_by_role("button", name="Retry this Job")).to_have_count(0)
            screenshot(page, tmp_path, "job-retried")
        finally:
            browser.close()
    assert w.job_state(jw.ended["browser"]) == "queued"
