"""Several "hosts" on one machine: network namespaces joined by bridges, for multi-host tests.

How to use it (as root, with iproute2's ``ip``)::

    from tests.support.netns import open_network, require_netns

    def test_two_hosts(tmp_path: Path) -> None:
        require_netns("to give the coordinator and each Node an address of its own")
        with open_network(["coord", "node-a", "node-b"]) as net:
            coord = net.host("coord")          # coord.address == "10.77.0.1"
            argv = coord.argv("python3", "-c", "...")   # ["ip", "netns", "exec", NS, ...]
            net.host("node-a").cut()           # its link goes down; heal() brings it back

- Every host is a namespace of its own with ``lo`` up and one interface (``eth0``) per segment
  it is attached to; each segment is a bridge in a separate "switch" namespace, so nothing is
  added to the machine's own namespace (its routes and interfaces stay untouched).
- ``open_network(hosts)`` makes one segment, ``lan`` (10.77.0.0/24), and attaches every host
  to it in order (10.77.0.1, .2, ...). For hosts with more interfaces, build it by hand:
  ``net.add_segment("dark", "10.78.0")`` then ``net.attach("node-a", "dark")`` (``eth1``); a
  segment no other host is attached to is an unrouted interface.
- Names resolve inside the namespaces: every host's name maps to its first address in a hosts
  file at ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` bind-mounts over
  ``/etc/hosts``. The file is rewritten in place (same inode) whenever a host is added, so
  processes started earlier see later hosts too.
- A process runs inside a host with ``host.argv(...)`` as its argv (``ip netns exec`` execs the
  command, so the pid Popen reports is the command's own); the helpers in
  ``tests/support/coordinator.py`` and ``agent.py`` take such a prefix (``prefix_argv``).
- Cleanup is guaranteed: leaving the ``with`` block (even by an exception) deletes every
  namespace, hence every veth and bridge, and the hosts files. Names carry this process's pid
  and a counter, so parallel test runs never collide, and a run killed before its cleanup is
  swept by the next one (namespaces whose pid is no longer alive).
- Stop the processes you started inside a host before the block ends: a namespace a process
  still lives in disappears from ``ip netns`` but lives on until that process exits.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest

from tests.support import accounts

NETNS_ETC = Path("/etc/netns")
NAME_PREFIX = "tpnet"
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_COUNTER = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` command that builds or changes the test network failed."""


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def netns_missing() -> str | None:
    """Why this machine cannot build a namespace network (None when it can)."""
    if not accounts.is_root():
        return "it must run as root (it creates network namespaces with `ip netns`)"
    if shutil.which("ip") is None:
        return "it needs iproute2's `ip` command on PATH"
    probe = f"{NAME_PREFIX}{os.getpid()}probe{next(_COUNTER)}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"this kernel or container refuses network namespaces ({exc})"
    try:
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
    except NetnsError as exc:
        return f"this kernel or container refuses veth pairs ({exc})"
    finally:
        _ip("netns", "del", probe)
    return None


