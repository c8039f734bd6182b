"""The throwaway Slurm cluster's configuration (coordinator/demo/slurm.py starts it): which
machines it has, and the slurm.conf and gres.conf that say so.

Rules: pure text from values (the one exception, :func:`free_port`, asks the kernel for an
unused port). A cluster has one controller and one or more nodes, each a :class:`SlurmHost`;
by default both are this machine at 127.0.0.1. Daemon files that differ per node (slurmd's spool
folder, pid file and log) carry Slurm's ``%n`` (the node's name), so several nodes can share one
folder and one slurm.conf.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import attrs

PARTITION = "tp"
#: A partition on the same nodes whose jobs preempt the default one's (Slurm requeues them):
#: what a site's higher-priority queue does to a TunePlane Job.
URGENT_PARTITION = "tpurgent"
GPUS_PER_NODE = 2
#: Each node's GPUs are the gpu GRES of this type, and it has this node feature.
GPU_TYPE = "h200"
FEATURE = "tpnode"
#: How long slurmctld keeps an ended job (the tests read their ends; the bench wants them gone).
MIN_JOB_AGE_S = 300


@attrs.frozen
class SlurmHost:
    """One machine of the cluster.

    ``name`` is Slurm's name for it (the NodeName of a node, the SlurmctldHost of the
    controller) and the host name its daemons see; ``address`` is where the others reach it;
    ``prefix`` is the argv prefix that runs a command on it (empty: this machine itself, as it
    is). A host with a prefix is a machine of its own (a network namespace, say): its daemons
    also get a UTS namespace whose host name is ``name``, as on a real node.
    """

    name: str
    address: str
    prefix: tuple[str, ...] = ()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def slurm_conf(
    root: Path, controller: SlurmHost, nodes: Sequence[SlurmHost], cpus: int, memory_mb: int,
    rest: bool = True, min_job_age_s: int = MIN_JOB_AGE_S, max_job_count: int = 0,
) -> str:  # fmt: skip
    """The cluster's slurm.conf: ``nodes`` (each with ``cpus`` CPUs, ``memory_mb`` of memory
    and :data:`GPUS_PER_NODE` GPUs) in one default partition (and an urgent one whose jobs
    preempt it, Slurm requeueing the preempted), JWT as the alternative
    authentication (for slurmrestd, when ``rest``), no cgroups and no accounting (as root on a
    plain machine). ``max_job_count`` 0 keeps Slurm's default (10,000 jobs)."""
    jwt = [
        "AuthAltTypes=auth/jwt",
        f"AuthAltParameters=jwt_key={root / 'jwt.key'}",
    ]
    node_lines = [
        f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} RealMemory={memory_mb} "
        f"Gres=gpu:{GPU_TYPE}:{GPUS_PER_NODE} Features={FEATURE} State=UNKNOWN"
        for node in nodes
    ]
    names = ",".join(node.name for node in nodes)
    return "\n".join(
        [
            "ClusterName=tptest",
            f"SlurmctldHost={controller.name}({controller.address})",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.socket'}",
            *(jwt if rest else []),
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "GresTypes=gpu",
            "MpiDefault=none",
            "ReturnToService=2",
            # Finished jobs stay in slurmctld's table long enough for a test to read their end.
            f"MinJobAge={min_job_age_s}",
            *([f"MaxJobCount={max_job_count}"] if max_job_count else []),
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={spool_dir(root, '%n')}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={slurmd_log(root, '%n')}",
            f"PlugStackConfig={root / 'plugstack.conf'}",
            *node_lines,
            # A job of the urgent partition preempts one of the default partition, which Slurm
            # requeues (a batch job may be requeued: JobRequeue's default).
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP "
            "PriorityTier=1",
            f"PartitionName={URGENT_PARTITION} Nodes={names} MaxTime=INFINITE State=UP "
            "PriorityTier=2 PreemptMode=OFF",
            "",
        ]
    )


def spool_dir(root: Path, node: str) -> Path:
    return root / "spool" / node


def slurmd_log(root: Path, node: str) -> Path:
    return root / f"slurmd-{node}.log"


def gres_conf(nodes: Sequence[SlurmHost], device_dir: Path) -> str:
    """gres.conf: every node's GPUs, whose ``File=`` are the (empty) files ``gpu0``... under
    ``device_dir`` (Slurm drops a GPU without a File; nothing opens them under task/none)."""
    files = f"{device_dir}/gpu[0-{GPUS_PER_NODE - 1}]"
    return "".join(
        f"NodeName={node.name} Name=gpu Type={GPU_TYPE} File={files}\n" for node in nodes
    )
