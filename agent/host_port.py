"""``HOST:PORT`` text, one way for every daemon and ``tp``: the Node's coordinator address, the
outputs listener's ``listen`` and a holder's advertised address, the collector's ``--gateway``,
``tp``'s ``--coordinator``, the coordinator's control and advertised addresses and its listeners'
own all read and write it here.

Rules: an IPv6 host is written in brackets (``[::1]:7463``) and read without them; a bracketed
host must hold a colon (IPv6) and an unbracketed one must not; the port is ASCII digits, 1 to
65535 (0, "any free port", only where asked). Reading returns None for anything else: each
caller says in its own sentence which setting was wrong and how to write it.
"""

from __future__ import annotations

import re

# Nothing a host name or address holds: whitespace, control characters, brackets (outside the
# pair around an IPv6 address), or what would make it a URL or a path.
_NOT_IN_HOST = re.compile(r"[\s\x00-\x1f\x7f\[\]/\\@]")


def split_host_port(text: str, allow_zero: bool = False) -> tuple[str, int] | None:
    """``text`` as (host, port), or None when it is not ``HOST:PORT``. Port 0 ("any free
    port") passes only with ``allow_zero``, for an address to listen on."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if not sep or not bare or _NOT_IN_HOST.search(bare):
        return None
    # ASCII digits only ("²" is a digit to str.isdigit, not to int), and few of them: int()
    # refuses thousands of digits with an error of its own.
    if not (port.isascii() and port.isdigit()) or len(port) > 5:
        return None
    if (":" in bare) != bracketed:
        return None
    number = int(port)
    if number > 65535 or (number == 0 and not allow_zero):
        return None
    return bare, number


def join_host_port(host: str, port: int) -> str:
    """``host`` and ``port`` as ``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
