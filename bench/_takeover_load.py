"""Load driver for ``bench/takeover.py``: one process playing many Nodes that follow the leader.

Run as ``python -m bench._takeover_load CONFIG.json``. The config names every coordinator's
control address, the CA, the Nodes' ids and credentials, and how many grpclib channels to keep
per address. Each Node dials as the real agent does (``agent/reconnect.py``, whose pure rules it
uses): a round tries every address once, the one that last welcomed it first; a Node whose stream
ends starts a new round at once; after a round with no Welcome it waits the agent's fully
jittered backoff (capped from the Welcome's heartbeat timeout), cut short as soon as a TCP probe
finds an address accepting. Welcomed, it heartbeats at the Welcome's interval.

Protocol on stdio: print ``ready <n>`` once every Node has its first Welcome; then, for each line
``since T`` (``T`` a ``time.monotonic()`` of the parent's: the clock is system-wide), print one
JSON line once every Node has been welcomed after ``T`` (or ``wait_s`` passed): each welcomed
Node's seconds from ``T``, how many were not, and the dials and failures since the last report.
EOF or ``stop`` ends it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import betterproto
from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.agent.reconnect import (
    backoff_cap,
    backoff_delay,
    probe_delay,
    welcome_timeout_in_line,
)
from tuneplane.agent.session import WELCOME_TIMEOUT_S
from tuneplane.proto.contract.control_protocol import queued_for

from ._load import (
    coordinator_answer,
    gpu_inventory,
    heartbeats,
    load_process,
    open_connect,
    send_hello,
)

#: A dial that has no Welcome in this time failed (a coordinator too busy to answer counts),
#: as the real agent's session counts it.
DIAL_TIMEOUT_S = WELCOME_TIMEOUT_S
PROBE_TIMEOUT_S = 1.0


class Fleet:
    """Every simulated Node of this process, and what they did."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.addresses: list[str] = list(config["controls"])
        ctx = grpc_client_context(Path(config["ca"]))
        self.channels: dict[str, list[Channel]] = {}
        for address in self.addresses:
            host, _, port = address.rpartition(":")
            self.channels[address] = [
                Channel(host, int(port), ssl=ctx) for _ in range(config["channels"])
            ]
        self.nodes: list[dict[str, str]] = config["nodes"]
        # The monotonic time of each Node's latest Welcome, and when the stream that Welcome
        # came on got through to the coordinator (TLS handshake done, request sent): the gap is
        # the Hello's turn in the coordinator.
        self.welcomed: dict[str, float] = {}
        self.through: dict[str, float] = {}
        self.dials = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.cap = backoff_cap(None)

    async def dial(self, address: str, index: int, node_id: str, credential: str) -> bool:
        """One Connect to ``address``: True if it was welcomed (it then speaks until the stream
        ends)."""
        self.dials += 1
        channel = self.channels[address][index % len(self.channels[address])]
        welcomed = False
        try:
            async with open_connect(channel, credential) as stream:
                async with asyncio.timeout(DIAL_TIMEOUT_S) as deadline:
                    await stream.send_request()
                    through = time.monotonic()
                    await send_hello(stream, node_id, gpu_inventory(node_id))
                    answer = await coordinator_answer(stream)
                    wait_s = queued_for(answer)
                    if wait_s is not None:
                        # Put in line: the Welcome may take as long as tuneplane-node then waits.
                        longer = welcome_timeout_in_line(wait_s, WELCOME_TIMEOUT_S)
                        deadline.reschedule(asyncio.get_running_loop().time() + longer)
                    first = await stream.recv_message()
                if first is None or betterproto.which_one_of(first, "body")[0] != "welcome":
                    self.failures["not welcomed"] += 1
                    return False
                welcomed = True
                self.welcomed[node_id] = time.monotonic()
                self.through[node_id] = through
                welcome = first.welcome
                if welcome.heartbeat_timeout_ms:
                    self.cap = backoff_cap(welcome.heartbeat_timeout_ms / 1000)
                beater = asyncio.create_task(
                    heartbeats(stream, welcome.heartbeat_interval_ms / 1000)
                )
                try:
                    async for _ in stream:
                        pass
                finally:
                    beater.cancel()
        except Exception as exc:  # every way a dial fails is counted, by kind
            # A welcomed stream's end (its coordinator died) is told apart from a failed dial.
            kind = type(exc).__name__
            if isinstance(exc, GRPCError):
                # Counted by what it says, without the error id each one carries.
                said = re.sub(r"\(error id \w+\) ", "", exc.message or "")
                kind += f" {exc.status.name} {said}".rstrip()
            self.failures[("stream ended: " if welcomed else "") + kind] += 1
        return welcomed

    async def wait(self, failed_rounds: int) -> None:
        """The agent's wait after ``failed_rounds`` failed rounds, cut short by a probe."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + backoff_delay(failed_rounds, random.random(), self.cap)
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(left, probe_delay(random.random())))
            found = await asyncio.gather(*(_accepts(a) for a in self.addresses))
            if any(found):
                return

    async def node(self, index: int, node_id: str, credential: str) -> None:
        """One Node, forever: rounds over every address, the last that welcomed it first."""
        order = list(self.addresses)
        failed_rounds = 0
        while True:
            for address in list(order):
                if await self.dial(address, index, node_id, credential):
                    order.remove(address)
                    order.insert(0, address)
                    failed_rounds = 0
                    break
            else:
                failed_rounds += 1
                await self.wait(failed_rounds)

    async def report_since(self, since: float, wait_s: float) -> dict[str, Any]:
        """Once every Node was welcomed after ``since`` (or ``wait_s`` passed): what happened."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if all(self.welcomed.get(n["id"], 0.0) > since for n in self.nodes):
                break
            await asyncio.sleep(0.01)
        back = [t - since for t in self.welcomed.values() if t > since]
        # When each Node welcomed again got through to the coordinator that welcomed it.
        through = [self.through[n] - since for n, t in self.welcomed.items() if t > since]
        report = {
            "back_s": sorted(back),
            "through_s": sorted(through),
            "missing": len(self.nodes) - len(back),
            "dials": self.dials,
            "failures": dict(self.failures),
        }
        self.dials = 0
        self.failures.clear()
        return report

    def close(self) -> None:
        for channels in self.channels.values():
            for channel in channels:
                channel.close()


async def _accepts(address: str) -> bool:
    """Whether ``address`` takes a plain TCP connect (closed at once, nothing sent)."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, int(port))
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def run(config: dict[str, Any]) -> None:
    fleet = Fleet(config)
    tasks = [
        asyncio.create_task(fleet.node(i, n["id"], n["credential"]))
        for i, n in enumerate(fleet.nodes)
    ]
    loop = asyncio.get_running_loop()
    try:
        first = await fleet.report_since(0.0, config["wait_s"])
        if first["missing"]:
            print(f"failed {first['missing']} Nodes not welcomed: {first['failures']}", flush=True)
            return
        print(f"ready {len(fleet.nodes)}", flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "stop":
                return
            report = await fleet.report_since(float(line[1]), config["wait_s"])
            print(json.dumps(report), flush=True)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        fleet.close()


def main() -> int:
    load_process(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
