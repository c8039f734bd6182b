"""The console's Charts page on a 1,000,000-point series, end to end in a real browser.

Rules: everything is real and stays in a temporary folder. A coordinator (``init``, ``serve``
with ``[console]``) gets one launched member (tests/collector/delivery.py's ``launch_member``, a
Node enrolled and a Job submitted over the gRPC Api), and the series is shipped through the
telemetry listener's real Ship RPC with the member's own collector credential, in Ships of 5000
points as a collector sends them (tests/support/console.py's ``ship_points``, the one the chart
tests use). Then Debian's chromium, headless through Playwright (``playwright_session``), opens
the Job's Charts page, in a fresh browser context each run (nothing cached, signed in with the
session cookie the first sign-in got).

Measured per run, end to end: from the navigation's start (the page's ``performance.timeOrigin``)
to the first chart's ``data-drawn-at``, the ``performance.now()`` that ``charts.js`` notes in the
frame after uPlot drew (the marker the browser test also reads; it checks ``data-points``, the
million, and ``data-buckets``, the values drawn), so it holds the page's HTML, its scripts, the
metric and series reads and uPlot's first frame. Also printed: the page's own ``data-render-ms``
(reads and drawing only), Navigation Timing's ``responseEnd``, and the server side alone: the
series read the page makes (1000 buckets) over HTTPS, timed here. It prints medians and the
ratio of the end-to-end median to the goal of 1 s (issue 16: under 1 s).

Without chromium or Playwright it says what to install and prints the server-side figure alone.
Knobs (env): ``TUNEPLANE_BENCH_CONSOLE_POINTS`` (default 1,000,000) and
``TUNEPLANE_BENCH_CONSOLE_RUNS`` (default 7).
"""

from __future__ import annotations

import json
import math
import os
import ssl
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.collector.delivery import launch_member
from tests.console.test_console_browser import ARGS, CHROMIUM
from tests.console.test_console_million import million_values
from tests.support.console import (
    CONSOLE_TOML,
    HTTP_TIMEOUT_S,
    playwright_session,
    ship_points,
    sign_in,
)
from tests.support.coordinator import start_coordinator

GOAL_S = 1.0
TAG = "train/loss"
WAIT_MS = 60_000
# Long: the member's Node stream closes once it is launched; shipping must never outlast it.
HEARTBEAT_TIMEOUT_S = 3600


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _missing_browser() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"Debian's chromium is not at {CHROMIUM} (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install playwright)"
    return None


def _series(
    url: str, ca: Path, token: str, run_id: str, runs: int
) -> tuple[dict[str, Any], list[float]]:
    """The series as the page reads it (1000 buckets), signed in as the page is, and how long
    each of ``runs`` reads took (ms, request to the whole JSON parsed)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with httpx.Client(base_url=url, verify=ctx, timeout=HTTP_TIMEOUT_S) as client:
        done = sign_in(client, token)
        assert done.status_code == 303, done.text
        took = []
        for _ in range(runs):
            started = time.perf_counter()
            answer = client.get(f"/api/v1/jobs/{run_id}/series", params={"tag": TAG})
            assert answer.status_code == 200, answer.text
            series: dict[str, Any] = answer.json()
            took.append((time.perf_counter() - started) * 1000)
        return series, took


def _measure(url: str, token: str, run_id: str, runs: int) -> list[dict[str, float]]:
    from playwright.sync_api import expect

    figures = []
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            first = browser.new_context(ignore_https_errors=True)
            page = first.new_page()
            page.goto(url + "/sign-in")
            page.get_by_label("User token").fill(token)
            page.get_by_role("button", name="Sign in").click()
            expect(page).to_have_url(url + "/fleets")
            signed_in = first.storage_state()
            first.close()
            for _ in range(runs):
                context = browser.new_context(
                    ignore_https_errors=True,
                    storage_state=signed_in,
                    viewport={"width": 1280, "height": 900},
                )
                context.set_default_timeout(WAIT_MS)
                page = context.new_page()
                page.goto(f"{url}/jobs/{run_id}/charts", wait_until="commit")
                figure = page.locator("figure.chart").first
                expect(figure).to_have_attribute("data-state", "drawn", timeout=WAIT_MS)
                held = page.evaluate(
                    """() => {
                        const c = window.tuneplaneCharts["chart-0"];
                        const [run, column] = Object.entries(c.columns)[0];
                        return {
                            returned: c.buckets[run],
                            held: c.plot.data[column].filter((v) => v != null).length,
                        };
                    }"""
                )
                assert held["held"] == held["returned"] > 0, held
                assert figure.get_attribute("data-buckets") == str(held["held"])
                response = page.evaluate(
                    '() => performance.getEntriesByType("navigation")[0].responseEnd'
                )
                figures.append(
                    {
                        "end_to_end_ms": float(figure.get_attribute("data-drawn-at") or "nan"),
                        "render_ms": float(figure.get_attribute("data-render-ms") or "nan"),
                        "response_ms": float(response),
                        "buckets": float(held["held"]),
                    }
                )
                context.close()
        finally:
            browser.close()
    return figures


def main() -> int:
    points = _env_int("TUNEPLANE_BENCH_CONSOLE_POINTS", 1_000_000)
    runs = _env_int("TUNEPLANE_BENCH_CONSOLE_RUNS", 7)
    with tempfile.TemporaryDirectory(prefix="tuneplane-bench-console-") as tmp:
        root = Path(tmp)
        with start_coordinator(
            root, heartbeat_timeout=HEARTBEAT_TIMEOUT_S, config=CONSOLE_TOML
        ) as coord:
            url = json.loads((coord.state_dir / "endpoints.json").read_text())["console"]
            who = launch_member(coord, "bench")
            values = million_values(points)
            started = time.perf_counter()
            ship_points(coord, who, TAG, values)
            shipped = time.perf_counter() - started
            series, reads = _series(url, coord.ca_path, coord.admin_token, who.run_id, runs)
            assert series["total_points"] == points, series["total_points"]
            assert sum(series["count"]) == points and max(series["max"]) == 50.0
            print(
                f"shipped {points:,} points of {TAG} through the Ship RPC (Ships of 5000) in "
                f"{shipped:.1f} s; the page's read: {series['buckets']} buckets"
            )
            server = statistics.median(reads)
            print(
                f"server side: the page's series read ({series['buckets']} buckets of "
                f"{points:,} points) over HTTPS, median of {runs}: {server:.0f} ms"
            )
            missing = _missing_browser()
            if missing:
                print(f"console: no end-to-end figure: {missing}; install it and run again.")
                return 0
            figures = _measure(url, coord.admin_token, who.run_id, runs)
    for n, f in enumerate(figures, 1):
        print(
            f"  run {n}: end to end {f['end_to_end_ms']:.0f} ms (HTML response end "
            f"{f['response_ms']:.0f} ms, reads + drawing {f['render_ms']:.0f} ms), "
            f"{f['buckets']:.0f} buckets drawn"
        )
    median = statistics.median(f["end_to_end_ms"] for f in figures)
    render = statistics.median(f["render_ms"] for f in figures if not math.isnan(f["render_ms"]))
    response = statistics.median(f["response_ms"] for f in figures)
    print(
        f"Charts page, {points:,}-point series, fresh browser context each run, median of {runs}: "
        f"navigation start -> first chart drawn {median:.0f} ms (HTML {response:.0f} ms, the "
        f"page's reads + drawing {render:.0f} ms); ratio to the 1 s goal: "
        f"{median / 1000 / GOAL_S:.2f}; the server's series read alone {server:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
