"""Coordinator event-loop lag while it handles the largest request each listener accepts.

The coordinator runs in this process (``serve``, its real listeners over loopback TLS) next to a
probe task that sleeps 1 ms in a loop and records how late each wake-up is: a request that holds
the event loop for 30 ms shows up as a 30 ms late wake-up. The requests come from a separate
client process, so the client's own work never competes with the coordinator for the
interpreter. For each kind of request the client prints when it starts and ends each call; the
lag of a call is the latest wake-up inside its window.

Kinds: a Preview with 8 MiB of experiment files (the most a JobSpec may carry), a GetJob of the
same size (its run id: receiving and decoding only, then not found), a 15 MiB Preview of numbers
(refused, after the JSON is read), the Commit of the 8 MiB Preview, the launch of
those Jobs on a Node the client plays (one window from its Hello to the last Prepare, each
carrying the whole JobSpec), a Ship of 5,000 points filling the telemetry listener's 3 MiB, and
an Enroll of 256 GPUs. Then 8 of the 8 MiB Previews at once, to show the bounded worker pool.

Knob: ``TUNEPLANE_BENCH_LAG_RUNS`` calls of each kind (5).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import betterproto
from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.auth import JOIN_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.gateways.collector_credentials import COLLECTOR_PREFIX
from tuneplane.coordinator.server.serve import ServeOptions, serve
from tuneplane.coordinator.store.core import Store, db_path
from tuneplane.coordinator.store.telemetry import TelemetryStore, telemetry_db_path
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.proto import v1

ADMIN = [sys.executable, "-m", "tuneplane.coordinator.cli.admin"]
SOURCE_BYTES = 8 * 1024 * 1024
HOSTILE_PREVIEW_BYTES = 15 * 1024 * 1024
SHIP_BYTES = 3 * 1024 * 1024 - 64 * 1024
SHIP_POINTS = 5000
ENROLL_GPUS = 256
CONCURRENT = 8
PROBE_S = 0.001
SHIP_MEMBER = MemberKey("run-lag", 1, 0)


# ----- the client process ------------------------------------------------------------------------


def _spec(experiment: str, source_files: dict[str, str], **extra: Any) -> str:
    recipe = Catalogue.bundled().get("custom/custom")
    assert recipe is not None
    return json.dumps(
        {
            "api_version": "tuneplane/v1",
            "project": "bench",
            "experiment": experiment,
            "method_id": "custom/custom",
            "recipe_digest": recipe.digest,
            "runtime_id": "",
            "entrypoint": ["bash", "train.sh"],
            "resources": {"profile": "bench", "series": "", "gpus": 1},
            "parameters": {},
            "env": {},
            "source_files": source_files,
            **extra,
        }
    )


def _big_spec(i: int) -> str:
    """8 MiB of experiment files: the ``train.sh`` the recipe runs (Preview refuses an
    experiment without it) and the rest (incompressible) in eight files of about 1 MiB."""
    script = b"#!/bin/sh\ntrue\n"
    part = (SOURCE_BYTES - len(script)) // 8
    files = {"train.sh": base64.b64encode(script).decode()} | {
        f"data/part{n}.bin": base64.b64encode(os.urandom(part)).decode() for n in range(8)
    }
    return _spec(f"big{i}", files)


def _numbers_spec() -> str:
    """15 MiB of JSON numbers: refused (no such parameter), but only once the JSON is read."""
    count = HOSTILE_PREVIEW_BYTES // len("0.5, ")
    return _spec("numbers", {}, parameters={"x": [0.5] * count})


def _ship(i: int) -> v1.ShipRequest:
    tag = "t" * (SHIP_BYTES // SHIP_POINTS - 64)
    return v1.ShipRequest(
        member=v1.MemberRef(
            run_id=SHIP_MEMBER.run_id,
            attempt=SHIP_MEMBER.attempt,
            member_index=SHIP_MEMBER.member_index,
        ),
        points=[
            v1.MetricPoint(
                source_id="src", offset=i * SHIP_POINTS + n, index=0, tag=tag, step=n, value=1.0
            )
            for n in range(SHIP_POINTS)
        ],
    )


def _enroll(token: str, i: int) -> v1.EnrollRequest:
    host = f"lag-{i}"
    return v1.EnrollRequest(
        join_token=token,
        hostname=host,
        inventory=v1.Inventory(
            hostname=host,
            cpu_count=256,
            memory_bytes=1 << 42,
            gpu_source="simulated",
            gpus=[
                v1.Gpu(index=n, uuid=f"GPU-{host}-{n:04d}", series="h200", healthy=True)
                for n in range(ENROLL_GPUS)
            ],
        ),
    )


def _say(*words: object) -> None:
    print(*words, flush=True)


async def _launch(setup: dict[str, Any], control_channel: Channel, jobs: int) -> None:
    """Be the Node the queued 8 MiB Jobs launch on: the window runs from its Hello until every
    Job's Prepare (each carrying the whole JobSpec) has arrived."""
    control = v1.ControlStub(control_channel)
    try:
        enrolled = await control.enroll(_enroll(setup["launch_token"], 999))
        async with control_channel.request(
            "/tuneplane.v1.Control/Connect",
            Cardinality.STREAM_STREAM,
            v1.NodeMessage,
            v1.CoordinatorMessage,
            metadata={"authorization": f"Bearer {enrolled.node_credential}"},
        ) as stream:
            await stream.send_request()
            inventory = _enroll("", 999).inventory
            _say("begin", "launch")
            await stream.send_message(
                v1.NodeMessage(
                    hello=v1.Hello(
                        node_id=enrolled.node_id, agent_version="bench", inventory=inventory
                    )
                )
            )
            prepared = size = 0
            while prepared < jobs:
                message = await stream.recv_message()
                assert message is not None, "the coordinator ended the Node's stream"
                if betterproto.which_one_of(message, "body")[0] == "prepare":
                    prepared += 1
                    size = max(size, len(message.prepare.jobspec_json))
            _say("end", "launch", size)
            await stream.cancel()
    finally:
        control_channel.close()


