"""A 1,000,000-point series drawn by the Charts page in a real browser, end to end: a real
coordinator, the points shipped through the telemetry listener's real Ship RPC with the member's
own collector credential, and chromium opening the page.

The test checks what was drawn, not how fast: the first chart's ``data-points`` (the stored
points its buckets summarize) is the whole million and ``data-buckets`` (the values uPlot holds)
is the page's bucket count. How fast is the bench's to say (``nox -s bench -- console``, which
reads the same ``data-drawn-at`` marker this test prints).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.collector.delivery import launch_member
from tests.console.test_console_browser import ARGS, CHROMIUM, _require_browser
from tests.support.console import CONSOLE_TOML, playwright_session, ship_points, sign_in_page
from tests.support.coordinator import start_coordinator

# Shipping a million points through the Ship RPC takes a minute and a half on a loaded 2-core
# machine; the Node stream must not be declared lost meanwhile.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POINTS = 1_000_000
TAG = "train/loss"
BUCKETS = 1000  # what the Charts page asks for
WAIT_MS = 60_000


def million_values(points: int) -> list[float]:
    """A decaying loss with one spike two thirds in (the bench ships the same)."""
    return [50.0 if s == points * 2 // 3 else 1.0 / (1 + s / 1000) for s in range(points)]


def test_a_million_point_series_is_drawn_whole(tmp_path: Path) -> None:
    _require_browser()
    from playwright.sync_api import expect

    with start_coordinator(tmp_path, heartbeat_timeout=3600, config=CONSOLE_TOML) as coord:
        url = json.loads((coord.state_dir / "endpoints.json").read_text())["console"]
        who = launch_member(coord, "million")
        ship_points(coord, who, TAG, million_values(POINTS))
        with playwright_session() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = sign_in_page(browser, url, coord.admin_token)
                page.goto(f"{url}/jobs/{who.run_id}/charts")
                figure = page.locator("figure.chart").first
                expect(figure).to_have_attribute("data-state", "drawn", timeout=WAIT_MS)
                assert figure.get_attribute("data-points") == str(POINTS)
                assert figure.get_attribute("data-buckets") == str(BUCKETS)
                held = page.evaluate(
                    """() => {
                        const c = window.tuneplaneCharts["chart-0"];
                        const [run, column] = Object.entries(c.columns)[0];
                        const xs = c.plot.data[0];
                        return {
                            returned: c.buckets[run],
                            held: c.plot.data[column].filter((v) => v != null).length,
                            last: xs[xs.length - 1],
                            top: Math.max(...c.plot.data[column - 1].filter((v) => v != null)),
                        };
                    }"""
                )
                assert held == {
                    "returned": BUCKETS,
                    "held": BUCKETS,
                    "last": POINTS - 1,
                    "top": 50.0,  # the spike's bucket max is drawn
                }
                print(
                    f"{POINTS} points in {BUCKETS} buckets drawn "
                    f"{figure.get_attribute('data-drawn-at')} ms after navigation start"
                )
            finally:
                browser.close()
