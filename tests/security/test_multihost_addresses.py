"""Across hosts, a Node trusts the coordinator only at a name its certificate covers.

The coordinator runs on a host of its own (tests/support/netns.py), bound to 0.0.0.0 and
advertised as ``coord`` (``[addresses] host`` in its coordinator.toml); its dev certificate is
reissued for that name and nothing more. A Node that dials the same listener by a raw address
the certificate does not name (what a redirected or spoofed address looks like to it) refuses
the coordinator before it sends its join token: nothing is enrolled and the token still works,
by the advertised name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import node_cli
from tests.support.coordinator import start_coordinator
from tests.support.netns import open_network, require_netns

pytestmark = pytest.mark.slow


def _enroll(
    argv_prefix: tuple[str, ...], state: Path, address: str, ca: Path, token: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*argv_prefix, *node_cli(
            "enroll", "--state-dir", str(state), "--coordinator", address, "--ca", str(ca),
            "--token", token, "--name", "node-a", "--simulate-gpus", "h200:1",
        )],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_node_dialing_an_address_the_certificate_does_not_name_sends_nothing(
    tmp_path: Path,
) -> None:
    require_netns("to put the coordinator and a Node on hosts of their own")
    with open_network(["coord", "node-a"]) as net:
        coord_host, node_host = net.host("coord"), net.host("node-a")
        # Advertised by coordinator.toml this time (test_multihost uses serve --advertise).
        with start_coordinator(
            tmp_path,
            config='\n[addresses]\nhost = "coord"\n',
            prefix_argv=coord_host.prefix(),
            host="0.0.0.0",
        ) as coord:
            port = coord.control.rsplit(":", 1)[1]
            assert coord.control == f"coord:{port}"
            token = coord.create_join_token()
            state = tmp_path / "node-a"

            refused = _enroll(
                node_host.prefix(), state, f"{coord_host.address}:{port}", coord.ca_path, token
            )
            assert refused.returncode != 0
            told = " ".join(refused.stderr.split())
            assert "certificate" in told.lower(), told
            # Nothing changed: no Node enrolled here or there, no state written on the Node.
            assert not (state / "node.json").exists()
            assert _node_names(coord_host.argv, coord.context_path) == []

            # The join token was never sent: it still enrolls, by the advertised name.
            enrolled = _enroll(node_host.prefix(), state, coord.control, coord.ca_path, token)
            assert enrolled.returncode == 0, enrolled.stderr
            node = json.loads((state / "node.json").read_text())
            assert node["coordinator"] == coord.control
            assert _node_names(coord_host.argv, coord.context_path) == ["node-a"]


def _node_names(argv: Callable[..., list[str]], context: Path) -> list[str]:
    """The Nodes the coordinator knows, by the real ``tp node ls`` run on its host."""
    listed = subprocess.run(
        argv(sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context", str(context),
             "node", "ls", "--json"),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return sorted(n["name"] for n in json.loads(listed.stdout))
