"""Accessibility: axe-core audits each console page in a real browser, and the keyboard alone
cancels a Job.

axe-core is vendored as its built file (tests/support/axe.min.js, MPL-2.0, its licences beside
it; docs/console.md says how to refresh it) and injected as an init script (which the pages'
Content-Security-Policy does not govern, so the pages are audited with their CSP on). A page
passes when axe finds no violation of serious or critical impact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.console.test_console_browser import ARGS, CHROMIUM, _require_browser
from tests.support.console import (
    ConsoleWorld,
    console_world,
    playwright_session,
    ship_points,
    sign_in_page,
)

pytestmark = pytest.mark.timeout(300)

AXE = Path(__file__).parent.parent / "support" / "axe.min.js"
BLOCKING = ("serious", "critical")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ConsoleWorld, str]]:
    """Alice's queued Jobs, and a launched Job (the admin's) with a chartable series."""
    root = tmp_path_factory.mktemp("console-a11y")
    with console_world(root, ("audited", "keyboard"), launched="a11y") as w:
        assert w.launched is not None
        ship_points(w.coord, w.launched, "train/loss", [1.0 / (1 + s) for s in range(500)])
        yield w, w.launched.run_id


def _violations(page: Any) -> list[dict[str, Any]]:
    """axe's violations of serious or critical impact on the page as it is now: rule id,
    impact, help text and the first few offending nodes."""
    found: dict[str, Any] = page.evaluate(
        """async (blocking) => {
            const result = await axe.run(document);
            return {
                passed: result.passes.length,
                violations: result.violations
                    .filter((v) => blocking.includes(v.impact))
                    .map((v) => ({id: v.id, impact: v.impact, help: v.help,
                                  nodes: v.nodes.slice(0, 3).map((n) => n.html)})),
            };
        }""",
        list(BLOCKING),
    )
    assert found["passed"] > 5, found  # axe ran its rules on this page
    violations: list[dict[str, Any]] = found["violations"]
    return violations


def test_every_page_has_no_serious_accessibility_violation(world: tuple[ConsoleWorld, str]) -> None:
    _require_browser()
    from playwright.sync_api import expect

    w, charted = world
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = browser.new_context(ignore_https_errors=True)
            context.add_init_script(path=str(AXE))
            page = context.new_page()
            page.goto(w.url + "/sign-in")
            found = {"sign-in": _violations(page)}
            page.get_by_label("User token").fill(w.coord.admin_token)
            page.get_by_role("button", name="Sign in").click()
            expect(page).to_have_url(w.url + "/fleets")
            found["fleets"] = _violations(page)
            for name, path in (
                ("fleet", "/fleets/default"),
                ("jobs", "/jobs"),
                ("job", f"/jobs/{w.jobs['audited']}"),
                ("launched job", f"/jobs/{charted}"),
            ):
                page.goto(w.url + path)
                expect(page.locator("h1")).to_be_visible()
                found[name] = _violations(page)
            page.goto(f"{w.url}/jobs/{charted}/charts")
            expect(page.locator("figure.chart").first).to_have_attribute("data-state", "drawn")
            found["charts"] = _violations(page)
        finally:
            browser.close()
    assert {name: v for name, v in found.items() if v} == {}


def test_the_keyboard_alone_reaches_and_presses_cancel(world: tuple[ConsoleWorld, str]) -> None:
    _require_browser()
    from playwright.sync_api import expect

    w, _ = world
    run_id = w.jobs["keyboard"]
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = sign_in_page(browser, w.url, w.tokens["alice"])
            page.goto(f"{w.url}/jobs/{run_id}")
            expect(page.locator("#job-state")).to_have_text("queued")
            for _ in range(40):  # far more stops than the page has before the button
                page.keyboard.press("Tab")
                if page.evaluate("document.activeElement.id") == "cancel-button":
                    break
            assert page.evaluate("document.activeElement.id") == "cancel-button"
            page.keyboard.press("Enter")
            expect(page.locator("#job-state")).to_have_text("cancelled")
        finally:
            browser.close()
    assert w.job_state(run_id) == "cancelled"
