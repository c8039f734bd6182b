"""The bubblewrap command a sandboxed member runs under (``isolation = "bwrap"``; pure: no I/O).

Rules: the host is read-only, ``/tmp`` and ``/dev/shm`` are private, ``/dev`` is fresh with only
the member's own GPU device nodes, the state directory and the work and output roots are hidden
behind empty tmpfs mounts, and only the member's own work and output directories are bound
writable. No ``--die-with-parent`` (the member outlives nothing but its runner, which outlives
the agent) and no ``--new-session``: the runner's session already has no terminal, and a new
session would put the workload out of reach of the runner's process-group signals.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from .inventory import Gpu

BWRAP = "/usr/bin/bwrap"
# Restores SIGTERM's default action inside the sandbox; the runner starts bubblewrap with it
# ignored so that a stop reaches the workload and bubblewrap waits for it (the grace period).
RESET_SIGTERM = ("/usr/bin/env", "--default-signal=TERM")
# Device nodes every CUDA process needs besides its own /dev/nvidia<N>.
SHARED_GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def gpu_devices(gpus: Sequence[Gpu], present: Collection[str]) -> tuple[str, ...]:
    """The device nodes of the member's GPUs that exist on this host (``present``).

    A GPU's node is ``/dev/nvidia<N>`` with N its minor number as NVML reports it: the driver
    numbers device nodes in its own order, which is not always NVML's index order. A GPU whose
    minor number is unknown (a simulated GPU) falls back to its index. The shared control nodes
    come with any GPU.
    """
    own = [
        f"/dev/nvidia{gpu.index if gpu.minor_number is None else gpu.minor_number}" for gpu in gpus
    ]
    shared = list(SHARED_GPU_DEVICES) if gpus else []
    return tuple(path for path in own + shared if path in present)


def bwrap_argv(
    *,
    state_dir: Path,
    work_root: Path,
    out_root: Path,
    work_dir: Path,
    out_dir: Path,
    devices: tuple[str, ...],
) -> tuple[str, ...]:
    """The argv prefix that runs a command in the member's sandbox (``--`` and the reset last)."""
    argv = [
        BWRAP,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--tmpfs", "/dev/shm",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--unshare-pid",
        "--unshare-ipc",
    ]  # fmt: skip
    for device in devices:
        argv += ["--dev-bind", device, device]
    hidden = sorted({str(state_dir), str(work_root), str(out_root)}, key=len)
    for path in hidden:
        argv += ["--tmpfs", path]
    for folder in (work_dir, out_dir):
        argv += ["--bind", str(folder), str(folder)]
    argv += ["--chdir", str(work_dir), "--", *RESET_SIGTERM]
    return tuple(argv)
