"""The bench figures held against real Slurm (issue 13): what each side runs, the goals, the lines
printed.

Rules: runs alternate, ours then Slurm's, run by run, so a machine that slows down during the
bench slows both sides alike. A latency's ratio is ours / Slurm's over medians (lower is better);
a rate's is ours / Slurm's too (higher is better); each is printed beside its goal. Launch: the
bench's submit -> every process exited against ``srun -n1 true`` (1 process) and
``srun -n32 --overcommit true`` (32 processes). Admissions: Preview + Commit per second against
``sbatch --hold --wrap true`` per second, one client (a loop) and 8 in flight, first from an empty
queue, then with at least 1,000 and at least 10,000 queued. Neither side's submitted jobs run (ours
go to a Fleet with no Nodes, Slurm's are held) and both keep every one queued, so the two queues
are always the same length. Beside them, the ceiling our gRPC stack puts on the ratio: two
do-nothing unary calls over loopback TLS per second (what Preview + Commit would cost if their
handlers did nothing) against the same sbatch figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ._slurm import SlurmCluster

# Ours / Slurm's, at most, by processes launched.
LAUNCH_GOALS = {1: 2.0, 32: 1.5}
# Ours / Slurm's, at least, admissions per second.
ADMISSION_GOAL = 2.0
QUEUED = (1000, 10000)


def srun_label(processes: int) -> str:
    return f"srun -n{processes}{' --overcommit' if processes > 1 else ''} true"


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.0f} ms   max {max(values) * 1000:7.0f} ms"


def launch_lines(processes: int, ours: list[float], slurm: list[float]) -> list[str]:
    """Slurm's launch figure beside ours (submit -> all exited) and the ratio."""
    ratio = statistics.median(ours) / statistics.median(slurm)
    goal = LAUNCH_GOALS[processes]
    return [
        f"  {'Slurm: ' + srun_label(processes):<40} {_ms(slurm)}   ({len(slurm)} runs)",
        f"  ratio ours / Slurm (all exited, medians) {ratio:.2f}   goal <= {goal:g}: "
        + ("met" if ratio <= goal else "NOT met"),
    ]


def _rates(values: list[float]) -> str:
    runs = ", ".join(f"{v:.0f}" for v in values)
    return f"median {statistics.median(values):6.0f}/s (runs: {runs})"


def compare_admissions(
    slurm: SlurmCluster,
    ours: Callable[[int, int], float],
    count: int,
    floor: Callable[[int, int], float] | None = None,
    runs: int = 3,
) -> None:
    """Print admissions per second, ours (``ours(count, in_flight)``: ``count`` admissions
    after one unmeasured one, all left queued) against Slurm's sbatch, alternating run by run;
    with ``floor`` (pairs of do-nothing calls per second, the same arguments), the highest ratio
    our RPC stack allows, from an empty queue."""
    queued = 0
    try:
        for at_least in (0, *QUEUED):
            if queued < at_least:
                ours(at_least - queued - 1, 8)
                slurm.queue_held(at_least - queued)
                queued = at_least
            for in_flight in (1, 8):
                print(f"  {in_flight} in flight, {queued} queued on each side at the start:")
                mine, theirs = [], []
                for _ in range(runs):
                    mine.append(ours(count, in_flight))
                    theirs.append(slurm.sbatch_rate(count, in_flight))
                    queued += count + 1
                ratio = statistics.median(mine) / statistics.median(theirs)
                print(f"    ours (Preview+Commit over TLS)   {_rates(mine)}")
                print(f"    Slurm (sbatch --hold --wrap true) {_rates(theirs)}")
                if floor is not None and at_least == 0:
                    pairs = [floor(count, in_flight) for _ in range(runs)]
                    ceiling = statistics.median(pairs) / statistics.median(theirs)
                    print(f"    2 do-nothing calls over TLS       {_rates(pairs)}")
                    print(f"    ceiling of the ratio (do-nothing pairs / Slurm) {ceiling:.2f}")
                print(
                    f"    ratio ours / Slurm {ratio:.2f}   goal >= {ADMISSION_GOAL:g}: "
                    + ("met" if ratio >= ADMISSION_GOAL else "NOT met")
                )
    finally:
        slurm.cancel_held()
