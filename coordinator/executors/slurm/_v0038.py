"""slurmrestd's OpenAPI ``v0.0.38`` (Slurm 22.05): the only module that knows its paths and JSON.

Rules: a request is one HTTP call (a partition's nodes: two); answers are read into the
version-free values of :mod:`._values` here and nowhere else. Slurm error 2017 (invalid job id)
is :class:`SlurmJobNotFound`; any other error Slurm reports is :class:`SlurmRefused` with its
words. A job read with a refused token answers "Unable to find JobId" as error -1, never 2017, so
it is never taken for a missing job (which would invite a second submission). In this version
``exit_code`` is a wait(2) status (exit 3 reads 768).
"""

from __future__ import annotations

from typing import Any

from ._errors import SlurmJobNotFound, SlurmProtocolError, SlurmRefused, SlurmUnreachable
from ._gres import gpu_count
from ._http import RestTransport, describe, error_number, slurm_errors
from ._states import exit_status, job_state
from ._values import JobRequest, SlurmJob, SlurmNode, jobs_named

VERSION = "v0.0.38"
_BASE = f"/slurm/{VERSION}"
#: slurmctld's ESLURM_INVALID_JOB_ID.
INVALID_JOB_ID = 2017
#: What slurmrestd reports when slurmctld failed a call for a reason it does not pass on.
UNSPECIFIED = -1
#: Job states after which slurmctld's ``exit_code`` is the job's end (ended, in TunePlane's words).
_ENDED = frozenset({"succeeded", "failed", "cancelled"})


