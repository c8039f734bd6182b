"""Loopback ports for servers that tests restart on the same port.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, which is also where
every outgoing connection takes its source port. While a killed coordinator is down, any
connection made on the machine (another test's, in parallel) may take its port, and the restart
fails with "Address already in use". Ports below that range are never given to outgoing
connections, so a server restarted there finds its port again.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack
from pathlib import Path

#: The lowest port handed out here: above the well-known and registered ones tests might meet.
LOWEST = 20_000
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def quiet_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct loopback ports, free now, below the ephemeral range where the machine
    allows it (else any free ones): each is bound once here to check it is free."""
    high = _ephemeral_low()
    pick = random.SystemRandom()
    with ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count * 50):
            if len(ports) == count:
                break
            sock = stack.enter_context(socket.socket())
            port = pick.randrange(LOWEST, high) if high - LOWEST > 1000 else 0
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(sock.getsockname()[1])
        if len(ports) < count:
            raise RuntimeError(f"found only {len(ports)} of {count} free loopback ports")
        return tuple(ports)
