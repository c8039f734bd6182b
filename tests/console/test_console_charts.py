"""The Charts page and its series endpoint, against a real coordinator whose telemetry store was
filled through the real Ship RPC with a launched member's own collector credential.

HTTP: the endpoint answers QuerySeries' buckets (bounded, a zoom reads a step range finer, CSV
as text/csv) and refuses as QuerySeries does. Browser: chromium draws the chart, and the points
uPlot holds (read through the page's documented test hook, ``window.tuneplaneCharts``) are the
buckets the server returned; a drag zooms by reading the range again.
"""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from tests.collector.delivery import Launched, launch_member
from tests.console.test_console_browser import ARGS, CHROMIUM, WAIT_MS, _require_browser
from tests.support.console import (
    CONSOLE_TOML,
    HTTP_TIMEOUT_S,
    playwright_session,
    screenshot,
    ship_points,
    sign_in,
    sign_in_page,
)
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.timeout(240)

POINTS = 20_000
SPIKE_STEP = 12_345
TAG = "train/loss"


@attrs.frozen
class Charted:
    coord: CoordinatorProcess
    url: str
    run_id: str
    bob: str  # another researcher's token
    who: Launched  # the launched member, whose collector credential ships more points


def _loss() -> list[float]:
    values = [1.0 / (1 + step / 100) for step in range(POINTS)]
    values[SPIKE_STEP] = 40.0
    return values


@pytest.fixture(scope="module")
def charted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Charted]:
    root = tmp_path_factory.mktemp("console-charts")
    with start_coordinator(root, heartbeat_timeout=120, config=CONSOLE_TOML) as coord:
        url = json.loads((coord.state_dir / "endpoints.json").read_text())["console"]
        who = launch_member(coord, "charts")  # submitted by the admin
        ship_points(coord, who, TAG, _loss())
        ship_points(coord, who, "eval/acc", [step / 300 for step in range(300)])
        yield Charted(coord, url, who.run_id, coord.create_user("bob"), who)


def _anonymous(charted: Charted) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(charted.coord.ca_path))
    return httpx.Client(base_url=charted.url, verify=ctx, timeout=HTTP_TIMEOUT_S)


@contextmanager
def _client(charted: Charted, token: str) -> Iterator[httpx.Client]:
    with _anonymous(charted) as client:
        done = sign_in(client, token)
        assert done.status_code == 303, done.text
        yield client


def _series(client: httpx.Client, run_id: str, **params: Any) -> dict[str, Any]:
    answer = client.get(f"/api/v1/jobs/{run_id}/series", params={"tag": TAG, **params})
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def test_tags_and_a_bounded_series_keep_the_spike(charted: Charted) -> None:
    with _client(charted, charted.coord.admin_token) as admin:
        tags = admin.get(f"/api/v1/jobs/{charted.run_id}/metrics").json()["tags"]
        assert {(t["tag"], t["points"]) for t in tags} == {(TAG, POINTS), ("eval/acc", 300)}
        s = _series(admin, charted.run_id, buckets=500)
        assert s["total_points"] == POINTS and s["downsampled"] is True
        assert s["buckets"] == len(s["last"]) == 500
        assert sum(s["count"]) == POINTS
        assert max(s["max"]) == 40.0  # the spike survives bucketing
        assert s["first_step"][0] == 0 and s["last_step"][-1] == POINTS - 1


def test_a_zoom_reads_its_step_range_at_finer_resolution(charted: Charted) -> None:
    with _client(charted, charted.coord.admin_token) as admin:
        whole = _series(admin, charted.run_id, buckets=200)
        zoom = _series(admin, charted.run_id, buckets=200, **{"from": 12_000, "to": 12_599})
        assert zoom["from"] == 12_000 and zoom["to"] == 12_599
        assert zoom["first_step"][0] == 12_000 and zoom["last_step"][-1] == 12_599
        assert sum(zoom["count"]) == 600  # every point inside, none outside
        # Finer: 200 buckets over 600 steps (3 each) against 100 steps each over the whole.
        assert zoom["count"][0] == 3 and whole["count"][0] == 100
        spike = zoom["first_step"].index(SPIKE_STEP - SPIKE_STEP % 3)
        assert zoom["max"][spike] == 40.0
        exact = _series(admin, charted.run_id, buckets=1000, **{"from": 100, "to": 109})
        assert exact["count"] == [1] * 10 and exact["downsampled"] is False
        assert exact["last"] == [1.0 / (1 + step / 100) for step in range(100, 110)]


