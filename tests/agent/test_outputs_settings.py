"""node.toml's [outputs], what Hello and Prepare carry about the outputs listener, and doctor's
line about it: pure parts, no sockets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tuneplane.agent import config, doctor
from tuneplane.agent import messages as m
from tuneplane.agent.inventory import Inventory
from tuneplane.agent.journal_records import MemberKey
from tuneplane.agent.session import ControlSession, Send
from tuneplane.agent.wire_convert import from_wire, to_wire
from tuneplane.proto import v1

INV = Inventory("host-a", 8, 1 << 30, (), "simulated")
KEY = MemberKey("run-1", 1, 0)


def _settings(tmp_path: Path, text: str) -> config.OutputsSettings:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return config.outputs_settings(config.load(path), path)


def test_the_listener_is_on_by_default_and_off_with_an_empty_listen(tmp_path: Path) -> None:
    default = _settings(tmp_path, "")
    assert default == config.OutputsSettings("0.0.0.0:7463", "")
    assert default.on and default.host_port() == ("0.0.0.0", 7463)
    assert not _settings(tmp_path, '[outputs]\nlisten = ""\n').on
    found = _settings(tmp_path, '[outputs]\nlisten = "[::]:0"\nadvertise = "node-a.lab"\n')
    assert found.host_port() == ("::", 0) and found.advertise == "node-a.lab"
    assert _settings(tmp_path, '[outputs]\nadvertise = "10.0.0.5"\n').advertise == "10.0.0.5"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('[outputs]\nlisten = "7463"\n', "'outputs.listen' is '7463', which is not HOST:PORT"),
        ('[outputs]\nlisten = "0.0.0.0:70000"\n', "which is not HOST:PORT"),
        ('[outputs]\nlisten = "::1:7463"\n', "which is not HOST:PORT"),
        ('[outputs]\nlisten = "bad host:7463"\n', "which is not HOST:PORT"),
        ("[outputs]\nlisten = 7463\n", "'outputs.listen' must be a string"),
        ('[outputs]\nadvertise = "10.0.0.5:7463"\n', "'outputs.advertise' is '10.0.0.5:7463'"),
        ('[outputs]\nport = "7463"\n', "unknown key 'outputs.port'"),
        ('outputs = "on"\n', "'outputs' must be a table"),
    ],
)
def test_a_bad_outputs_setting_names_the_key(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(config.NodeConfigError) as caught:
        config.load(path)
    assert said in str(caught.value) and str(path) in str(caught.value)
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", "--config", str(path), "doctor"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and said in done.stderr


def test_hello_carries_the_outputs_service_when_there_is_one() -> None:
    service = m.OutputsService("10.0.0.5:7463", "ab" * 32, b"k" * 32)
    session = ControlSession("node-1", "0.1.0", outputs=service)
    [effect] = session.start(0.0, INV, ())
    assert isinstance(effect, Send) and isinstance(effect.message, m.Hello)
    assert effect.message.outputs == service
    wire = to_wire(effect.message).hello
    assert (wire.outputs.address, wire.outputs.cert_sha256, wire.outputs.grant_key) == (
        "10.0.0.5:7463", "ab" * 32, b"k" * 32,
    )  # fmt: skip
    assert "k" * 32 not in repr(service)
    off = to_wire(ControlSession("node-1", "0.1.0").start(0.0, INV, ())[0].message)  # type: ignore[union-attr]
    # No listener: the field is not on the wire at all.
    assert not v1.NodeMessage().parse(bytes(off)).hello.outputs.address


def test_prepare_brings_the_fetch_order_or_none() -> None:
    ref = v1.MemberRef(run_id="run-1", attempt=1, member_index=0)
    fetch = v1.InitFromFetch(address="10.0.0.5:7463", cert_sha256="ab" * 32, grant="cd" * 32,
                             grant_expires_at_ms=42)  # fmt: skip
    sent = v1.CoordinatorMessage(prepare=v1.Prepare(member=ref, init_from_fetch=fetch))
    got = from_wire(v1.CoordinatorMessage().parse(bytes(sent)))
    assert isinstance(got, m.Prepare)
    assert got.init_from_fetch == m.InitFromFetch("10.0.0.5:7463", "ab" * 32, "cd" * 32, 42)
    assert "cd" * 32 not in repr(got)
    plain = from_wire(v1.CoordinatorMessage(prepare=v1.Prepare(member=ref)))
    assert isinstance(plain, m.Prepare) and plain.init_from_fetch is None


def test_doctor_says_where_the_listener_is_or_that_it_is_off() -> None:
    off = doctor.outputs_finding("", True, "", "")
    assert off.level == "ok" and "outputs listener: off" in off.text
    idle = doctor.outputs_finding("0.0.0.0:7463", False, "", "")
    assert idle.level == "ok" and "would listen at 0.0.0.0:7463" in idle.text
    stale = doctor.outputs_finding("0.0.0.0:7463", True, "", "")
    assert stale.level == "warn" and "restart it" in stale.text
    on = doctor.outputs_finding("0.0.0.0:7463", True, "0.0.0.0:7463", "10.0.0.5:7463")
    assert on.level == "ok"
    assert "listening at 0.0.0.0:7463, advertised to other Nodes as 10.0.0.5:7463" in on.text
