"""The inventory against a real NVIDIA driver, checked against ``nvidia-smi`` and CUDA itself.

Rules: these tests run only where NVML loads and ``nvidia-smi`` is on the PATH (a GPU machine);
elsewhere they skip with a sentence saying so. A GPU cannot come from a package, so a CPU machine
skips them even under ``CI=true``; the scripted NVML tests cover the same code there.
What they show on a GPU machine:
- every GPU NVML reports through :class:`InventorySource` is the one ``nvidia-smi`` lists at the
  same index (UUID, name, memory, driver version), and one with uncorrected ECC errors is unhealthy;
- a process given a member's ``CUDA_VISIBLE_DEVICES`` (as :func:`plan_processes` writes it) sees
  exactly one CUDA device, and it is that GPU (its UUID read through the CUDA driver API);
- the time of each read (printed; ``TUNEPLANE_GPU_REPORT=FILE`` also writes them as JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

from tuneplane.agent.inventory import Gpu, Inventory
from tuneplane.agent.inventory_source import InventorySource
from tuneplane.agent.launch_plan import ProcessSpec, plan_processes

TIMEOUT_S = 60
MIB = 1024 * 1024
QUERY = "index,uuid,name,memory.total,driver_version,ecc.errors.uncorrected.volatile.total"


def _why_no_gpu() -> str:
    """Empty when this machine has an NVIDIA driver NVML can read, else why not."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not on the PATH"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"NVML does not load ({exc})"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML reports no GPU"
    finally:
        pynvml.nvmlShutdown()
    return ""


WHY = _why_no_gpu()
pytestmark = pytest.mark.skipif(
    bool(WHY),
    reason=f"needs an NVIDIA GPU with its driver (NVML and nvidia-smi); here {WHY}",
)


def _smi() -> list[dict[str, str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT_S,
    ).stdout
    rows = []
    for line in out.strip().splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        rows.append(dict(zip(QUERY.split(","), cells, strict=True)))
    return rows


def _report(name: str, value: object) -> None:
    print(f"{name}: {json.dumps(value)}")
    target = os.environ.get("TUNEPLANE_GPU_REPORT")
    if target:
        path = Path(target)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = value
        path.write_text(json.dumps(data, indent=2))


def _inventory() -> Inventory:
    return InventorySource("real-gpu", None).collect()


def test_the_inventory_is_what_nvidia_smi_reports() -> None:
    source = InventorySource("real-gpu", None)
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        inventory = source.collect()
        timings.append((time.perf_counter() - started) * 1000)
    _report("probe_ms", {"first": round(timings[0], 2), "median": statistics.median(timings)})
    smi = _smi()
    _report("nvidia_smi", smi)
    _report(
        "inventory",
        [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "series": g.series,
                "memory_bytes": g.memory_bytes,
                "healthy": g.healthy,
                "health_reason": g.health_reason,
                "mig_enabled": g.mig_enabled,
            }
            for g in inventory.gpus
        ],
    )
    assert inventory.gpu_source == "nvml"
    assert [g.index for g in inventory.gpus] == [int(row["index"]) for row in smi]
    for gpu, row in zip(inventory.gpus, smi, strict=True):
        assert gpu.uuid == row["uuid"]
        assert gpu.name == row["name"]
        # nvidia-smi prints MiB, rounded down.
        assert gpu.memory_bytes // MIB == int(row["memory.total"])
        assert inventory.driver_version == row["driver_version"]
        ecc = row["ecc.errors.uncorrected.volatile.total"]
        if ecc.isdigit() and int(ecc) > 0:
            assert not gpu.healthy and "ECC" in gpu.health_reason


_CUDA_CHILD = r"""
import ctypes, json, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        sys.exit(f"{what} failed with CUDA error {code}")
check(cuda.cuInit(0), "cuInit")
count = ctypes.c_int()
check(cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
uuids = []
for ordinal in range(count.value):
    device = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    raw = (ctypes.c_ubyte * 16)()
    check(cuda.cuDeviceGetUuid_v2(raw, device), "cuDeviceGetUuid_v2")
    h = bytes(raw).hex()
    uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print(json.dumps(uuids))
"""


def _cuda_sees(visible: str) -> list[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    seen: list[str] = json.loads(done.stdout)
    return seen


def _healthy(inventory: Inventory) -> list[Gpu]:
    gpus = [g for g in inventory.gpus if g.healthy and not g.mig_enabled]
    if not gpus:
        pytest.skip("no healthy whole GPU to give a member on this machine")
    return gpus


def _plan(launcher: str, uuids: tuple[str, ...]) -> tuple[ProcessSpec, ...]:
    """The local processes of a one-member attempt on ``uuids``, as the Node plans them."""
    return plan_processes(
        launcher=launcher,
        entrypoint=("true",),
        member_index=0,
        member_count=1,
        gpu_uuids=uuids,
        master_addr="127.0.0.1",
        master_port=29500,
        base_env={},
        cwd=Path("/"),
    )


def test_a_rank_sees_exactly_its_own_gpu() -> None:
    uuids = tuple(g.uuid for g in _healthy(_inventory()))
    specs = _plan("process-group", uuids)
    seen = {spec.local_rank: _cuda_sees(spec.env["CUDA_VISIBLE_DEVICES"]) for spec in specs}
    _report("cuda_per_rank", seen)
    assert seen == {rank: [uuid] for rank, uuid in enumerate(uuids)}


def test_a_member_launcher_sees_all_its_gpus_in_order() -> None:
    uuids = tuple(g.uuid for g in _healthy(_inventory()))
    (spec,) = _plan("member", uuids)
    assert _cuda_sees(spec.env["CUDA_VISIBLE_DEVICES"]) == list(uuids)
