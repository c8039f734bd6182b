"""``HOST:PORT`` text, one way for the whole agent: the coordinator address, the outputs
listener's ``listen`` and a holder's advertised address all read and write it here.

An IPv6 host is written in brackets (``[::1]:7463``) and read without them; a bracketed host
must be IPv6 and an unbracketed one must not hold a colon.
"""

from __future__ import annotations


def split_host_port(text: str, allow_zero: bool = False) -> tuple[str, int] | None:
    """``text`` as (host, port), or None when it is not ``HOST:PORT``. Port 0 ("any free
    port") passes only with ``allow_zero``, for an address to listen on."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if not sep or not bare or not port.isdigit() or " " in bare:
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
