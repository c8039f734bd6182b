"""What people read of a fetched Derivation: the preview says where each Node gets the source,
and `tp node show` says where a Node serves outputs (carried in ListNodes/GetNode)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from tuneplane.coordinator.cli.render_fleet import node_view
from tuneplane.coordinator.cli.render_launch import begins_from
from tuneplane.coordinator.wire.fleet import node_from_wire
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(30)

SOURCE = {
    "run_id": "run-a",
    "attempt": 1,
    "member_index": 0,
    "out_dir": "/var/lib/tp/out/run-a/attempt-1/member-0",
    "manifest_sha256": "ab" * 32,
    "files": 2,
    "bytes": 1234,
}


def _spec(**source: object) -> str:
    return json.dumps({"init_from_source": {**SOURCE, **source}})


def test_the_preview_says_whether_the_source_is_fetched_or_copied() -> None:
    fetched = begins_from(_spec(node_id="node-1"), {"node-1": "gpu-a"})
    assert fetched is not None and "fetched from Node gpu-a (node-1) at Prepare" in fetched
    unnamed = begins_from(_spec(node_id="node-1"))
    assert unnamed is not None and "fetched from Node node-1 at Prepare" in unnamed
    copied = begins_from(_spec())
    assert copied is not None and "copied from the shared output root at Prepare" in copied
    assert begins_from(_spec(node_id=7)) is None
    assert begins_from(json.dumps({})) is None


def _shown(node: v1.Node) -> str:
    console = Console(width=200, record=True)
    for part in node_view(node_from_wire(node), 0):
        console.print(part)
    return console.export_text()


def test_node_show_says_where_a_node_serves_outputs() -> None:
    node = v1.Node(id="node-1", fleet="default", name="gpu-a", outputs_address="10.0.0.7:7463")
    node = v1.Node().parse(bytes(node))
    assert node_from_wire(node).outputs_address == "10.0.0.7:7463"
    assert "Outputs" in _shown(node) and "10.0.0.7:7463" in _shown(node)
    quiet = v1.Node(id="node-2", fleet="default", name="gpu-b")
    assert "serves no outputs to other Nodes" in _shown(quiet)