def require_netns(why: str) -> None:
    """Skip the test with a sentence naming what it needs (fail under ``CI=true``) when this
    machine cannot build a namespace network; ``why`` says what the test uses it for."""
    missing = netns_missing()
    if missing is None:
        return
    message = f"this test needs network namespaces {why}, and {missing}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def sweep_stale() -> None:
    """Delete namespaces (and hosts files) left by a test run whose process is gone."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    for line in listed.splitlines():
        name = line.split(" ", 1)[0]
        match = re.match(rf"^{NAME_PREFIX}(\d+)[a-z]", name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        if Path(f"/proc/{match.group(1)}").exists():
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


@attrs.frozen
class Segment:
    """One bridge (a switch) and its /24."""

    name: str
    bridge: str
    prefix: str  # "10.77.0": addresses are prefix + ".<n>"


@attrs.define(eq=False)
class Host:
    """One namespace: a machine of its own, with an address per segment it is attached to."""

    name: str
    netns: str
    network: Network
    interfaces: dict[str, str] = attrs.field(factory=dict)  # segment -> interface in the host
    addresses: dict[str, str] = attrs.field(factory=dict)  # segment -> IPv4 address

    @property
    def address(self) -> str:
        """Its address on the first segment it was attached to (what its name resolves to)."""
        return next(iter(self.addresses.values()))

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *command]

    def prefix(self) -> tuple[str, ...]:
        """The argv prefix that runs a command inside this host."""
        return ("ip", "netns", "exec", self.netns)

    def run(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*command), capture_output=True, text=True, timeout=timeout, check=False
        )

    def cut(self, segment: str | None = None) -> None:
        """Take this host's interface on ``segment`` (its first one when None) down, from
        inside the host, as a pulled cable would look to it."""
        _ip("-n", self.netns, "link", "set", self._interface(segment), "down")

    def heal(self, segment: str | None = None) -> None:
        """Bring the interface :meth:`cut` took down back up (its address and route return)."""
        _ip("-n", self.netns, "link", "set", self._interface(segment), "up")

    def _interface(self, segment: str | None) -> str:
        if segment is None:
            return next(iter(self.interfaces.values()))
        return self.interfaces[segment]


@attrs.define(eq=False)
class Network:
    """The namespaces of one test: a switch namespace holding the bridges, and the hosts."""

    tag: str
    switch: str
    segments: dict[str, Segment] = attrs.field(factory=dict)
    hosts: dict[str, Host] = attrs.field(factory=dict)
    namespaces: list[str] = attrs.field(factory=list)  # made so far, deleted by close()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def add_segment(self, name: str, prefix: str) -> Segment:
        """A new bridge for the /24 ``prefix`` ("10.78.0")."""
        bridge = f"br{len(self.segments)}"
        _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", bridge, "up")
        segment = Segment(name, bridge, prefix)
        self.segments[name] = segment
        return segment

    def add_host(self, name: str) -> Host:
        """A new namespace with only ``lo`` (up); :meth:`attach` gives it interfaces."""
        if not _NAME.match(name) or name in self.hosts:
            raise NetnsError(f"host name {name!r} is taken or not [a-z][a-z0-9-]*")
        netns = f"{self.tag}-{name}"
        _ip("netns", "add", netns)
        self.namespaces.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        host = Host(name, netns, self)
        self.hosts[name] = host
        return host

    def attach(self, host_name: str, segment_name: str) -> str:
        """Plug ``host_name`` into ``segment_name`` with a new ``eth<n>``: its address there."""
        host = self.hosts[host_name]
        segment = self.segments[segment_name]
        index = list(self.hosts).index(host_name)
        switch_end = f"{segment.bridge}h{index}"
        interface = f"eth{len(host.interfaces)}"
        in_use = {
            a for h in self.hosts.values() for s, a in h.addresses.items() if s == segment_name
        }
        address = next(
            f"{segment.prefix}.{n}" for n in range(1, 255) if f"{segment.prefix}.{n}" not in in_use
        )
        _ip("-n", self.switch, "link", "add", switch_end, "type", "veth",
            "peer", "name", interface, "netns", host.netns)  # fmt: skip
        _ip("-n", self.switch, "link", "set", switch_end, "master", segment.bridge, "up")
        _ip("-n", host.netns, "addr", "add", f"{address}/24", "dev", interface)
        _ip("-n", host.netns, "link", "set", interface, "up")
        host.interfaces[segment_name] = interface
        host.addresses[segment_name] = address
        self.write_hosts()
        return address

    def write_hosts(self) -> None:
        """Every host's hosts file: localhost, and each attached host's name -> first address."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address} {h.name}" for h in self.hosts.values() if h.addresses]
        text = "\n".join(lines) + "\n"
        for host in self.hosts.values():
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            # In place, never by rename: a running process sees /etc/hosts through a bind mount
            # of this very inode.
            with open(folder / "hosts", "w", encoding="utf-8") as hosts:
                hosts.write(text)

    def close(self) -> None:
        """Delete every namespace (their veths and bridges go with them) and hosts file."""
        errors = []
        for netns in reversed(self.namespaces):
            done = subprocess.run(
                ["ip", "netns", "del", netns], capture_output=True, text=True, timeout=30
            )
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"{netns}: {done.stderr.strip()}")
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        self.namespaces.clear()
        if errors:
            raise NetnsError("could not delete test namespaces: " + "; ".join(errors))


@contextmanager
def open_network(hosts: Sequence[str] = (), lan_prefix: str = "10.77.0") -> Iterator[Network]:
    """A fresh network: segment ``lan`` (``lan_prefix``.0/24) with ``hosts`` attached in order.

    Call :func:`require_netns` first so a machine without namespaces skips with a sentence.
    """
    sweep_stale()
    tag = f"{NAME_PREFIX}{os.getpid()}n{next(_COUNTER)}"
    switch = f"{tag}-switch"
    net = Network(tag, switch)
    try:
        _ip("netns", "add", switch)
        net.namespaces.append(switch)
        net.add_segment("lan", lan_prefix)
        for name in hosts:
            net.add_host(name)
            net.attach(name, "lan")
        yield net
    finally:
        net.close()


__all__ = ["Host", "NetnsError", "Network", "Segment", "open_network", "require_netns"]
