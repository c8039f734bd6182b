"""The console in a real browser: Debian's chromium, headless, driven by Playwright for Python,
against a real coordinator over TLS. The browser context accepts the test's dev CA with
``ignore_https_errors`` (chromium has no per-context CA file); the HTTP tests
(test_console_http.py) verify the certificate against the coordinator's CA.

Outside CI a missing chromium or Playwright skips with a sentence; under CI=true it fails.
Screenshots go to the test's temporary directory (and ``$TUNEPLANE_TEST_ARTIFACTS`` when set).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

# Missing, the tests skip with a sentence (_require_browser), or fail under CI.
with contextlib.suppress(ImportError):
    from playwright.sync_api import Page, expect

from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.accounts import require
from tests.support.console import (
    ConsoleWorld,
    console_world,
    playwright_session,
    screenshot,
    sign_in_page,
)

pytestmark = pytest.mark.timeout(240)

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
WAIT_MS = 15_000


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleWorld]:
    with console_world(
        tmp_path_factory.mktemp("console-browser"), ("shown", "cancel", "live")
    ) as found:
        yield found


def _require_browser() -> None:
    require(Path(CHROMIUM).exists(), f"Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        require(False, "Playwright for Python (pip install playwright)")


def _sign_in(page: Page, world: ConsoleWorld, who: str) -> None:
    page.goto(world.url + "/sign-in")
    page.get_by_label("User token").fill(world.tokens[who])
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(world.url + "/fleets")


def test_sign_in_see_the_fleet_and_a_job_and_cancel_it(world: ConsoleWorld, tmp_path: Path) -> None:
    _require_browser()
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = browser.new_context(ignore_https_errors=True)
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()

            def shot(name: str) -> None:
                screenshot(page, tmp_path, name)

            page.goto(world.url + "/")
            expect(page).to_have_url(world.url + "/sign-in")
            # Keyboard only: the token field has its label and the button is reachable by Tab.
            page.get_by_label("User token").fill(world.tokens["alice"])
            shot("sign-in")
            page.keyboard.press("Enter")
            expect(page).to_have_url(world.url + "/fleets")
            expect(page.get_by_text("Signed in as alice")).to_be_visible()
            shot("fleets")

            page.get_by_role("link", name="default").click()
            expect(page.get_by_role("heading", name="Fleet default")).to_be_visible()
            expect(page.get_by_role("cell", name="host-a", exact=True)).to_be_visible()
            expect(page.get_by_text("GPU 0 h200: healthy, free")).to_be_visible()
            shot("fleet")

            page.get_by_role("link", name="Jobs").click()
            page.get_by_label("Project").fill("vision")
            page.get_by_role("button", name="Filter").click()
            for run_id in world.jobs.values():
                expect(page.get_by_role("link", name=run_id)).to_be_visible()
            shot("jobs")

            run_id = world.jobs["cancel"]
            page.get_by_role("link", name=run_id).click()
            expect(page.locator("#job-state")).to_have_text("queued")
            shot("job")
            page.get_by_label("Reason (optional)").fill("from the browser test")
            page.get_by_role("button", name="Cancel this Job").click()
            expect(page.locator("#job-state")).to_have_text("cancelled")
            expect(page.get_by_role("button", name="Cancel this Job")).to_have_count(0)
            shot("job-cancelled")
        finally:
            browser.close()
    assert world.job_state(run_id) == "cancelled"
    assert world.job_state(world.jobs["shown"]) == "queued"


def test_a_job_page_follows_a_cancel_made_elsewhere_without_a_reload(
    world: ConsoleWorld, tmp_path: Path
) -> None:
    """The Job page's server-sent events: another client (its owner running ``tp job cancel``)
    cancels the Job, and the open page shows it, in the same document."""
    _require_browser()
    run_id = world.jobs["live"]
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = browser.new_context(ignore_https_errors=True)
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()
            _sign_in(page, world, "alice")
            # The stream's first event is the Job as it is; wait for it so the cancel below
            # lands after the page is following (not before the page loaded).
            with page.expect_response(lambda r: r.url.endswith(f"/jobs/{run_id}/events")):
                page.goto(f"{world.url}/jobs/{run_id}")
            expect(page.locator("#job-state")).to_have_text("queued")
            # A mark on this document: a reload would make a new one without it.
            page.evaluate("document.documentElement.dataset.sameDocument = 'yes'")

            assert world.tp_cancel("alice", run_id, "cancelled with tp") == "cancelled"

            expect(page.locator("#job-state")).to_have_text("cancelled")
            expect(page.locator("#job-state-reason")).to_contain_text("cancelled with tp")
            expect(page.get_by_role("button", name="Cancel this Job")).to_have_count(0)
            assert page.evaluate("document.documentElement.dataset.sameDocument") == "yes"
            screenshot(page, tmp_path, "job-live-cancelled")
        finally:
            browser.close()
    assert world.job_state(run_id) == "cancelled"


def test_a_job_that_ends_while_its_page_is_open_offers_retry_to_who_may_without_a_reload(
    world: ConsoleWorld, tmp_path: Path
) -> None:
    """Alice's Job, shared with bob, is cancelled with ``tp`` while both have its page open:
    alice's page shows the Retry button in the same document, and pressing it queues the Job;
    bob may read the Job but not change it, so his page has no Retry form at all."""
    _require_browser()

    async def submit() -> str:
        async with api_client(world.coord.api, world.coord.ca_path, world.tokens["alice"]) as api:
            spec = {**jobspec(gpus=1, project="vision"), "share_with": ["bob"]}
            return (await api.submit(spec, "k-ends-live")).run_id

    run_id = asyncio.run(submit())
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            tokens = world.tokens
            pages = {who: sign_in_page(browser, world.url, token) for who, token in tokens.items()}
            for page in pages.values():
                with page.expect_response(lambda r: r.url.endswith(f"/jobs/{run_id}/events")):
                    page.goto(f"{world.url}/jobs/{run_id}")
                expect(page.locator("#job-state")).to_have_text("queued")
                page.evaluate("document.documentElement.dataset.sameDocument = 'yes'")
            alice, bob = pages["alice"], pages["bob"]
            expect(alice.get_by_role("button", name="Cancel this Job")).to_have_count(1)
            expect(alice.get_by_role("button", name="Retry this Job")).to_have_count(0)
            expect(bob.locator("#retry-form")).to_have_count(0)

            assert world.tp_cancel("alice", run_id, "ended while shown") == "cancelled"

            for page in pages.values():
                expect(page.locator("#job-state")).to_have_text("cancelled")
                assert page.evaluate("document.documentElement.dataset.sameDocument") == "yes"
            expect(alice.get_by_role("button", name="Retry this Job")).to_be_visible()
            expect(alice.get_by_role("button", name="Cancel this Job")).to_have_count(0)
            expect(bob.locator("#retry-form")).to_have_count(0)
            screenshot(alice, tmp_path, "job-live-retry")
            alice.get_by_role("button", name="Retry this Job").click()
            expect(alice.locator("#job-state")).to_have_text("queued")
        finally:
            browser.close()
    assert world.job_state(run_id) == "queued"
