"""A derived Job's page shows its Derivation: the run it began from (linked to that Job's page)
and what the resolved JobSpec holds of the source: which attempt's member, its files, bytes,
output directory and manifest digest, and where the Nodes got it.

Real parts: a Node the test plays (tests/support/live_node.py) runs alice's source Job to
success with an output manifest and serves outputs, so Preview resolves a Derivation fetched
from it; the derived Job is previewed and committed over the gRPC Api, as ``tp submit
--init-from`` does; chromium reads the page and follows the link.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.console.test_console_browser import ARGS, CHROMIUM, _require_browser
from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.console import (
    console_world,
    playwright_session,
    screenshot,
    sign_in,
    sign_in_page,
)
from tests.support.live_node import live_node
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(240)

SHA = "ab" * 32
OUTPUTS = v1.OutputsService(address="127.0.0.1:7463", cert_sha256="cd" * 32, grant_key=b"k" * 32)


def test_a_derived_jobs_page_shows_its_source_and_links_to_it(tmp_path: Path) -> None:
    _require_browser()
    from playwright.sync_api import expect

    with (
        console_world(tmp_path / "world", (), heartbeat_timeout=3600) as world,
        live_node(world.coord, "host-held", world.tokens["alice"], OUTPUTS) as node,
    ):
        member = node.call(node.run_job("vision", "k-source"))
        source = member.run_id
        out_dir = f"/var/lib/tuneplane/outputs/{source}/attempt-1/member-0"
        manifest = v1.OutputManifest(files=2, bytes=4096, sha256=SHA)
        node.call(node.succeed(member, out_dir, manifest))

        async def derive() -> str:
            async with api_client(
                world.coord.api, world.coord.ca_path, world.tokens["alice"]
            ) as api:
                spec = {**jobspec(gpus=1, project="vision"), "init_from": source}
                return (await api.commit(await api.preview(spec), "k-derived")).run_id

        derived = node.call(derive())
        said = (
            f"began from run {source}, attempt 1, member 0: 2 files, 4096 bytes from {out_dir} "
            f"(manifest sha256 {SHA}), fetched from Node {node.node_id} at Prepare; each rank "
            "finds them at $TUNEPLANE_INIT_FROM_DIR"
        )
        with world.client() as bob:
            assert sign_in(bob, world.tokens["bob"]).status_code == 303
            refused = bob.get(f"/jobs/{derived}")
            assert refused.status_code == 403 and SHA not in refused.text
        with playwright_session() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = sign_in_page(browser, world.url, world.tokens["alice"])
                page.goto(f"{world.url}/jobs/{derived}")
                expect(page.locator("#derivation")).to_have_text(said)
                screenshot(page, tmp_path, "job-derived")
                page.get_by_role("link", name=source, exact=True).click()
                expect(page).to_have_url(f"{world.url}/jobs/{source}")
                expect(page.locator("#job-state")).to_have_text("succeeded")
                expect(page.locator("#derivation")).to_have_text("none")
            finally:
                browser.close()
