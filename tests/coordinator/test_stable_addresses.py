"""``serve`` listens on fixed, documented ports unless told otherwise, and a taken port stops it
with a sentence naming the port and the option to change (docs/operator.md)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import stop_cleanly, track, untrack, wait_until

DOCUMENTED = {"api": 7443, "control": 7444, "telemetry": 7445}


def _admin(*args: str) -> list[str]:
    return [sys.executable, "-m", "tuneplane.coordinator.cli.admin", *args]


def _init(tmp_path: Path) -> Path:
    state_dir = tmp_path / "coordinator"
    subprocess.run(
        _admin("init", "--state-dir", str(state_dir)), check=True, capture_output=True, timeout=60
    )
    return state_dir


def _taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_serve_defaults_to_the_documented_ports(tmp_path: Path) -> None:
    taken = [f"{name} {port}" for name, port in DOCUMENTED.items() if _taken(port)]
    if taken:
        pytest.skip(f"needs ports 7443-7445 free on 127.0.0.1; in use here: {', '.join(taken)}")
    state_dir = _init(tmp_path)
    log_path = state_dir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _admin("serve", "--state-dir", str(state_dir)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    track(proc)
    try:

        def ready() -> dict[str, object] | None:
            assert proc.poll() is None, log_path.read_text(encoding="utf-8", errors="replace")
            try:
                data = json.loads((state_dir / "endpoints.json").read_text(encoding="utf-8"))
            except (FileNotFoundError, ValueError):
                return None
            return data if data.get("pid") == proc.pid else None

        endpoints = wait_until("serve to publish endpoints.json", ready, timeout=60)
        for name, port in DOCUMENTED.items():
            assert endpoints[name] == f"127.0.0.1:{port}", endpoints
            # Really listening there, not only written down.
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        stop_cleanly(proc, "coordinator", lambda: log_path.read_text(encoding="utf-8"), 15)
        untrack(proc)


@pytest.mark.parametrize("listener", ["api", "control", "telemetry"])
def test_a_taken_port_stops_serve_naming_the_port_and_option(tmp_path: Path, listener: str) -> None:
    state_dir = _init(tmp_path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        ports = {name: "0" for name in DOCUMENTED}
        ports[listener] = str(port)
        flags = [arg for name, value in ports.items() for arg in (f"--{name}-port", value)]
        out = subprocess.run(
            _admin("serve", "--state-dir", str(state_dir), *flags),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode != 0, out.stdout + out.stderr
    assert (
        f"The {listener} listener cannot listen on 127.0.0.1:{port} (Address already in use). "
        f"Change --{listener}-port (0 picks a free port) or stop the process that holds it."
    ) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    # Nothing was published: no client or Node is pointed at a coordinator that is not there.
    assert not (state_dir / "endpoints.json").exists()


def test_a_port_out_of_range_is_refused_before_anything_starts(tmp_path: Path) -> None:
    state_dir = _init(tmp_path)
    out = subprocess.run(
        _admin("serve", "--state-dir", str(state_dir), "--control-port", "70000"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--control-port" in out.stderr and "70000" in out.stderr, out.stderr
    assert not (state_dir / "endpoints.json").exists()