async def _client(setup: dict[str, Any]) -> None:
    ca = Path(setup["ca"])

    def channel(address: str) -> Channel:
        host, _, port = address.rpartition(":")
        return Channel(host, int(port), ssl=grpc_client_context(ca))

    runs = int(setup["runs"])
    api_channel, control_channel = channel(setup["api"]), channel(setup["control"])
    telemetry_channel = channel(setup["telemetry"])
    api = v1.ApiStub(api_channel, metadata={"authorization": f"Bearer {setup['token']}"})
    control = v1.ControlStub(control_channel)
    telemetry = v1.TelemetryStub(
        telemetry_channel, metadata={"authorization": f"Bearer {setup['collector']}"}
    )
    previews: list[v1.PreviewReply] = []
    try:
        await api.list_fleets(v1.ListFleetsRequest())  # TLS and HTTP/2 set up outside windows
        for i in range(runs):
            text = _big_spec(i)
            _say("begin", "preview")
            previews.append(await api.preview(v1.PreviewRequest(jobspec_json=text)))
            _say("end", "preview", len(text))
        for _ in range(runs):
            # Only receiving and decoding: a GetJob with an 11 MB run id, refused as not found.
            _say("begin", "receive")
            try:
                await api.get_job(
                    v1.GetJobRequest(run_id="r" * len(previews[0].resolved_jobspec_json))
                )
                raise AssertionError("a GetJob of an 11 MB run id found a Job")
            except GRPCError:
                pass
            _say("end", "receive", len(previews[0].resolved_jobspec_json))
        text = _numbers_spec()
        for _ in range(runs):
            _say("begin", "preview-numbers")
            try:
                await api.preview(v1.PreviewRequest(jobspec_json=text))
                raise AssertionError("a Preview of 15 MiB of numbers was admitted")
            except Exception as exc:  # the refusal is the expected outcome
                if isinstance(exc, AssertionError):
                    raise
            _say("end", "preview-numbers", len(text))
        for i, preview in enumerate(previews):
            _say("begin", "commit")
            await api.commit(
                v1.CommitRequest(
                    preview_id=preview.preview_id, digest=preview.digest, retry_key=f"lag-{i}"
                )
            )
            _say("end", "commit", len(preview.resolved_jobspec_json))
        await _launch(setup, channel(setup["control"]), len(previews))
        for i in range(runs):
            ship = _ship(i)
            size = len(bytes(ship))
            _say("begin", "ship")
            await telemetry.ship(ship)
            _say("end", "ship", size)
        for i, token in enumerate(setup["join_tokens"][:runs]):
            request = _enroll(token, i)
            _say("begin", "enroll")
            await control.enroll(request)
            _say("end", "enroll", len(bytes(request)))
        texts = [_big_spec(100 + n) for n in range(CONCURRENT)]
        _say("begin", "preview-x8")
        await asyncio.gather(*(api.preview(v1.PreviewRequest(jobspec_json=t)) for t in texts))
        _say("end", "preview-x8", sum(len(t) for t in texts))
    finally:
        for c in (api_channel, control_channel, telemetry_channel):
            c.close()


# ----- the coordinator process -------------------------------------------------------------------


class Probe:
    """Sleeps ``PROBE_S`` in a loop; (wake-up time, lateness) of every wake-up."""

    def __init__(self) -> None:
        self.wakes: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(PROBE_S)
            woke = time.perf_counter()
            self.wakes.append((woke, woke - started - PROBE_S))

    def worst(self, start: float, end: float) -> float:
        """The latest wake-up from ``start`` to shortly after ``end`` (a stall ending the window
        is seen by the first wake-up after it)."""
        return max((lag for at, lag in self.wakes if start <= at <= end + 0.002), default=0.0)


