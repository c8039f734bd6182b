"""Load driver for the reconnect storm: one process playing many Nodes that, like real agents,
come back on their own when their coordinator goes away and returns.

Run by ``bench/coordinator.py`` as ``python -m bench._storm_load CONFIG.json`` (the config of
``bench/_load.py``). Each Node opens its Connect stream, says Hello, heartbeats once welcomed, and
when its stream ends (or a dial fails) waits as ``tuneplane-node`` does
(:mod:`tuneplane.agent.reconnect`): a fully jittered backoff whose ceiling doubles per failed round
up to a third of the heartbeat timeout, or the turn a busy coordinator named (put in line, it awaits
its Welcome as long as tuneplane-node does), cut short when a TCP probe sees the control port that
refused accept again. One prober per process stands in for every Node's own (5,000 probes every half
second would measure the load machine, not the coordinator); each Node then dials after its own
jittered probe delay, as it would have noticed.

Protocol on stdio: ``ready <n>`` once every Node has its first Welcome; after a line on stdin
(the parent is about to stop the coordinator) every Node whose stream then ends counts again
when it is welcomed again; once all have been, one JSON line: the wall-clock time of the first
and the last such Welcome, how many dials failed meanwhile. Then it waits for stdin to close.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import betterproto
from grpclib.client import Channel

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.agent.reconnect import (
    PROBE_TIMEOUT_S,
    ProbeWatch,
    backoff_cap,
    probe_delay,
    redial_delay,
    welcome_timeout_in_line,
)
from tuneplane.agent.session import WELCOME_TIMEOUT_S
from tuneplane.agent.wire import CONNECT_DEADLINE_S
from tuneplane.proto.contract.control_protocol import BUSY_HEADER, come_back_in, queued_for

from ._load import (
    coordinator_answer,
    gpu_inventory,
    heartbeats,
    load_process,
    open_connect,
    send_hello,
)


class Storm:
    """What the Nodes of this process saw since "go"."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.armed = False  # set by "go": from now on an ended stream counts
        self.gone: set[str] = set()  # Nodes whose stream ended after "go"
        self.back: dict[str, float] = {}  # Node -> wall-clock time of its Welcome after that
        self.failed_dials = 0
        # Why dials and streams failed since "go" (exception type): the kill itself ends every
        # stream once; the rest are dials refused while the coordinator was down, or timed out.
        self.failed_by: collections.Counter[str] = collections.Counter()
        self.first_welcomes = 0
        self.ready = asyncio.Event()
        self.all_back = asyncio.Event()

    def welcomed(self, node_id: str) -> None:
        if node_id in self.gone and node_id not in self.back:
            self.back[node_id] = time.time()
            if len(self.back) == self.count:
                self.all_back.set()
        elif not self.armed:
            self.first_welcomes += 1
            if self.first_welcomes == self.count:
                self.ready.set()

    def ended(self, node_id: str) -> None:
        if self.armed and node_id not in self.back:
            self.gone.add(node_id)


class Prober:
    """Probes the control port with a plain TCP connect about every half second (jittered);
    :attr:`back` is set when a port that refused accepts again."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._watch = ProbeWatch()
        self.back = asyncio.Event()

    async def run(self) -> None:
        address = f"{self._host}:{self._port}"
        while True:
            await asyncio.sleep(probe_delay(random.random()))
            accepted = await self._probe()
            if self._watch.observe({address: accepted}) is not None:
                self.back.set()
                self.back = asyncio.Event()
                self._watch = ProbeWatch()

    async def _probe(self) -> bool:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port), PROBE_TIMEOUT_S
            )
        except (TimeoutError, OSError):
            return False
        writer.close()
        return True


async def _node(channel: Channel, node: dict[str, str], storm: Storm, prober: Prober) -> None:
    node_id = node["id"]
    failed_rounds = 0
    timeout_s: float | None = None  # the heartbeat timeout the last Welcome gave
    while True:
        turn: float | None = None
        stage = "dial"
        try:
            async with open_connect(channel, node["credential"]) as stream:
                # The agent's deadlines: a coordinator that takes longer to connect, or to
                # answer Hello, is given up on and dialed again (a connection caught by a
                # listener going away could otherwise hang its whole channel).
                await asyncio.wait_for(stream.send_request(), CONNECT_DEADLINE_S)
                await send_hello(stream, node_id, gpu_inventory(node_id))
                stage = "answer"
                said = await coordinator_answer(stream, WELCOME_TIMEOUT_S)
                if BUSY_HEADER in said:
                    # Refused as busy: dial again at the turn it named, if it named one.
                    turn = come_back_in(said)
                    raise ConnectionError(said[BUSY_HEADER])
                # Put in line: the Welcome may take as long as tuneplane-node then waits.
                wait_s = queued_for(said)
                welcome_s = (
                    WELCOME_TIMEOUT_S
                    if wait_s is None
                    else welcome_timeout_in_line(wait_s, WELCOME_TIMEOUT_S)
                )
                stage = "Welcome" if wait_s is None else "Welcome in line"
                first = await asyncio.wait_for(stream.recv_message(), welcome_s)
                if first is None or betterproto.which_one_of(first, "body")[0] != "welcome":
                    raise ConnectionError("the coordinator answered Hello without Welcome")
                failed_rounds = 0
                stage = "session"
                timeout_s = first.welcome.heartbeat_timeout_ms / 1000
                storm.welcomed(node_id)
                beating = asyncio.create_task(
                    heartbeats(stream, first.welcome.heartbeat_interval_ms / 1000)
                )
                try:
                    async for _ in stream:
                        pass
                finally:
                    beating.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            storm.failed_dials += 1
            if storm.armed:
                storm.failed_by[f"{type(exc).__name__} ({stage})"] += 1
        storm.ended(node_id)
        failed_rounds += 1
        back = prober.back
        try:
            await asyncio.wait_for(
                back.wait(),
                redial_delay(failed_rounds, random.random(), backoff_cap(timeout_s), turn),
            )
            # This Node's own probe would have noticed somewhere within one probe interval.
            await asyncio.sleep(random.random() * probe_delay(random.random()))
        except TimeoutError:
            pass


async def run(config: dict[str, Any]) -> dict[str, Any]:
    host, _, port = config["control"].rpartition(":")
    ctx = grpc_client_context(Path(config["ca"]))
    channels = [Channel(host, int(port), ssl=ctx) for _ in range(config["channels"])]
    nodes = config["nodes"]
    storm = Storm(len(nodes))
    prober = Prober(host, int(port))
    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(prober.run())] + [
        asyncio.create_task(_node(channels[i % len(channels)], n, storm, prober))
        for i, n in enumerate(nodes)
    ]
    try:
        await storm.ready.wait()
        print(f"ready {len(nodes)}", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        storm.armed = True
        # The bench kills the coordinator only after this line: a stream that ended before
        # "armed" would never count as gone, and its Node never as back.
        print("armed", flush=True)
        await storm.all_back.wait()
        times = sorted(storm.back.values())
        print(
            json.dumps(
                {
                    "first_at": times[0],
                    "all_at": times[-1],
                    "failed_dials": storm.failed_dials,
                    "failed_by": dict(storm.failed_by),
                }
            ),
            flush=True,
        )
        await loop.run_in_executor(None, sys.stdin.read)
        return {}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            channel.close()


def main() -> int:
    load_process(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
