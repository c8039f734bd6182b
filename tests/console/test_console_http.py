"""The console over real HTTPS, as an attacker would try it: a real coordinator process with
``[console]`` on, httpx verifying its certificate against the coordinator's CA.

Every refusal is checked twice: the answer refuses, and the Job is as it was (read over the
gRPC Api as the admin, not through the console).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.support.console import ConsoleWorld, console_world, form_token, sign_in, sse_events

pytestmark = pytest.mark.timeout(180)

LABELS = ("private", "csrf", "page", "followed")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleWorld]:
    with console_world(tmp_path_factory.mktemp("console"), LABELS) as found:
        yield found


@contextmanager
def _signed_in(world: ConsoleWorld, who: str) -> Iterator[httpx.Client]:
    with world.client() as client:
        done = sign_in(client, world.tokens[who])
        assert done.status_code == 303, done.text
        yield client


def _csrf(client: httpx.Client) -> str:
    session = client.get("/api/v1/session")
    assert session.status_code == 200, session.text
    return str(session.json()["csrf_token"])


def test_sign_in_with_a_good_token_sets_a_strict_session_cookie(world: ConsoleWorld) -> None:
    with world.client() as client:
        done = sign_in(client, world.tokens["alice"])
        assert done.status_code == 303 and done.headers["location"] == "/fleets"
        cookies = [c for c in done.headers.get_list("set-cookie") if c.startswith("tp_console=")]
        assert len(cookies) == 1, done.headers
        attributes = [a.strip().lower() for a in cookies[0].split(";")]
        assert {"httponly", "secure", "samesite=strict", "path=/"} <= set(attributes)
        assert "max-age=7200" in attributes  # session_lifetime = "2h"
        session = client.get("/api/v1/session").json()
        assert session["user"] == {"name": "alice", "role": "researcher"}


@pytest.mark.parametrize("token", ["tpa_not-a-real-token", "not even a token", ""])
def test_a_bad_token_is_refused_and_sets_nothing(world: ConsoleWorld, token: str) -> None:
    with world.client() as client:
        done = sign_in(client, token)
        assert done.status_code == 401
        assert "set-cookie" not in done.headers
        assert "token" in done.text
        assert client.get("/api/v1/session").status_code == 401


def test_sign_in_without_the_pages_csrf_token_is_refused(world: ConsoleWorld) -> None:
    with world.client() as client:
        done = client.post("/sign-in", data={"token": world.tokens["alice"]})
        assert done.status_code == 403
        assert "set-cookie" not in done.headers
        assert client.get("/api/v1/session").status_code == 401


@pytest.mark.parametrize(
    "path", ["/api/v1/session", "/api/v1/fleets", "/api/v1/fleets/default", "/api/v1/jobs"]
)
def test_the_api_without_a_session_is_refused(world: ConsoleWorld, path: str) -> None:
    with world.client() as client:
        done = client.get(path)
        assert done.status_code == 401
        assert "Sign in at /sign-in" in done.json()["error"]
    with world.client() as forger:
        forger.cookies.set("tp_console", "forged-session-id")
        assert forger.get(path).status_code == 401


def test_a_page_without_a_session_redirects_to_sign_in(world: ConsoleWorld) -> None:
    with world.client() as client:
        done = client.get(f"/jobs/{world.jobs['private']}")
        assert done.status_code == 303 and done.headers["location"] == "/sign-in"
        assert world.jobs["private"] not in done.text


def test_fleet_and_nodes_are_listed(world: ConsoleWorld) -> None:
    with _signed_in(world, "bob") as client:
        fleets = client.get("/api/v1/fleets").json()["fleets"]
        assert [f["name"] for f in fleets] == ["default"]
        fleet = client.get("/api/v1/fleets/default").json()
        (node,) = fleet["nodes"]
        assert node["id"] == world.node_id and node["hostname"] == "host-a"
        assert node["connected"] is False and node["scheduling"]
        assert [g["healthy"] for g in node["gpus"]] == [True, True]
        assert node["credential_expires_at_ms"] > 0
        missing = client.get("/api/v1/fleets/nowhere")
        assert missing.status_code == 404 and "no Fleet" in missing.json()["error"]


def test_a_user_sees_only_the_jobs_tp_would_show(world: ConsoleWorld) -> None:
    with _signed_in(world, "alice") as alice, _signed_in(world, "bob") as bob:
        mine = {j["run_id"] for j in alice.get("/api/v1/jobs").json()["jobs"]}
        assert mine == set(world.jobs.values())
        assert bob.get("/api/v1/jobs").json()["jobs"] == []
        assert bob.get("/api/v1/jobs", params={"owner": "alice"}).json()["jobs"] == []
        filtered = alice.get("/api/v1/jobs", params={"project": "elsewhere"}).json()["jobs"]
        assert filtered == []
        job = alice.get(f"/api/v1/jobs/{world.jobs['private']}").json()
        assert job["job"]["owner"] == "alice" and job["job"]["state"] == "queued"
        refused = bob.get(f"/api/v1/jobs/{world.jobs['private']}")
        assert refused.status_code == 403
        assert "belongs to alice" in refused.json()["error"]
        assert "queued" not in refused.text
        page = bob.get(f"/jobs/{world.jobs['private']}")
        assert page.status_code == 403 and "belongs to alice" in page.text


def test_a_user_cannot_cancel_another_users_job(world: ConsoleWorld) -> None:
    run_id = world.jobs["private"]
    with _signed_in(world, "bob") as bob:
        refused = bob.post(
            f"/api/v1/jobs/{run_id}/cancel", headers={"X-CSRF-Token": _csrf(bob)}, json={}
        )
        assert refused.status_code == 403
        assert "only its owner or an admin may cancel it" in refused.json()["error"]
        page = bob.post(
            f"/jobs/{run_id}/cancel", data={"csrf_token": _csrf(bob), "reason": "mine now"}
        )
        assert page.status_code == 403
    assert world.job_state(run_id) == "queued"


def test_a_cancel_without_the_csrf_token_is_refused_and_changes_nothing(
    world: ConsoleWorld,
) -> None:
    run_id = world.jobs["csrf"]
    with _signed_in(world, "alice") as alice:
        for headers in ({}, {"X-CSRF-Token": "guessed"}):
            refused = alice.post(f"/api/v1/jobs/{run_id}/cancel", headers=headers, json={})
            assert refused.status_code == 403, refused.text
            assert "CSRF" in refused.json()["error"]
        form = alice.post(f"/jobs/{run_id}/cancel", data={"reason": "no token"})
        assert form.status_code == 403
        assert world.job_state(run_id) == "queued"
        # Another session's CSRF token is no good either.
        with _signed_in(world, "alice") as other:
            crossed = alice.post(
                f"/api/v1/jobs/{run_id}/cancel", headers={"X-CSRF-Token": _csrf(other)}
            )
            assert crossed.status_code == 403
        assert world.job_state(run_id) == "queued"

        done = alice.post(
            f"/api/v1/jobs/{run_id}/cancel",
            headers={"X-CSRF-Token": _csrf(alice)},
            json={"reason": "from the console"},
        )
        assert done.status_code == 200, done.text
        assert done.json()["outcome"] == "cancelled"
        assert done.json()["job"]["state"] == "cancelled"
    assert world.job_state(run_id) == "cancelled"


def test_the_cancel_form_cancels_for_the_owner(world: ConsoleWorld) -> None:
    run_id = world.jobs["page"]
    with _signed_in(world, "alice") as alice:
        page = alice.get(f"/jobs/{run_id}")
        assert page.status_code == 200 and 'id="cancel-button"' in page.text
        done = alice.post(
            f"/jobs/{run_id}/cancel", data={"csrf_token": form_token(page.text), "reason": ""}
        )
        assert done.status_code == 303 and done.headers["location"] == f"/jobs/{run_id}"
        after = alice.get(f"/jobs/{run_id}")
        assert 'id="cancel-button"' not in after.text
    assert world.job_state(run_id) == "cancelled"


def test_sign_out_ends_the_session(world: ConsoleWorld) -> None:
    with _signed_in(world, "alice") as alice:
        cookie = alice.cookies["tp_console"]
        refused = alice.post("/sign-out", data={"csrf_token": "wrong"})
        assert refused.status_code == 403
        assert alice.get("/api/v1/session").status_code == 200
        page = alice.get("/fleets")
        done = alice.post("/sign-out", data={"csrf_token": form_token(page.text)})
        assert done.status_code == 303
        cleared = [c for c in done.headers.get_list("set-cookie") if c.startswith("tp_console=")]
        assert cleared and "max-age=0" in cleared[0].lower()
    with world.client() as replay:
        # The old cookie, replayed, opens nothing: the session is gone on the server.
        replay.cookies.set("tp_console", cookie)
        assert replay.get("/api/v1/session").status_code == 401


def test_the_events_stream_refuses_without_a_session(world: ConsoleWorld) -> None:
    run_id = world.jobs["private"]
    with world.client() as client:
        refused = client.get(f"/api/v1/jobs/{run_id}/events")
        assert refused.status_code == 401
        assert refused.headers["content-type"].startswith("application/json")
        assert "Sign in at /sign-in" in refused.json()["error"]
        assert "queued" not in refused.text
    with world.client() as forger:
        forger.cookies.set("tp_console", "forged-session-id")
        assert forger.get(f"/api/v1/jobs/{run_id}/events").status_code == 401
    assert world.job_state(run_id) == "queued"


def test_the_events_stream_refuses_another_users_job(world: ConsoleWorld) -> None:
    run_id = world.jobs["private"]
    with _signed_in(world, "bob") as bob:
        refused = bob.get(f"/api/v1/jobs/{run_id}/events")
        assert refused.status_code == 403
        assert not refused.headers["content-type"].startswith("text/event-stream")
        assert "belongs to alice" in refused.json()["error"]
        assert "queued" not in refused.text
    assert world.job_state(run_id) == "queued"


def test_the_events_stream_follows_the_owners_job_until_it_ends(world: ConsoleWorld) -> None:
    run_id = world.jobs["followed"]
    with (
        _signed_in(world, "alice") as alice,
        alice.stream("GET", f"/api/v1/jobs/{run_id}/events") as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse_events(stream.iter_lines())
        name, first = next(events)
        assert (name, first["run_id"], first["state"]) == ("job", run_id, "queued")
        assert world.tp_cancel("alice", run_id, "cancelled with tp") == "cancelled"
        name, changed = next(events)
        assert (name, changed["state"]) == ("job", "cancelled")
        assert "cancelled with tp" in changed["state_reason"]
        # The Job has ended: the server ends the stream (no third event, no hang).
        assert list(events) == []
    assert world.job_state(run_id) == "cancelled"


def test_the_openapi_schema_lists_the_routes(world: ConsoleWorld) -> None:
    with world.client() as client:
        schema = client.get("/api/v1/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    assert set(paths) == {
        "/api/v1/openapi.json",
        "/api/v1/session",
        "/api/v1/fleets",
        "/api/v1/fleets/{name}",
        "/api/v1/jobs",
        "/api/v1/jobs/{run_id}",
        "/api/v1/jobs/events",
        "/api/v1/jobs/{run_id}/cancel",
        "/api/v1/jobs/{run_id}/retry",
        "/api/v1/jobs/{run_id}/decisions",
        "/api/v1/jobs/{run_id}/logs",
        "/api/v1/jobs/{run_id}/logs/events",
        "/api/v1/jobs/{run_id}/events",
        "/api/v1/jobs/{run_id}/metrics",
        "/api/v1/jobs/{run_id}/metrics/events",
        "/api/v1/jobs/{run_id}/series",
    }
    series = paths["/api/v1/jobs/{run_id}/series"]["get"]
    assert {p["name"] for p in series["parameters"]} >= {"tag", "from", "to", "buckets", "format"}
    assert set(series["responses"]["200"]["content"]) == {"application/json", "text/csv"}
    for change in ("cancel", "retry"):
        post = paths[f"/api/v1/jobs/{{run_id}}/{change}"]["post"]
        assert any(p["name"] == "X-CSRF-Token" for p in post["parameters"])
    logs = {p["name"] for p in paths["/api/v1/jobs/{run_id}/logs"]["get"]["parameters"]}
    assert {"attempt", "member", "stream", "from", "max_bytes"} <= logs
    for live in ("/jobs/events", "/jobs/{run_id}/logs/events", "/jobs/{run_id}/metrics/events"):
        responses = paths["/api/v1" + live]["get"]["responses"]
        assert set(responses["200"]["content"]) == {"text/event-stream"}
        assert {"401", "403", "429"} <= set(responses)
    assert "400" in paths["/api/v1/jobs/{run_id}/logs"]["get"]["responses"]
    assert {p["name"] for p in paths["/api/v1/jobs"]["get"]["parameters"]} >= {
        "project",
        "state",
        "owner",
    }


def test_every_answer_carries_the_security_headers(world: ConsoleWorld) -> None:
    with world.client() as client:
        for path in ("/sign-in", "/api/v1/jobs", "/nowhere"):
            headers = client.get(path).headers
            assert "frame-ancestors 'none'" in headers["content-security-policy"]
            assert headers["x-content-type-options"] == "nosniff"
