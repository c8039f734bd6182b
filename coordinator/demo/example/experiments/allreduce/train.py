"""The demo's process-group Job, with no torch: every rank meets rank 0 over TCP and they sum ranks.

Each local process gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torch.distributed would.
Rank 0 listens on MASTER_PORT; every other rank connects (retrying until rank 0 is up) and sends
its rank; rank 0 checks that the ranks are exactly 0..WORLD_SIZE-1 by their sum and count, and
sends the sum back. Every rank writes its result into $TUNEPLANE_OUT_DIR and exits 0 only if the
sum is right. ALLREDUCE_TIMEOUT_S (default 60) bounds the whole exchange.

Rank 0 also reports a few hundred training metrics with the tuneplane.report SDK (the runner puts
it on PYTHONPATH), so the demo can chart train/loss from the coordinator's store. The curve is a
deterministic stand-in for a real loss: a decay with a little wobble and one spike at step 140.

The recipe's parameters arrive as flags after the script (`--steps 300 --learning_rate 0.001`,
from config.yaml or `tp submit --param`) and as TUNEPLANE_PARAM_<NAME> variables; this script
reads the flags, which `tp submit --preview` shows under Command.
"""

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


def log(rank: int, text: str) -> None:
    print(f"[rank {rank}] {text}", flush=True)


def write_result(rank: int, result: dict[str, Any]) -> None:
    out = Path(os.environ["TUNEPLANE_OUT_DIR"]) / f"allreduce-rank-{rank}.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True) + "\n")
    os.replace(tmp, out)
    log(rank, f"wrote {out}")


def read_line(conn: socket.socket, deadline: float) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("peer closed the connection mid-message")
        data += chunk
    message: dict[str, Any] = json.loads(data)
    return message


def serve(rank: int, world: int, addr: str, port: int, deadline: float) -> int:
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    with socket.create_server(("", port), family=family, backlog=world) as server:
        log(rank, f"listening on port {port} for {world - 1} peers")
        peers: dict[int, socket.socket] = {}
        while len(peers) < world - 1:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            conn, _ = server.accept()
            hello = read_line(conn, deadline)
            peers[int(hello["rank"])] = conn
            log(rank, f"rank {hello['rank']} joined")
        total = rank + sum(peers)
        expected = world * (world - 1) // 2
        ok = total == expected and sorted(peers) == list(range(1, world))
        for conn in peers.values():
            conn.sendall((json.dumps({"sum": total, "ok": ok}) + "\n").encode())
            conn.close()
    log(rank, f"sum of ranks {total}, expected {expected}: {'ok' if ok else 'WRONG'}")
    write_result(rank, {"rank": rank, "world_size": world, "sum": total, "ok": ok})
    return 0 if ok else 1


def join(rank: int, world: int, addr: str, port: int, deadline: float) -> int:
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        conn.sendall((json.dumps({"rank": rank}) + "\n").encode())
        reply = read_line(conn, deadline)
    ok = bool(reply["ok"]) and reply["sum"] == world * (world - 1) // 2
    log(rank, f"rank 0 says the sum is {reply['sum']}: {'ok' if ok else 'WRONG'}")
    write_result(rank, {"rank": rank, "world_size": world, "sum": reply["sum"], "ok": ok})
    return 0 if ok else 1


def report_metrics(steps: int, learning_rate: float) -> None:
    from tuneplane.report import finish, init, log

    world = int(os.environ["WORLD_SIZE"])
    # Seconds between steps (default 0): `tuneplane demo --ha` paces the Job so that it is still
    # running when the demo kills the leading coordinator.
    pace = float(os.environ.get("DEMO_STEP_DELAY_S", "0"))
    init({"steps": steps, "learning_rate": learning_rate, "world_size": world})
    for step in range(steps):
        loss = 2.5 * math.exp(-step / 60) + 0.08 + 0.03 * math.sin(step / 5)
        if step == 140:
            loss += 1.5  # a spike, which downsampling must not hide
        lr = learning_rate * min(1.0, (step + 1) / 30)
        log({"train/loss": loss, "train/lr": lr}, step=step)
        time.sleep(pace)
    finish()


def main() -> int:
    parser = argparse.ArgumentParser(description="The demo's process-group Job.")
    parser.add_argument("--steps", type=int, default=300, help="metric steps rank 0 reports")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="peak learning rate")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + float(os.environ.get("ALLREDUCE_TIMEOUT_S", "60"))
    log(rank, f"world size {world}, meeting at {addr}:{port}; steps {args.steps}")
    if world == 1:
        report_metrics(args.steps, args.learning_rate)
        write_result(rank, {"rank": rank, "world_size": 1, "sum": 0, "ok": True})
        return 0
    if rank == 0:
        report_metrics(args.steps, args.learning_rate)
        return serve(rank, world, addr, port, deadline)
    return join(rank, world, addr, port, deadline)


if __name__ == "__main__":
    sys.exit(main())
