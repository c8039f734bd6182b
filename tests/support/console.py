"""A real coordinator with its console on, its users, a Fleet with a Node and Jobs to look at,
for the console's HTTP and browser tests.

Rules: everything is real (``init``, ``serve`` with ``[console]`` in coordinator.toml, users made
by ``user create``, a Node enrolled with a join token, Jobs submitted over the gRPC Api); the
console is reached over TLS verified against the coordinator's own CA. Paths stay under the
test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx

from tests.cli.tp_process import run_tp_as
from tests.collector.delivery import Launched, launch_member
from tests.coordinator.grpc_client import api_client, bearer, enroll, jobspec, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

CONSOLE_TOML = '\n[console]\nlisten = "127.0.0.1:0"\nsession_lifetime = "2h"\n'
HTTP_TIMEOUT_S = 15.0


@attrs.frozen
class ConsoleWorld:
    coord: CoordinatorProcess
    url: str  # https://127.0.0.1:PORT
    tokens: dict[str, str]  # user -> token
    jobs: dict[str, str]  # label -> run id (all alice's, queued)
    node_id: str
    launched: Launched | None = None  # the admin's Job with a member launched, when asked for

    def client(self) -> httpx.Client:
        """An HTTP client that verifies the console against the coordinator's CA."""
        ctx = ssl.create_default_context(cafile=str(self.coord.ca_path))
        return httpx.Client(base_url=self.url, verify=ctx, timeout=HTTP_TIMEOUT_S)

    def job_state(self, run_id: str) -> str:
        """The Job's state as the admin reads it over the gRPC Api (not through the console)."""

        async def read() -> str:
            async with api_client(
                self.coord.api, self.coord.ca_path, self.coord.admin_token
            ) as api:
                return str((await api.job(run_id)).state)

        return asyncio.run(read())

    def tp_cancel(self, who: str, run_id: str, reason: str) -> str:
        """``tp job cancel`` as ``who``, a real tp process outside the console (so it also works
        while a browser's event loop runs in this thread); the outcome CancelJob answered."""
        token_file = self.coord.state_dir / f"{who}.token"
        token_file.write_text(self.tokens[who] + "\n")
        done = run_tp_as(self.coord, token_file, "job", "cancel", run_id, "--reason", reason,
                         "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        return str(json.loads(done.stdout)["outcome"])


def form_token(html: str) -> str:
    """The csrf_token hidden field of a console page."""
    found = re.search(r'name="csrf_token" value="([^"]*)"', html)
    assert found is not None, html
    return found.group(1)


def sign_in(client: httpx.Client, token: str) -> httpx.Response:
    """Sign in as the sign-in page does: its form, its CSRF token, the pasted token."""
    page = client.get("/sign-in")
    assert page.status_code == 200, page.text
    return client.post("/sign-in", data={"token": token, "csrf_token": form_token(page.text)})


@contextmanager
def console_world(
    root: Path,
    labels: tuple[str, ...],
    launched: str = "",
    heartbeat_timeout: int = 120,
    console_keys: str = "",
) -> Iterator[ConsoleWorld]:
    """A coordinator with the console on; alice owns one queued Job per label. With
    ``launched``, first a Node of that name runs one member of a Job of the admin's (launched
    before alice submits, so none of hers takes its GPU). A test that holds a Node's stream
    open (tests/support/live_node.py) asks for a ``heartbeat_timeout`` longer than it runs.
    ``console_keys`` (TOML lines) go into the ``[console]`` table."""
    if launched:
        heartbeat_timeout = max(heartbeat_timeout, 3600)
    config = CONSOLE_TOML + console_keys
    with start_coordinator(root, heartbeat_timeout=heartbeat_timeout, config=config) as coord:
        who = launch_member(coord, launched) if launched else None
        endpoints = json.loads((coord.state_dir / "endpoints.json").read_text())
        url = endpoints["console"]
        assert url.startswith("https://127.0.0.1:"), endpoints
        tokens = {name: coord.create_user(name) for name in ("alice", "bob")}
        node = asyncio.run(
            enroll(coord.control, coord.ca_path, coord.create_join_token(), "host-a", 2)
        )

        async def submit() -> dict[str, str]:
            async with api_client(coord.api, coord.ca_path, tokens["alice"]) as api:
                return {
                    label: (
                        await api.submit(jobspec(gpus=1, project="vision"), f"k-{label}")
                    ).run_id
                    for label in labels
                }

        jobs = asyncio.run(submit())
        yield ConsoleWorld(coord, url, tokens, jobs, node.node_id, who)


def ship_points(
    coord: CoordinatorProcess, who: Launched, tag: str, values: list[float], first_step: int = 0
) -> None:
    """Ship ``values`` (step ``first_step + i``: values[i]) as ``tag`` through the real Ship
    RPC of the telemetry listener, with the member's own collector credential, in batches as a
    collector sends them."""
    points = [
        v1.MetricPoint(
            source_id="report.rank0.jsonl",
            offset=step * 10 + len(tag),
            tag=tag,
            step=step,
            has_wall_time=True,
            wall_time=1.7e9 + step,
            value=value,
        )
        for step, value in enumerate(values, start=first_step)
    ]

    async def go() -> None:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            stub = v1.TelemetryStub(channel, metadata=bearer(who.credential), timeout=30)
            for start in range(0, len(points), 5000):
                await stub.ship(
                    v1.ShipRequest(
                        member=who.member,
                        points=points[start : start + 5000],
                        progress=v1.CollectorProgress(spool_points=0),
                    )
                )
        finally:
            channel.close()

    asyncio.run(go())


@contextmanager
def playwright_session() -> Iterator[Any]:
    """Playwright's sync API on a plain asyncio loop. Once any test in this pytest worker has
    imported trio_asyncio (the agent's tests do), ``asyncio.new_event_loop()`` makes its own
    loop, on which Playwright fails ("You can't nest calls to run_until_complete()"); an
    explicit default policy gives Playwright a plain loop for this block, and None afterwards
    hands new loops back to whoever made them before."""
    from playwright.sync_api import sync_playwright

    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    try:
        with sync_playwright() as pw:
            yield pw
    finally:
        asyncio.set_event_loop_policy(None)


def sign_in_page(browser: Any, url: str, token: str, wait_ms: int = 15_000) -> Any:
    """A fresh browser context's page, signed in with ``token`` through the sign-in form (the
    console's certificate accepted: chromium has no per-context CA file)."""
    from playwright.sync_api import expect

    context = browser.new_context(ignore_https_errors=True, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(wait_ms)
    page = context.new_page()
    page.goto(url + "/sign-in")
    page.get_by_label("User token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(url + "/fleets")
    return page


def screenshot(page: Any, folder: Path, name: str) -> None:
    """A full-page screenshot ``console-<name>.png`` into ``folder`` (the test's temporary
    directory), copied into ``$TUNEPLANE_TEST_ARTIFACTS`` when that is set (docs/console.md
    lists them)."""
    shot = folder / f"console-{name}.png"
    page.screenshot(path=str(shot), full_page=True)
    kept = os.environ.get("TUNEPLANE_TEST_ARTIFACTS")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(kept) / shot.name)


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Server-sent events ``(name, data)`` from a stream's lines; comments skipped."""
    name, data = "", ""
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = line[len("data: ") :]
        elif line == "" and name:
            yield name, json.loads(data)
            name, data = "", ""
