"""The SlurmRest interface against a real slurmrestd (Slurm 22.05, JWT) on a throwaway cluster:
discovery, the partition's nodes and GPUs, jobs that complete, fail and are cancelled, finding a
job by its name, and what a caller sees when the token is wrong or slurmrestd is gone.

One cluster serves the module (tests/support/slurm.py: one node with 2 GPUs in partition
``tp``); every job gets a name of its own, so tests do not read each other's jobs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from tests.support.slurm import GPUS_PER_NODE, SlurmCluster, slurm_cluster
from tuneplane.coordinator.demo.slurm import URGENT_PARTITION
from tuneplane.coordinator.executors.slurm import (
    ExitStatus,
    JobRequest,
    SlurmAuthRefused,
    SlurmJob,
    SlurmJobNotFound,
    SlurmRefused,
    SlurmRest,
    SlurmUnreachable,
    failure_reason,
    observed_state,
    open_slurm_rest,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

T = TypeVar("T")
JOB_TIMEOUT_S = 60.0
_NAMES = itertools.count()


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as running:
        yield running


def with_rest(cluster: SlurmCluster, work: Callable[[SlurmRest], Awaitable[T]]) -> T:
    """Run ``work`` with a SlurmRest opened on the cluster's slurmrestd (as root's token)."""

    async def main() -> T:
        rest = await open_slurm_rest(cluster.rest_url, cluster.token())
        try:
            return await work(rest)
        finally:
            await rest.aclose()

    return asyncio.run(main())


def attempt_name() -> str:
    """A job name carrying an attempt id, as the Slurm Fleet will name its jobs."""
    return f"tp-run{next(_NAMES)}-a1"


def request(cluster: SlurmCluster, name: str, script: str, **extra: object) -> JobRequest:
    return JobRequest(
        name=name,
        partition=cluster.partition,
        script=f"#!/bin/sh\n{script}\n",
        working_directory=str(cluster.root),
        environment={"PATH": "/usr/bin:/bin", "TP_ATTEMPT": name},
        standard_output=str(cluster.root / f"{name}.out"),
        **extra,  # type: ignore[arg-type]
    )


async def wait_for(rest: SlurmRest, job_id: int, done: Callable[[SlurmJob], bool]) -> SlurmJob:
    """Poll the job until ``done`` holds, failing after JOB_TIMEOUT_S."""
    with anyio.fail_after(JOB_TIMEOUT_S):
        while True:
            job = await rest.job(job_id)
            if done(job):
                return job
            await anyio.sleep(0.1)


def ended(job: SlurmJob) -> bool:
    return job.exit is not None


def test_discovery_speaks_v0_0_38_and_slurmctld_answers(cluster: SlurmCluster) -> None:
    async def work(rest: SlurmRest) -> str:
        await rest.ping()
        return rest.version

    assert with_rest(cluster, work) == "v0.0.38"


def test_the_partition_lists_its_node_and_gpus(cluster: SlurmCluster) -> None:
    nodes = with_rest(cluster, lambda rest: rest.partition_nodes(cluster.partition))
    assert [n.name for n in nodes] == [cluster.host]
    node = nodes[0]
    # Its partitions: the default one and the urgent one whose jobs preempt it.
    assert node.gpus == GPUS_PER_NODE and node.partitions == (cluster.partition, URGENT_PARTITION)
    assert node.state in ("idle", "mixed", "allocated") and node.cpus >= 1


def test_a_partition_that_does_not_exist_is_refused_with_slurms_words(
    cluster: SlurmCluster,
) -> None:
    with pytest.raises(SlurmRefused, match="partition 'nope'") as caught:
        with_rest(cluster, lambda rest: rest.partition_nodes("nope"))
    assert str(caught.value).endswith(".")


def test_a_job_that_exits_0_completes_and_succeeds(cluster: SlurmCluster) -> None:
    name = attempt_name()

    async def work(rest: SlurmRest) -> SlurmJob:
        job_id = await rest.submit(request(cluster, name, 'echo "attempt $TP_ATTEMPT"; /bin/true'))
        return await wait_for(rest, job_id, ended)

    job = with_rest(cluster, work)
    assert (job.name, job.slurm_state, job.exit) == (name, "COMPLETED", ExitStatus(code=0))
    assert observed_state(job) == "succeeded"
    # The script ran with the environment the request gave it, and nothing else named it.
    assert Path(cluster.root / f"{name}.out").read_text() == f"attempt {name}\n"


def test_a_job_that_exits_3_fails_with_its_exit_code(cluster: SlurmCluster) -> None:
    async def work(rest: SlurmRest) -> SlurmJob:
        job_id = await rest.submit(request(cluster, attempt_name(), "exit 3"))
        return await wait_for(rest, job_id, ended)

    job = with_rest(cluster, work)
    assert (job.slurm_state, job.exit) == ("FAILED", ExitStatus(code=3))
    assert observed_state(job) == "failed"
    assert failure_reason(job.slurm_state) == "The Slurm job's script exited with a non-zero code."


def test_a_running_job_cancelled_ends_cancelled_by_sigterm(cluster: SlurmCluster) -> None:
    async def work(rest: SlurmRest) -> tuple[SlurmJob, SlurmJob]:
        job_id = await rest.submit(request(cluster, attempt_name(), "exec sleep 300"))
        running = await wait_for(rest, job_id, lambda j: j.slurm_state == "RUNNING")
        await rest.cancel(job_id)
        return running, await wait_for(rest, job_id, ended)

    running, job = with_rest(cluster, work)
    assert observed_state(running) == "running" and running.nodes == cluster.host
    assert job.slurm_state == "CANCELLED" and observed_state(job) == "cancelled"
    assert job.exit == ExitStatus(code=143, signal=15)


def test_a_running_job_signalled_with_sigterm_is_not_cancelled_but_fails(
    cluster: SlurmCluster,
) -> None:
    name = attempt_name()
    started = cluster.root / f"{name}.started"

    async def work(rest: SlurmRest) -> SlurmJob:
        script = f"touch {started}\nexec sleep 300"
        job_id = await rest.submit(request(cluster, name, script))
        # RUNNING is Slurm's word once the job has its node, before the script runs: a signal
        # sent then meets no process. Signal once the script has started.
        with anyio.fail_after(JOB_TIMEOUT_S):
            while not started.exists():
                await anyio.sleep(0.05)
        await rest.signal(job_id, 15)
        return await wait_for(rest, job_id, ended)

    job = with_rest(cluster, work)
    assert job.slurm_state == "FAILED" and observed_state(job) == "failed"
    assert job.exit == ExitStatus(code=143, signal=15)


def test_a_job_is_found_by_its_name(cluster: SlurmCluster) -> None:
    name, other = attempt_name(), attempt_name()

    async def work(rest: SlurmRest) -> tuple[int, list[SlurmJob], list[SlurmJob]]:
        job_id = await rest.submit(request(cluster, name, "/bin/true"))
        await rest.submit(request(cluster, other, "/bin/true"))
        return job_id, await rest.jobs_named(name), await rest.jobs_named(f"{name}-never")

    job_id, found, none = with_rest(cluster, work)
    assert [(j.job_id, j.name) for j in found] == [(job_id, name)]
    assert none == []


def test_a_gpu_job_runs_and_one_asking_more_gpus_than_a_node_has_is_refused(
    cluster: SlurmCluster,
) -> None:
    async def work(rest: SlurmRest) -> SlurmJob:
        fits = request(cluster, attempt_name(), "/bin/true", gpus_per_node=GPUS_PER_NODE)
        job_id = await rest.submit(fits)
        return await wait_for(rest, job_id, ended)

    assert with_rest(cluster, work).slurm_state == "COMPLETED"
    too_many = request(cluster, attempt_name(), "/bin/true", gpus_per_node=GPUS_PER_NODE + 1)
    with pytest.raises(SlurmRefused, match="submit the job") as caught:
        with_rest(cluster, lambda rest: rest.submit(too_many))
    assert "node configuration" in str(caught.value)


def test_a_job_slurm_does_not_know_is_not_found(cluster: SlurmCluster) -> None:
    with pytest.raises(SlurmJobNotFound, match="does not know job 99999") as caught:
        with_rest(cluster, lambda rest: rest.job(99999))
    assert caught.value.job_id == 99999
    with pytest.raises(SlurmJobNotFound):
        with_rest(cluster, lambda rest: rest.cancel(99999))


def test_a_token_slurmctld_refuses_is_never_taken_for_a_missing_job(
    cluster: SlurmCluster,
) -> None:
    name = attempt_name()
    job_id = with_rest(cluster, lambda rest: rest.submit(request(cluster, name, "/bin/true")))
    good = cluster.token()
    forged = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")

    async def read(token: str) -> SlurmJob:
        rest = await open_slurm_rest(cluster.rest_url, token)
        try:
            return await rest.job(job_id)
        finally:
            await rest.aclose()

    with pytest.raises(SlurmRefused, match="scontrol token") as caught:
        asyncio.run(read(forged))
    assert not isinstance(caught.value, SlurmJobNotFound)
    assert asyncio.run(read(good)).name == name


def test_a_request_without_a_token_is_refused(cluster: SlurmCluster) -> None:
    async def read() -> None:
        rest = await open_slurm_rest(cluster.rest_url, "")
        await rest.aclose()

    with pytest.raises(SlurmAuthRefused, match="not a JWT"):
        asyncio.run(read())


def test_stopped_slurmrestd_is_unreachable_and_reads_unknown_until_restarted(
    cluster: SlurmCluster,
) -> None:
    name = attempt_name()
    job_id = with_rest(cluster, lambda rest: rest.submit(request(cluster, name, "exec sleep 300")))
    token = cluster.token()

    async def read() -> SlurmJob | None:
        rest = await open_slurm_rest(cluster.rest_url, token, timeout_s=5)
        try:
            return await rest.job(job_id)
        finally:
            await rest.aclose()

    async def read_unreachable() -> SlurmJob | None:
        try:
            return await read()
        except SlurmUnreachable:
            return None

    cluster.stop_rest()
    try:
        with pytest.raises(SlurmUnreachable, match="did not answer") as caught:
            asyncio.run(read())
        assert str(caught.value).endswith("listens there.")
        assert observed_state(asyncio.run(read_unreachable())) == "unknown"
    finally:
        cluster.start_rest()
    seen = asyncio.run(read())
    assert seen is not None and seen.name == name and observed_state(seen) in ("queued", "running")
    with_rest(cluster, lambda rest: rest.cancel(job_id))
