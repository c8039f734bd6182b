"""The bubblewrap command a sandboxed member runs under (``isolation = "bwrap"``; pure: no I/O).

Rules: the host is read-only, ``/tmp`` and ``/dev/shm`` are private, ``/dev`` is fresh with only
the member's own GPU device nodes, the state directory and the work and output roots are hidden
behind empty tmpfs mounts, and only the member's own work and output directories are bound
writable. No ``--die-with-parent`` (the member outlives nothing but its runner, which outlives
the agent) and no ``--new-session``: the runner's session already has no terminal, and a new
session would put the workload out of reach of the runner's process-group signals.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

BWRAP = "/usr/bin/bwrap"
# Restores SIGTERM's default action inside the sandbox; the runner starts bubblewrap with it
# ignored so that a stop reaches the workload and bubblewrap waits for it (the grace period).
RESET_SIGTERM = ("/usr/bin/env", "--default-signal=TERM")
# Device nodes every CUDA process needs besides its own /dev/nvidia<N>.
SHARED_GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def gpu_devices(gpu_indexes: tuple[int, ...], present: Collection[str]) -> tuple[str, ...]:
    """The device nodes of the member's GPUs that exist on this host (``present``).

    ``/dev/nvidia<N>`` is taken to be GPU index N (the driver numbers minors in PCI order, as
    NVML numbers indexes); the shared control nodes come with any GPU.
    """
    own = [f"/dev/nvidia{i}" for i in gpu_indexes]
    shared = list(SHARED_GPU_DEVICES) if gpu_indexes else []
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
