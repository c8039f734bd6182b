"""The fetch path of agent/init_from.py against a real Node's outputs listener: the files arrive
byte for byte; a file changed on the holder after its manifest was written refuses the Prepare
naming the file, the holder and its address, leaving no ``dest`` and no ``.partial``; a
``.partial`` a crash left behind is cleaned up by the next try; a holder that is not listening,
a missing fetch order and a changed manifest are refused with sentences too."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from tests.support.outputs import Holder, holder
from tuneplane.agent.host_port import join_host_port
from tuneplane.agent.init_from import materialise_init_from
from tuneplane.agent.prepare import PrepareRefused

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Holder]:
    with holder(tmp_path_factory.mktemp("outputs-fetch")) as found:
        yield found


def _fetch(node: Holder, dest: Path, address: str = "", grant: str = "") -> int:
    order = node.fetch_order(node.done)
    order = attrs.evolve(order, address=address or order.address, grant=grant or order.grant)
    # This Node is another one, with an output root of its own.
    return materialise_init_from(
        node.source(node.done), dest.parent / "my-outputs", dest, "node-target", order
    )


def test_the_files_arrive_byte_for_byte(node: Holder, tmp_path: Path) -> None:
    dest = tmp_path / "init-from"
    copied = _fetch(node, dest)
    model = (node.done.out_dir / "ckpt" / "model.bin").read_bytes()
    assert copied == len(model) + len(b"step 7\n")
    assert (dest / "ckpt" / "model.bin").read_bytes() == model
    assert (dest / "ckpt" / "notes.txt").read_text() == "step 7\n"
    assert not dest.with_name("init-from.partial").exists()
    assert node.log_count(f"outputs served run_id={node.done.run_id}") >= 3


def test_a_file_changed_on_the_holder_is_refused_naming_it(node: Holder, tmp_path: Path) -> None:
    model = node.done.out_dir / "ckpt" / "model.bin"
    original = model.read_bytes()
    changed = bytearray(original)
    changed[100] ^= 0xFF
    model.write_bytes(bytes(changed))
    dest = tmp_path / "init-from"
    partial = dest.with_name("init-from.partial")
    try:
        with pytest.raises(PrepareRefused) as caught:
            _fetch(node, dest)
        said = str(caught.value)
        assert f"The file ckpt/model.bin of run {node.done.run_id}'s outputs does not match its " \
            "manifest (sha256 " in said  # fmt: skip
        assert f"Node {node.agent.node_id} at {node.address}" in said
        assert not dest.exists() and not partial.exists()
        # A grown file is refused from its size, before the rest of it is taken.
        model.write_bytes(original + b"more")
        with pytest.raises(PrepareRefused, match="more bytes where the manifest lists"):
            _fetch(node, dest)
        assert not dest.exists() and not partial.exists()
    finally:
        model.write_bytes(original)
    # What a crash in the middle of a copy leaves behind is removed by the next try.
    (partial / "ckpt").mkdir(parents=True)
    (partial / "ckpt" / "model.bin").write_bytes(b"half")
    (partial / "stale.txt").write_text("from the crashed try")
    _fetch(node, dest)
    assert not partial.exists()
    assert sorted(p.name for p in dest.rglob("*")) == ["ckpt", "model.bin", "notes.txt"]
    assert hashlib.sha256((dest / "ckpt" / "model.bin").read_bytes()).digest() == (
        hashlib.sha256(original).digest()
    )


def test_a_changed_manifest_is_refused(node: Holder, tmp_path: Path) -> None:
    source = attrs.evolve(node.source(node.done), manifest_sha256="0" * 64)
    with pytest.raises(PrepareRefused, match="was changed after the run ended"):
        materialise_init_from(source, tmp_path / "mine", tmp_path / "dest", "node-target",
                              node.fetch_order(node.done))  # fmt: skip
    assert not (tmp_path / "dest").exists()


def test_a_refused_grant_is_a_sentence_naming_the_holder(node: Holder, tmp_path: Path) -> None:
    with pytest.raises(PrepareRefused) as caught:
        _fetch(node, tmp_path / "dest", grant="0" * 64)
    said = str(caught.value)
    assert said.startswith(f"Fetching the outputs of run {node.done.run_id} from Node ")
    assert node.address in said and "the holder refused: The grant is not this Node's" in said
    assert not (tmp_path / "dest").exists()


def test_a_holder_that_is_not_listening_is_a_sentence(node: Holder, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = join_host_port("127.0.0.1", sock.getsockname()[1])
    with pytest.raises(PrepareRefused) as caught:
        _fetch(node, tmp_path / "dest", address=free)
    said = str(caught.value)
    assert f"from Node {node.agent.node_id} at {free} failed: the connection failed" in said
    assert "firewall" in said
    assert not (tmp_path / "dest").exists()


def test_no_fetch_order_is_a_sentence(node: Holder, tmp_path: Path) -> None:
    with pytest.raises(PrepareRefused, match=r"the coordinator sent no way to fetch them"):
        materialise_init_from(node.source(node.done), tmp_path / "mine", tmp_path / "dest",
                              "node-target", None)  # fmt: skip


def test_the_holder_itself_copies_from_its_own_output_root(node: Holder, tmp_path: Path) -> None:
    """A Derivation placed on the Node that holds its source reads it locally, no fetch."""
    served = node.log_count("outputs served")
    dest = tmp_path / "dest"
    materialise_init_from(node.source(node.done), node.agent.out_root, dest, node.agent.node_id,
                          None)  # fmt: skip
    assert (dest / "ckpt" / "notes.txt").read_text() == "step 7\n"
    assert node.log_count("outputs served") == served