def _prepare(root: Path) -> Path:
    state_dir = root / "coordinator"
    subprocess.run([*ADMIN, "init", "--state-dir", str(state_dir)], check=True, capture_output=True)
    config = state_dir / "coordinator.toml"
    # A Fleet with no Nodes: admitted Jobs stay queued. Every call comes from one address.
    config.write_text(
        config.read_text()
        + '\n[profiles.bench]\nseries = "h200"\nfleet = "empty"\n'
        + "\n[limits]\nenroll_burst = 0\n"
    )
    subprocess.run(
        [*ADMIN, "fleet", "create", "empty", "--state-dir", str(state_dir)],
        check=True,
        capture_output=True,
    )
    return state_dir


async def _credentials(state_dir: Path, runs: int) -> tuple[list[str], str, str]:
    """Join tokens for the Enroll calls and the launch Node, and a collector credential for the
    Ship calls."""
    now = int(time.time() * 1000)
    tokens = [new_credential(JOIN_PREFIX) for _ in range(runs)]
    launch = new_credential(JOIN_PREFIX)
    store = await Store.open(db_path(state_dir))
    try:
        for t in tokens:
            await store.create_join_token(hash_credential(t), "default", now, now + 3_600_000)
        # The Node the admitted Jobs launch on joins their Fleet.
        await store.create_join_token(hash_credential(launch), "empty", now, now + 3_600_000)
    finally:
        await store.close()
    collector = new_credential(COLLECTOR_PREFIX)
    telemetry = await TelemetryStore.open(telemetry_db_path(state_dir))
    try:
        await telemetry.issue_credentials(
            [(hash_credential(collector), SHIP_MEMBER, "node-lag")], now, 3_600_000
        )
    finally:
        await telemetry.close()
    return tokens, launch, collector


async def _measure(state_dir: Path, runs: int) -> dict[str, list[tuple[float, int]]]:
    tokens, launch, collector = await _credentials(state_dir, runs)
    probe = Probe()
    results: dict[str, list[tuple[float, int]]] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            serve,
            ServeOptions(
                state_dir,
                api_port=0,
                control_port=0,
                telemetry_port=0,
                heartbeat_interval_s=1.0,
            ),
        )
        endpoints = state_dir / "endpoints.json"
        with anyio.fail_after(60):
            while not endpoints.exists():
                await anyio.sleep(0.05)
        data = json.loads(endpoints.read_text())
        setup = {
            "api": data["api"],
            "control": data["control"],
            "telemetry": data["telemetry"],
            "ca": data["ca"],
            "token": (state_dir / "admin.token").read_text().strip(),
            "collector": collector,
            "join_tokens": tokens,
            "launch_token": launch,
            "runs": runs,
        }
        tg.start_soon(probe.run)
        idle_from = time.perf_counter()
        await anyio.sleep(1.0)
        results["idle"] = [(probe.worst(idle_from, time.perf_counter()), 0)]
        async with await anyio.open_process(
            [sys.executable, "-m", "bench.loop_lag", "--client", json.dumps(setup)],
            stderr=None,
        ) as client:
            assert client.stdout is not None
            begun = 0.0
            buffer = b""
            async for chunk in client.stdout:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    word, name, *size = line.decode().split()
                    if word == "begin":
                        begun = time.perf_counter()
                    else:
                        lag = probe.worst(begun, time.perf_counter())
                        results.setdefault(name, []).append((lag, int(size[0])))
            await client.wait()
            if client.returncode:
                raise RuntimeError(f"the client process failed (exit {client.returncode})")
        tg.cancel_scope.cancel()
    return results


LABELS = {
    "idle": "idle coordinator (1 s)",
    "preview": "Preview, 8 MiB of experiment files",
    "preview-numbers": "Preview, 15 MiB of JSON numbers (refused)",
    "receive": "GetJob of an 11 MB run id (receive only)",
    "commit": "Commit of the 8 MiB Preview",
    "launch": "those Jobs launched: a Prepare each",
    "ship": f"Ship, {SHIP_POINTS} points in 3 MiB",
    "enroll": f"Enroll, {ENROLL_GPUS} GPUs",
    "preview-x8": f"{CONCURRENT} Previews of 8 MiB at once",
}


def main() -> int:
    runs = int(os.environ.get("TUNEPLANE_BENCH_LAG_RUNS", "5"))
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="tuneplane-lag-") as tmp:
        state_dir = _prepare(Path(tmp))
        results = anyio.run(_measure, state_dir, runs, backend="asyncio")
    print(f"event-loop lag (a {PROBE_S * 1000:.0f} ms probe in the coordinator's loop), ms:")
    print(f"  {'request':44} {'bytes':>10} {'calls':>5} {'median':>7} {'worst':>7}")
    for name, label in LABELS.items():
        samples = results.get(name, [])
        if not samples:
            print(f"  {label:44} (no calls finished)")
            continue
        lags = [lag * 1000 for lag, _ in samples]
        size = max(s for _, s in samples)
        print(
            f"  {label:44} {size:>10} {len(lags):>5} "
            f"{statistics.median(lags):>7.1f} {max(lags):>7.1f}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        asyncio.run(_client(json.loads(sys.argv[2])))
    else:
        sys.exit(main())
