"""A client on the standard Google gRPC stack (grpcio), run as its own process by test_interop.

Usage: ``python interop_client.py SETTINGS_JSON``, with the code grpcio-tools generated from
``proto/tuneplane/v1/*.proto`` on PYTHONPATH. It talks TLS to the three listeners of a real
coordinator and prints one JSON object: each step's status code name and details. Nothing of
TunePlane is imported: this is what a third party would build from the .proto files alone.
"""

from __future__ import annotations

import functools
import json
import queue
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, import-not-found, unused-ignore]

from tuneplane.v1 import (  # type: ignore[import-not-found, unused-ignore]
    api_pb2,
    api_pb2_grpc,
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    telemetry_pb2,
    telemetry_pb2_grpc,
)

TIMEOUT_S = 30


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        reply = fn()
    except grpc.RpcError as exc:
        return {"code": exc.code().name, "details": exc.details() or ""}
    return {"code": "OK", "reply": reply}


def main() -> None:
    settings = json.loads(sys.argv[1])
    creds = grpc.ssl_channel_credentials(Path(settings["ca"]).read_bytes())
    admin = [("authorization", f"Bearer {settings['admin_token']}")]
    out: dict[str, Any] = {}
    with (
        grpc.secure_channel(settings["api"], creds) as api_channel,
        grpc.secure_channel(settings["control"], creds) as control_channel,
        grpc.secure_channel(settings["telemetry"], creds) as telemetry_channel,
    ):
        api = api_pb2_grpc.ApiStub(api_channel)
        control = control_pb2_grpc.ControlStub(control_channel)
        telemetry = telemetry_pb2_grpc.TelemetryStub(telemetry_channel)

        out["list_fleets"] = _outcome(
            lambda: [
                f.name
                for f in api.ListFleets(
                    api_pb2.ListFleetsRequest(), metadata=admin, timeout=TIMEOUT_S
                ).fleets
            ]
        )
        inventory = common_pb2.Inventory(
            hostname="interop",
            cpu_count=4,
            gpu_source="simulated",
            gpus=[common_pb2.Gpu(index=0, uuid="GPU-interop-0", series="h200", healthy=True)],
        )
        enrolled = control.Enroll(
            control_pb2.EnrollRequest(
                join_token=settings["join_token"], hostname="interop", inventory=inventory
            ),
            timeout=TIMEOUT_S,
        )
        out["enroll"] = {"code": "OK", "node_id": enrolled.node_id}

        outbox: queue.Queue[control_pb2.NodeMessage | None] = queue.Queue()

        def session() -> Iterator[control_pb2.NodeMessage]:
            yield control_pb2.NodeMessage(
                hello=control_pb2.Hello(
                    node_id=enrolled.node_id, agent_version="interop", inventory=inventory
                )
            )
            yield control_pb2.NodeMessage(heartbeat=control_pb2.Heartbeat(seq=7))
            # Our side stays open until the scenario is done: a closed side ends the session.
            while (message := outbox.get(timeout=TIMEOUT_S)) is not None:
                yield message

        def ship(commit: Any) -> dict[str, Any]:
            point = telemetry_pb2.MetricPoint(
                source_id="interop.jsonl", offset=0, index=0, tag="loss", step=1, value=0.5
            )
            reply = telemetry.Ship(
                telemetry_pb2.ShipRequest(member=commit.member, points=[point]),
                metadata=[("authorization", f"Bearer {commit.collector_credential}")],
                timeout=TIMEOUT_S,
            )
            # One point more than a Ship may carry: refused before it is decoded.
            out["ship_too_many_points"] = _outcome(
                lambda: telemetry.Ship(
                    telemetry_pb2.ShipRequest(member=commit.member, points=[point] * 5001),
                    metadata=[("authorization", f"Bearer {commit.collector_credential}")],
                    timeout=TIMEOUT_S,
                )
            )
            return {"stored": reply.stored, "address": commit.telemetry_address}

        def connect() -> list[str]:
            """Hello, a heartbeat; then as this Node: submit a Job, prepare it, and with the
            collector credential its Commit carries, Ship a point."""
            seen = []
            stream = control.Connect(
                session(),
                metadata=[("authorization", f"Bearer {enrolled.node_credential}")],
                timeout=TIMEOUT_S * 3,
            )
            for message in stream:
                kind = message.WhichOneof("body")
                seen.append(kind)
                if kind == "heartbeat_ack" and message.heartbeat_ack.seq == 7:
                    preview = api.Preview(
                        api_pb2.PreviewRequest(jobspec_json=settings["jobspec"]),
                        metadata=admin,
                        timeout=TIMEOUT_S,
                    )
                    api.Commit(
                        api_pb2.CommitRequest(
                            preview_id=preview.preview_id,
                            digest=preview.digest,
                            retry_key="interop",
                        ),
                        metadata=admin,
                        timeout=TIMEOUT_S,
                    )
                elif kind == "prepare":
                    reply = control_pb2.PrepareReply(member=message.prepare.member, ok=True)
                    if message.prepare.pick_rendezvous:
                        reply.rendezvous.master_addr = "127.0.0.1"
                        reply.rendezvous.master_port = 29500
                    outbox.put(control_pb2.NodeMessage(prepare_reply=reply))
                elif kind == "commit":
                    out["ship"] = _outcome(functools.partial(ship, message.commit))
                    outbox.put(None)
                    stream.cancel()
                    break
            return [k for k in seen if k != "heartbeat_ack"]

        out["connect"] = _outcome(connect)
        out["ping"] = _outcome(
            lambda: (
                telemetry.Ping(
                    telemetry_pb2.PingRequest(note="interop"), metadata=admin, timeout=TIMEOUT_S
                ).principal
            )
        )
        out["ship_without_collector_credential"] = _outcome(
            lambda: telemetry.Ship(telemetry_pb2.ShipRequest(), metadata=admin, timeout=TIMEOUT_S)
        )
        # The refusals, as a third-party client sees them.
        out["enroll_over_size"] = _outcome(
            lambda: control.Enroll(
                control_pb2.EnrollRequest(join_token="tpj-x", hostname="h" * (1 << 20)),
                timeout=TIMEOUT_S,
            )
        )
        out["enroll_too_many_gpus"] = _outcome(
            lambda: control.Enroll(
                control_pb2.EnrollRequest(
                    join_token="tpj-x",
                    inventory=common_pb2.Inventory(gpus=[common_pb2.Gpu()] * 300),
                ),
                timeout=TIMEOUT_S,
            )
        )
        out["get_job_nul"] = _outcome(
            lambda: api.GetJob(
                api_pb2.GetJobRequest(run_id="run-\x00"), metadata=admin, timeout=TIMEOUT_S
            )
        )
        out["preview_loader_variable"] = _outcome(
            lambda: api.Preview(
                api_pb2.PreviewRequest(jobspec_json=settings["loader_jobspec"]),
                metadata=admin,
                timeout=TIMEOUT_S,
            )
        )
        out["preview_over_size"] = _outcome(
            lambda: api.Preview(
                api_pb2.PreviewRequest(jobspec_json="x" * (17 << 20)),
                metadata=admin,
                timeout=TIMEOUT_S,
            )
        )
        # Last: spend this address's Enroll allowance until the coordinator says so.
        for attempt in range(1, 50):
            answer = _outcome(
                lambda: control.Enroll(
                    control_pb2.EnrollRequest(join_token="tpj-x"), timeout=TIMEOUT_S
                )
            )
            if answer["code"] == "RESOURCE_EXHAUSTED":
                out["enroll_rate_limited"] = {**answer, "after": attempt}
                break
    print(json.dumps(out))


if __name__ == "__main__":
    main()
