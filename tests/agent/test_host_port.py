"""The one ``HOST:PORT`` reader and writer (agent/host_port.py), and the callers that phrase its
refusal for their own setting."""

from __future__ import annotations

import pytest

from tuneplane.agent.host_port import join_host_port, split_host_port
from tuneplane.collector.ship_wire import CollectorConfigError, Gateway
from tuneplane.coordinator.cli.connection import ConnectionConfigError, parse_address
from tuneplane.coordinator.control_address import BadAddress, split

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("10.0.0.5:7463", ("10.0.0.5", 7463)),
        ("coordinator.example.org:7444", ("coordinator.example.org", 7444)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:7463", ("::1", 7463)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
        ("[2001:db8::7]:00080", ("2001:db8::7", 80)),
    ],
)
def test_a_host_and_port_are_read(text: str, found: tuple[str, int]) -> None:
    assert split_host_port(text) == found
    # And written back the way they were read (leading zeros aside).
    assert split_host_port(join_host_port(*found)) == found


@pytest.mark.parametrize(
    "text",
    [
        "",
        "10.0.0.5",  # no port
        ":7463",  # no host
        "[]:7463",
        "host:",
        "host:0",  # 0 only where asked
        "host:65536",
        "host:-1",
        "host:+1",
        "host:x",
        "host:7e3",
        "host:\u00b2",  # a digit to str.isdigit, not to int
        "host:\u0663",  # an Arabic-Indic 3
        "host:" + "0" * 5000 + "1",  # more digits than int() takes
        "::1:7463",  # IPv6 without brackets
        "[10.0.0.5]:7463",  # brackets around what is not IPv6
        "[host]:7463",
        "[::1:7463",
        "::1]:7463",
        "a]:1",
        "a b:1",
        "a\tb:1",
        "a\nb:1",
        "a\x00b:1",
        "user@host:1",
        "host/path:1",
        "http://host:1",
    ],
)
def test_anything_else_is_not_host_port(text: str) -> None:
    assert split_host_port(text) is None


def test_port_zero_passes_only_for_an_address_to_listen_on() -> None:
    assert split_host_port("0.0.0.0:0") is None
    assert split_host_port("0.0.0.0:0", allow_zero=True) == ("0.0.0.0", 0)
    assert split_host_port("[::]:0", allow_zero=True) == ("::", 0)


def test_an_ipv6_host_is_written_in_brackets() -> None:
    assert join_host_port("::1", 7463) == "[::1]:7463"
    assert join_host_port("fe80::1%eth0", 1) == "[fe80::1%eth0]:1"
    assert join_host_port("node-a.example", 1) == "node-a.example:1"
    assert join_host_port("10.0.0.5", 7444) == "10.0.0.5:7444"


def test_every_caller_reads_the_same_way_and_names_its_own_setting() -> None:
    for text in ("10.0.0.5:7445", "[::1]:7445"):
        expected = split_host_port(text)
        assert split(text) == expected
        assert parse_address(text, "--coordinator") == expected
        gateway = Gateway.parse(text)
        assert (gateway.host, gateway.port) == expected
        assert str(gateway) == text
    with pytest.raises(BadAddress, match=r"^The control address 'h:0' is not HOST:PORT"):
        split("h:0")
    with pytest.raises(ConnectionConfigError, match=r"^--coordinator 'h:0' is not HOST:PORT"):
        parse_address("h:0", "--coordinator")
    with pytest.raises(CollectorConfigError, match=r"^--gateway '\[h\]:1' is not HOST:PORT"):
        Gateway.parse("[h]:1")