def _job(entry: dict[str, Any]) -> SlurmJob:
    try:
        state = str(entry["job_state"])
        ended = job_state(state) in _ENDED
        return SlurmJob(
            job_id=int(entry["job_id"]),
            name=str(entry.get("name") or ""),
            slurm_state=state,
            reason=str(entry.get("state_reason") or ""),
            exit=exit_status(int(entry["exit_code"])) if ended else None,
            nodes=str(entry.get("nodes") or ""),
            restarts=int(entry.get("restart_cnt") or 0),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise SlurmProtocolError(
            f"slurmrestd {VERSION} reported a job this client cannot read ({error!r})."
        ) from None


def _node(entry: dict[str, Any]) -> SlurmNode:
    try:
        return SlurmNode(
            name=str(entry["name"]),
            state=str(entry.get("state") or ""),
            partitions=tuple(str(p) for p in entry.get("partitions") or ()),
            cpus=int(entry.get("cpus") or 0),
            gpus=gpu_count(entry.get("gres")),
            gpus_used=gpu_count(entry.get("gres_used")),
            gres=str(entry.get("gres") or ""),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise SlurmProtocolError(
            f"slurmrestd {VERSION} reported a node this client cannot read ({error!r})."
        ) from None


def submit_body(request: JobRequest) -> dict[str, Any]:
    """The JSON of ``POST /job/submit`` for ``request``: one task per node, the script as the
    batch step, an environment that is exactly ``request.environment``."""
    job: dict[str, Any] = {
        "name": request.name,
        "partition": request.partition,
        "nodes": request.nodes,
        "tasks_per_node": 1,
        "current_working_directory": request.working_directory,
        "environment": dict(request.environment),
        "standard_output": request.standard_output,
    }
    if request.standard_error is not None:
        job["standard_error"] = request.standard_error
    if request.gpus_per_node:
        # A count, or TYPE:COUNT: "gpu:2" would ask for two GPUs of a GRES *type* named "gpu".
        count = str(request.gpus_per_node)
        job["gpus_per_node"] = f"{request.gpu_type}:{count}" if request.gpu_type else count
    if request.constraint:
        job["constraints"] = request.constraint
    if request.time_limit_minutes is not None:
        job["time_limit"] = request.time_limit_minutes
    return {"job": job, "script": request.script}


class RestV0038:
    """:class:`~._protocol.SlurmRest` over slurmrestd's ``v0.0.38``."""

    version = VERSION

    def __init__(self, transport: RestTransport) -> None:
        self._transport = transport

    async def _call(
        self, method: str, path: str, what: str, *, json: Any = None,
        params: dict[str, str] | None = None, job_id: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        status, body = await self._transport.request(method, _BASE + path, json=json, params=params)
        errors = slurm_errors(body)
        if job_id is not None and any(error_number(e) == INVALID_JOB_ID for e in errors):
            raise SlurmJobNotFound(
                f"Slurm does not know job {job_id}: it was never submitted, or slurmctld purged "
                "it after it ended (MinJobAge).",
                job_id,
            )
        if errors or status >= 400:
            hint = ""
            if any(error_number(e) == UNSPECIFIED for e in errors):
                # slurmctld refusing the JWT (expired, signed with another key) reaches us only
                # as error -1, "Unspecified error", with a description of the call that failed.
                hint = (
                    " (slurmrestd reports a token slurmctld refused, expired or signed with "
                    "another key, this way too; make a new one with `scontrol token`)"
                )
            raise SlurmRefused(
                f"Slurm refused to {what} (status {status}): {describe(errors)}{hint}."
            )
        return body

    async def ping(self) -> None:
        body = await self._call("GET", "/ping", "answer a ping")
        pings = body.get("pings") or []
        if not any(isinstance(p, dict) and p.get("ping") == "UP" for p in pings):
            raise SlurmUnreachable(
                f"slurmrestd at {self._transport.url} answers, but reports no slurmctld up "
                f"({pings!r}); start slurmctld or check its SlurmctldHost."
            )

    async def submit(self, request: JobRequest) -> int:
        body = await self._call(
            "POST", "/job/submit", f"submit the job {request.name!r}", json=submit_body(request)
        )
        job_id = body.get("job_id")
        if not isinstance(job_id, int):
            raise SlurmProtocolError(
                f"slurmrestd {VERSION} accepted the job {request.name!r} but named no job id."
            )
        return job_id

    async def job(self, job_id: int) -> SlurmJob:
        body = await self._call("GET", f"/job/{job_id}", f"report job {job_id}", job_id=job_id)
        jobs = [_job(e) for e in body.get("jobs") or () if isinstance(e, dict)]
        found = [j for j in jobs if j.job_id == job_id]
        if not found:
            raise SlurmJobNotFound(f"Slurm reported no job {job_id}.", job_id)
        return found[0]

    async def jobs(self) -> list[SlurmJob]:
        body = await self._call("GET", "/jobs", "list its jobs")
        return [_job(e) for e in body.get("jobs") or () if isinstance(e, dict)]

    async def jobs_named(self, name: str) -> list[SlurmJob]:
        return jobs_named(await self.jobs(), name)

    async def cancel(self, job_id: int) -> None:
        # No signal parameter: slurmrestd's default (SIGKILL) is Slurm's cancel, which sends
        # SIGTERM, waits KillWait and then SIGKILLs. Any other signal only signals the job.
        await self._call("DELETE", f"/job/{job_id}", f"cancel job {job_id}", job_id=job_id)

    async def signal(self, job_id: int, signal: int) -> None:
        await self._call(
            "DELETE", f"/job/{job_id}", f"signal job {job_id}", params={"signal": str(signal)},
            job_id=job_id,
        )  # fmt: skip

    async def partition_nodes(self, partition: str) -> list[SlurmNode]:
        await self._call("GET", f"/partition/{partition}", f"report partition {partition!r}")
        body = await self._call("GET", "/nodes", "list its nodes")
        nodes = [_node(e) for e in body.get("nodes") or () if isinstance(e, dict)]
        return sorted((n for n in nodes if partition in n.partitions), key=lambda n: n.name)

    async def aclose(self) -> None:
        await self._transport.aclose()