def test_csv_download_is_the_same_buckets_as_text_csv(charted: Charted) -> None:
    with _client(charted, charted.coord.admin_token) as admin:
        params: dict[str, str | int] = {"tag": TAG, "buckets": 50, "format": "csv"}
        answer = admin.get(f"/api/v1/jobs/{charted.run_id}/series", params=params)
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/csv")
        assert "attachment" in answer.headers["content-disposition"]
        rows = answer.text.splitlines()
        assert rows[0] == "first_step,last_step,count,min,max,last"
        s = _series(admin, charted.run_id, buckets=50)
        assert len(rows) == 1 + s["buckets"]
        first = rows[1].split(",")
        assert [int(first[0]), int(first[1]), int(first[2])] == [
            s["first_step"][0],
            s["last_step"][0],
            s["count"][0],
        ]
        assert math.isclose(float(first[5]), s["last"][0])


def test_the_series_endpoint_refuses_as_query_series_does(charted: Charted) -> None:
    path = f"/api/v1/jobs/{charted.run_id}/series"
    with _anonymous(charted) as nobody:
        refused = nobody.get(path, params={"tag": TAG})
        assert refused.status_code == 401 and "last" not in refused.json()
    with _client(charted, charted.bob) as bob:
        for where in (path, f"/api/v1/jobs/{charted.run_id}/metrics"):
            refused = bob.get(where, params={"tag": TAG, "format": "csv"})
            assert refused.status_code == 403
            assert "belongs to" in refused.json()["error"]
            assert "first_step" not in refused.text
        page = bob.get(f"/jobs/{charted.run_id}/charts")
        assert page.status_code == 403 and TAG not in page.text
    with _client(charted, charted.coord.admin_token) as admin:
        cases: tuple[tuple[dict[str, str | int], str], ...] = (
            ({"tag": TAG, "buckets": 10_001}, "ask for 1 to 10000"),
            ({"tag": TAG, "buckets": 0}, "ask for 1 to 10000"),
            ({"tag": ""}, "Tag is empty"),
            ({"tag": TAG, "from": 5, "to": 4}, "is empty"),
            ({"tag": TAG, "from": "ten"}, "whole number"),
            ({"tag": TAG, "format": "xml"}, "json"),
        )
        for params, said in cases:
            refused = admin.get(path, params=params)
            assert refused.status_code == 400, (params, refused.text)
            assert said in refused.json()["error"], refused.text
        missing = admin.get(path, params={"tag": "no/such"})
        assert missing.status_code == 404 and "tp metrics" in missing.json()["error"]


def _drawn(page: Any, figure: str) -> dict[str, Any]:
    """What the chart holds, through the page's test hook: per run, the buckets the server
    returned and the points uPlot holds in that run's last line; the x range drawn."""
    found: dict[str, Any] = page.evaluate(
        """(id) => {
            const c = window.tuneplaneCharts[id];
            const runs = {};
            for (const [run, column] of Object.entries(c.columns)) {
                runs[run] = {
                    returned: c.buckets[run],
                    held: c.plot.data[column].filter((v) => v !== null && v !== undefined).length,
                };
            }
            const xs = c.plot.data[0];
            return {runs: runs, first: xs[0], last: xs[xs.length - 1]};
        }""",
        figure,
    )
    return found


