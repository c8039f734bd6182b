"""`tp job show --watch` on WatchJob through a coordinator restart: the outage is said, the
stream is opened again once the coordinator is back, and the change after it arrives.

Real processes: ``tuneplane-coordinator serve`` (stopped with SIGTERM while the stream is open,
which must not hold up its shutdown) and ``tp``, over loopback TLS.
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import uuid
from pathlib import Path
from typing import IO

from tests.cli.tp_process import TP
from tests.coordinator.grpc_client import api_client, enrolled_node, jobspec
from tests.support.coordinator import start_coordinator
from tuneplane.proto import v1

WAIT_S = 60.0
INTERVAL_S = 0.2
#: Only a Node that never connects could hold a Job this big: it stays queued.
QUEUED_GPUS = 4


def test_a_watch_says_the_outage_and_goes_on_after_a_restart(tmp_path: Path) -> None:
    with start_coordinator(tmp_path, heartbeat_timeout=5) as coord:
        enrolled_node(coord, "parked", gpus=QUEUED_GPUS)

        async def submit() -> str:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                spec = jobspec(gpus=QUEUED_GPUS, project="outage")
                return (await api.submit(spec, "key-" + uuid.uuid4().hex)).run_id

        async def cancel(run_id: str) -> None:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                await api.stub.cancel_job(v1.CancelJobRequest(run_id=run_id, reason="enough"))

        run_id = asyncio.run(submit())
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEPLANE_")}
        env["TUNEPLANE_CONTEXT"] = str(coord.context_path)
        watch = subprocess.Popen(
            [*TP, "job", "show", run_id, "--watch", "--interval", str(INTERVAL_S)],
            cwd=coord.state_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert watch.stdout is not None and watch.stderr is not None
            # The view (in a pipe: printed whole, again on each change) shows the Job queued.
            while "queued" not in _line(watch.stdout):
                continue
            ports = coord.ports()
            # SIGTERM with the stream open: serve stops cleanly (checked) and promptly.
            coord.stop()
            said = _line(watch.stderr)
            coord.start(ports)
            asyncio.run(cancel(run_id))
            out, err = watch.communicate(timeout=WAIT_S)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
    assert watch.returncode == 0, err
    # Unreachable, or (when tp asked before it saw the connection close) a broken connection.
    assert f"the coordinator at {coord.api}" in said.lower(), said
    assert said.rstrip().endswith(f"Retrying every {INTERVAL_S:g} s."), said
    assert out.splitlines()[-1] == f"Job {run_id} is cancelled.", out


def _line(pipe: IO[str]) -> str:
    """The next line from ``pipe``, waited for at most WAIT_S."""
    ready, _, _ = select.select([pipe], [], [], WAIT_S)
    assert ready, f"no line from tp within {WAIT_S:g} s"
    return pipe.readline()
