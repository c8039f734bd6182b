"""What a running agent holds in memory: modules it loads only when something needs them.

The idle agent's resident memory is mostly the Python modules it has imported (issue 13, goal
4: at most 40 MiB). A real ``tuneplane-node run`` with default settings (no [metrics] table) runs
one member to its end, idles, and is stopped with SIGTERM; a wrapper around the agent's own CLI
writes the daemon's ``sys.modules`` at exit. What each named module costs is said beside it; a
module that comes back into the daemon fails this test, which names the modules and so tells
where to look (``python -X importtime``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.agent.jobs import submit, wait_job
from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator

pytestmark = pytest.mark.timeout(180)

#: Loaded only when node.toml has [metrics] (agent/metric_hooks.py): prometheus_client brings
#: http.server, urllib.request and wsgiref for its own HTTP server.
METRICS = ("prometheus_client", "tuneplane.agent.metrics", "http.server", "urllib.request")
#: Loaded with the first image pull (agent/image_cache.py): httpx, which loads rich and pygments
#: for its command line when they are installed; tarfile with the first image unpacked.
IMAGE_PULL = ("tuneplane.agent.image_pull", "httpx", "rich", "pygments")
IMAGE_UNPACK = ("tuneplane.agent.image_layer", "tarfile")
#: Made and checked in a forked child (agent/outputs_identity.py).
OUTPUTS_TLS = ("cryptography", "tuneplane.agent.outputs_tls")
#: The runner itself runs in its own process; the agent reads its exit codes only.
RUNNER = ("tuneplane.runner.main", "tuneplane.runner.member_runner")
#: Of the collector, which runs in its own processes, the agent reads names and defaults only.
COLLECTOR_ALLOWED = ("tuneplane.collector", "tuneplane.collector.defaults")

_WRAPPER = """\
import atexit, json, sys
from pathlib import Path


def _write_modules() -> None:
    Path({out!r}).write_text(json.dumps(sorted(sys.modules)))


atexit.register(_write_modules)
from tuneplane.agent.cli import main

main()
"""


def held_after_a_member(tmp_path: Path) -> set[str]:
    """The modules a default agent holds after one member ran to its end, read at its exit."""
    out = tmp_path / "modules.json"
    wrapper = tmp_path / "agent_modules.py"
    wrapper.write_text(_WRAPPER.format(out=str(out)))
    with start_coordinator(tmp_path) as coord:
        agent = start_agent(tmp_path, coord, "node-a", "h200:1")
        try:
            agent.wait_connected()
            agent.stop()
            agent.entry_argv = (sys.executable, str(wrapper))
            agent.start()
            agent.wait_connected()
            run_id = submit(coord, tmp_path / "project", "#!/bin/sh\ntrue\n")
            assert wait_job(coord, run_id)["state"] == "succeeded"
        finally:
            if agent.alive():
                agent.stop()
    held: list[str] = json.loads(out.read_text())
    return set(held)


def test_a_default_agent_never_loads_what_only_rare_paths_need(tmp_path: Path) -> None:
    held = held_after_a_member(tmp_path)
    # The dump is the daemon's: it ran the Trio loop, the control session and a member.
    assert {"tuneplane.agent.daemon", "trio", "grpclib.client", "tuneplane.agent.supervision"} <= (
        held
    )
    unwanted = {
        "metrics off": sorted(held & set(METRICS)),
        "no image pulled": sorted(held & set(IMAGE_PULL + IMAGE_UNPACK)),
        "outputs TLS made in a child": sorted(held & set(OUTPUTS_TLS)),
        "runner in its own process": sorted(held & set(RUNNER)),
        "collector in its own processes": sorted(
            m for m in held if m.startswith("tuneplane.collector") and m not in COLLECTOR_ALLOWED
        ),
        "no coordinator on a Node": sorted(
            m for m in held if m.startswith("tuneplane.coordinator")
        ),
    }
    assert {why: mods for why, mods in unwanted.items() if mods} == {}
