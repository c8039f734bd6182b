"""The wait between two rounds of dials (the Trio shell of agent/reconnect.py): the jittered
backoff, cut short by a probe that sees a coordinator come back or by a replaced credential.

Rules: a probe is a plain TCP connect, closed at once before anything is sent, so it costs a
coordinator one accept and never holds a connection open; every address is probed at once,
each within :data:`~.reconnect.PROBE_TIMEOUT_S`. The wait owns its tasks: whatever ends it
cancels the others before it returns.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import trio

from . import reconnect
from .daemon_base import CREDENTIAL_POLL_S
from .host_port import split_host_port

log = logging.getLogger(__name__)


async def accepts(address: str) -> bool:
    """Whether ``address`` accepts a plain TCP connect within a probe's time; the connection
    is closed at once (nothing is sent, nothing is held open)."""
    found = split_host_port(address)
    if found is None:
        return False
    with trio.move_on_after(reconnect.PROBE_TIMEOUT_S):
        try:
            stream = await trio.open_tcp_stream(*found)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


async def probe_all(addresses: tuple[str, ...]) -> dict[str, bool]:
    """Probe every address at once (:func:`accepts`); the results in the order given."""
    results = dict.fromkeys(addresses, False)

    async def one(address: str) -> None:
        results[address] = await accepts(address)

    async with trio.open_nursery() as nursery:
        for address in addresses:
            nursery.start_soon(one, address)
    return results


def file_stamp(path: Path) -> tuple[int, int] | None:
    """What tells a replaced file from the one read before: its inode and mtime (None: gone)."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns


async def wait_to_redial(
    delay: float,
    addresses: tuple[str, ...],
    credential: Path,
    jitter: Callable[[], float] = random.random,
) -> str:
    """Wait ``delay`` seconds, or less: until a probe sees one of ``addresses`` that refused
    accept (returned, to be dialed first) or the ``credential`` file is replaced (a
    re-enrolment takes effect within a poll; returns ""). "" when the whole delay passed."""
    back: list[str] = []
    with trio.move_on_after(delay):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_replaced, credential, nursery.cancel_scope)
            nursery.start_soon(_until_one_comes_back, addresses, jitter, back,
                               nursery.cancel_scope)  # fmt: skip
    return back[0] if back else ""


async def _until_replaced(path: Path, done: trio.CancelScope) -> None:
    before = file_stamp(path)
    while file_stamp(path) == before:
        await trio.sleep(CREDENTIAL_POLL_S)
    log.info("control credential replaced on disk; reconnecting now")
    done.cancel()


async def _until_one_comes_back(
    addresses: tuple[str, ...],
    jitter: Callable[[], float],
    back: list[str],
    done: trio.CancelScope,
) -> None:
    watch = reconnect.ProbeWatch()
    while True:
        wanted = watch.to_probe(addresses)
        if not wanted:
            await trio.sleep_forever()  # every address refuses the session: the backoff paces
        found = watch.observe(await probe_all(wanted))
        if found is not None:
            log.info("coordinator accepting again coordinator=%s; reconnecting now", found)
            back.append(found)
            done.cancel()
            return
        await trio.sleep(reconnect.probe_delay(jitter()))
