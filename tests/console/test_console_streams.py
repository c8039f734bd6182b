"""The console's limit on live streams at once (``[console] max_streams``), against a real
coordinator whose console.toml sets it to 2: a third stream is refused with 429 and a sentence
while the two stay open and keep being served; closing one frees exactly one slot; streams
asked for at the same instant get no more slots than there are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.console import ConsoleWorld, console_world, sign_in, sse_events

pytestmark = pytest.mark.timeout(120)

LIMIT = 2
#: How long a closed stream may take to be noticed: the server finds the client gone when it
#: next writes to it, within a poll (one second) of the close.
FREED_WITHIN_S = 15.0


@pytest.fixture
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleWorld]:
    """A coordinator of the test's own: no stream another test opened holds a slot."""
    root = tmp_path_factory.mktemp("console-streams")
    with console_world(root, ("watched",), console_keys=f"max_streams = {LIMIT}\n") as found:
        yield found


def _open(stack: ExitStack, client: httpx.Client, run_id: str) -> Iterator[str]:
    """A Job's event stream, opened and its first event read (so the server counts it);
    its lines, to read on. Hold on to them: httpx closes a response whose line iterator is
    dropped, and the server then frees that stream's slot."""
    response = stack.enter_context(client.stream("GET", f"/api/v1/jobs/{run_id}/events"))
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    name, job = next(sse_events(lines))
    assert (name, job["run_id"]) == ("job", run_id)
    return lines


def _refused(client: httpx.Client, run_id: str) -> Any:
    with client.stream("GET", f"/api/v1/jobs/{run_id}/events") as response:
        response.read()
        return response


def test_a_stream_beyond_the_limit_is_refused_and_closing_one_frees_a_slot(
    world: ConsoleWorld, tmp_path: Path
) -> None:
    run_id = world.jobs["watched"]
    with world.client() as alice:
        assert sign_in(alice, world.tokens["alice"]).status_code == 303
        with ExitStack() as first, ExitStack() as second:
            held = [_open(first, alice, run_id), _open(second, alice, run_id)]
            refused = _refused(alice, run_id)
            assert refused.status_code == 429, refused.text
            said = refused.json()["error"]
            assert f"already serves {LIMIT} live streams" in said, said
            assert "[console] max_streams" in said and "Reload the page later" in said
            # Nothing changed: the open streams are still served (a keep-alive a poll later),
            # and the Job is as it was.
            assert [next(lines) for lines in held] == [": still here"] * LIMIT
            assert world.job_state(run_id) == "queued"
            # The Jobs list stream counts too: still refused.
            assert alice.get("/api/v1/jobs/events").status_code == 429

            first.close()
            deadline = time.monotonic() + FREED_WITHIN_S
            with ExitStack() as third:
                while True:
                    response = third.enter_context(
                        alice.stream("GET", f"/api/v1/jobs/{run_id}/events")
                    )
                    if response.status_code == 200:
                        break
                    assert response.status_code == 429, response.read()
                    assert time.monotonic() < deadline, "closing a stream freed no slot"
                    response.read()
                    response.close()
                    time.sleep(0.2)
                # One slot was freed, and it is taken again.
                assert _refused(alice, run_id).status_code == 429
        assert world.job_state(run_id) == "queued"


def test_streams_asked_for_at_once_get_no_more_slots_than_there_are(world: ConsoleWorld) -> None:
    run_id = world.jobs["watched"]
    asked = LIMIT + 3
    start = threading.Barrier(asked, timeout=30)
    done = threading.Event()
    with world.client() as alice:
        assert sign_in(alice, world.tokens["alice"]).status_code == 303
        cookies = alice.cookies

        def ask() -> int:
            with world.client() as client:
                client.cookies = cookies
                start.wait()
                with client.stream("GET", f"/api/v1/jobs/{run_id}/events") as response:
                    if response.status_code == 200:
                        # The iterators are held: one dropped is closed, and so is the response.
                        events = sse_events(response.iter_lines())
                        next(events)
                        # Held open until every answer is in.
                        assert done.wait(60)
                    return response.status_code

        with ThreadPoolExecutor(asked) as pool:
            answers = [pool.submit(ask) for _ in range(asked)]
            # The refused answer at once; the granted hold their streams open meanwhile.
            pending = set(answers)
            deadline = time.monotonic() + 60
            while asked - len(pending) < asked - LIMIT:
                left = deadline - time.monotonic()
                assert left > 0, "fewer refusals than streams beyond the limit"
                _, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            refused = [a.result() for a in answers if a not in pending]
            done.set()
            statuses = sorted(a.result(60) for a in answers)
    assert refused == [429] * (asked - LIMIT)
    assert statuses == [200] * LIMIT + [429] * (asked - LIMIT)
    assert world.job_state(run_id) == "queued"