def test_the_charts_page_draws_every_bucket_and_zooms(charted: Charted, tmp_path: Path) -> None:
    _require_browser()
    from playwright.sync_api import expect

    run_id = charted.run_id
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = browser.new_context(
                ignore_https_errors=True, viewport={"width": 1280, "height": 900}
            )
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(charted.url + "/sign-in")
            page.get_by_label("User token").fill(charted.coord.admin_token)
            page.get_by_role("button", name="Sign in").click()
            page.goto(f"{charted.url}/jobs/{run_id}")
            page.get_by_role("link", name="Charts").click()
            figure = page.locator("figure.chart").first
            expect(figure).to_have_attribute("data-state", "drawn")
            expect(figure).to_have_attribute("data-tag", "eval/acc")  # the first tag, sorted
            page.get_by_role("checkbox", name=TAG).check()
            page.get_by_role("checkbox", name="eval/acc").uncheck()
            page.get_by_role("button", name="Draw").click()
            figure = page.locator("figure.chart").first
            expect(figure).to_have_attribute("data-tag", TAG)
            expect(figure).to_have_attribute("data-state", "drawn")
            drawn = _drawn(page, "chart-0")
            (run,) = drawn["runs"].values()
            assert run["held"] == run["returned"] == 1000  # the page's bucket count
            assert (drawn["first"], drawn["last"]) == (19, POINTS - 1)  # x: each bucket's last step
            render_ms = int(figure.get_attribute("data-render-ms") or "-1")
            assert 0 <= render_ms < 5000
            print(f"chart of {POINTS} points in {run['returned']} buckets drawn in {render_ms} ms")
            screenshot(page, tmp_path, "charts")

            # Zoom: drag across the middle of the plot; the page reads that range again.
            box = page.locator("#chart-0 .u-over").bounding_box()
            assert box is not None
            y = box["y"] + box["height"] / 2
            page.mouse.move(box["x"] + box["width"] * 0.4, y)
            page.mouse.down()
            page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=5)
            page.mouse.up()
            expect(figure).to_have_attribute("data-state", "drawn")
            page.wait_for_function("() => window.tuneplaneCharts['chart-0'].plot.data[0][0] > 5000")
            zoomed = _drawn(page, "chart-0")
            (run,) = zoomed["runs"].values()
            assert run["held"] == run["returned"] > 0
            assert 6000 < zoomed["first"] < zoomed["last"] < 14000
            csv = page.locator("#chart-0 a.csv").get_attribute("href") or ""
            assert "from=" in csv and "to=" in csv and "format=csv" in csv

            page.get_by_label("Log scale").check()
            page.get_by_label("Smoothing").fill("0.9")
            expect(figure).to_have_attribute("data-state", "drawn")
            screenshot(page, tmp_path, "charts-zoomed")
            assert not [e for e in errors if "Content Security Policy" in e], errors
        finally:
            browser.close()


def test_a_chart_takes_new_points_as_they_arrive(charted: Charted, tmp_path: Path) -> None:
    """Points shipped while the Charts page is open are drawn without a reload: the page's
    metrics events say the tag grew, and it reads that chart again."""
    _require_browser()
    from playwright.sync_api import expect

    tag = "live/acc"
    ship_points(charted.coord, charted.who, tag, [0.5] * 100)
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = sign_in_page(browser, charted.url, charted.coord.admin_token)
            with page.expect_response(lambda r: "/metrics/events" in r.url):
                page.goto(f"{charted.url}/jobs/{charted.run_id}/charts?tag={tag}")
            figure = page.locator("figure.chart").first
            expect(figure).to_have_attribute("data-state", "drawn")
            expect(figure).to_have_attribute("data-points", "100")
            page.evaluate("document.documentElement.dataset.sameDocument = 'yes'")
            # Shipped from another thread: Playwright's loop runs in this one.
            with ThreadPoolExecutor(1) as pool:
                more = [0.75] * 50
                pool.submit(ship_points, charted.coord, charted.who, tag, more, 100).result(60)
            expect(figure).to_have_attribute("data-points", "150")
            expect(figure).to_have_attribute("data-buckets", "150")
            assert page.evaluate("document.documentElement.dataset.sameDocument") == "yes"
            screenshot(page, tmp_path, "charts-live")
        finally:
            browser.close()


def test_a_tag_that_first_appears_while_the_page_is_open_is_offered(
    charted: Charted, tmp_path: Path
) -> None:
    """A tag shipped only after the Charts page opened gets its checkbox from the page's
    metrics events, in the same document; ticking it and pressing Draw charts it."""
    _require_browser()
    from playwright.sync_api import expect

    tag = "late/reward"
    with playwright_session() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = sign_in_page(browser, charted.url, charted.coord.admin_token)
            with page.expect_response(lambda r: "/metrics/events" in r.url):
                page.goto(f"{charted.url}/jobs/{charted.run_id}/charts")
            expect(page.get_by_role("checkbox", name=TAG)).to_be_visible()
            expect(page.get_by_role("checkbox", name=tag)).to_have_count(0)
            page.evaluate("document.documentElement.dataset.sameDocument = 'yes'")
            with ThreadPoolExecutor(1) as pool:
                pool.submit(ship_points, charted.coord, charted.who, tag, [1.0] * 40).result(60)
            box = page.get_by_role("checkbox", name=tag)
            expect(box).to_be_visible()
            expect(box).not_to_be_checked()
            assert page.evaluate("document.documentElement.dataset.sameDocument") == "yes"
            box.check()
            page.get_by_role("button", name="Draw").click()
            figure = page.locator(f'figure.chart[data-tag="{tag}"]')
            expect(figure).to_have_attribute("data-state", "drawn")
            expect(figure).to_have_attribute("data-points", "40")
            screenshot(page, tmp_path, "charts-new-tag")
        finally:
            browser.close()
