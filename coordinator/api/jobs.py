"""The researcher API (``tuneplane.v1.Api``): Preview, Commit, GetJob, ListJobs (WatchJob is
:mod:`.job_watch`).

Rules:
- Every call is authenticated from ``authorization: Bearer <user token>`` before its request is
  read; only user tokens work here (a Node credential is refused).
- Preview stores an immutable preview and creates no Job; Commit is idempotent per retry key and
  the store's UNIQUE constraint, not this process's memory, decides what "the same" means.
- Handlers are registered through ``__mapping__`` so they can read the call's metadata; grpclib
  cancels a handler when the client's deadline passes, and the store finishes or rolls back.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, TypeVar, TypeVarTuple

import attrs
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.proto import v1
from tuneplane.proto.contract import jobspec

from ..admission import Admitted, admit
from ..auth import Principal, bearer_token, hash_credential
from ..capacity import never_fits
from ..catalogue import Catalogue
from ..clock import now_ms
from ..config import CoordinatorConfig
from ..counters import ADMISSIONS
from ..derivation import SourceRun, resolve_source
from ..executors.slurm import series_request
from ..gateways.message_limits import INLINE_DECODE_BYTES, encode_with, pre_encoded
from ..gateways.status import grpc_errors
from ..image_pin import image_runtime, pin, registry_for
from ..job_access import may_read
from ..jobspec import check_loader_policy
from ..offload import PROCESS_TEXT_CHARS, in_process, in_thread
from ..placement import Request
from ..preparations import PreparationBook
from ..store import access as store_access
from ..store import identity as store_identity
from ..store.core import NotFound, Store
from ..store.fleet_views import healthy_gpus_per_node, holder
from ..store.logs import LogStore
from ..values.jobs import JOB_LIST_DEFAULT, JOB_LIST_MAX, Preview
from ..values.users import User
from ..wire.jobs import (
    job_to_wire,
    jobs_to_wire,
    preview_to_wire,
    receipt_to_wire,
)
from .fleet import caller
from .job_view import JobView, read_request

log = logging.getLogger(__name__)

MAX_RETRY_KEY = 200

T = TypeVar("T")
Args = TypeVarTuple("Args")


async def user_principal(store: Store, stream: Any) -> Principal:
    """The user a call's bearer token belongs to, or :class:`AuthError`."""
    token = bearer_token(stream.metadata.items() if stream.metadata else ())
    user = await store_identity.authenticate_user(store, hash_credential(token), now_ms())
    return Principal("user", user.name)


class ApiService:
    """grpclib handlers for ``tuneplane.v1.Api``."""

    def __init__(
        self,
        store: Store,
        config: CoordinatorConfig,
        catalogue: Catalogue,
        on_admitted: Callable[[str, str], None],
        logs: LogStore | None = None,
        preparations: PreparationBook | None = None,
    ) -> None:
        self._store = store
        # What GetJob sends: the stored Job, image pulls in memory, a failure's stderr; WatchJob
        # sends the same, through this one view (coordinator/server/lead.py).
        self.job_view = JobView(store, logs, preparations)
        self._config = config
        self._catalogue = catalogue
        self._on_admitted = on_admitted

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/Preview": Handler(
                self._preview, Cardinality.UNARY_UNARY, v1.PreviewRequest, v1.PreviewReply
            ),
            "/tuneplane.v1.Api/Commit": Handler(
                self._commit, Cardinality.UNARY_UNARY, v1.CommitRequest, v1.Receipt
            ),
            "/tuneplane.v1.Api/GetJob": Handler(
                self._get_job, Cardinality.UNARY_UNARY, v1.GetJobRequest, v1.Job
            ),
            "/tuneplane.v1.Api/ListJobs": Handler(
                self._list_jobs, Cardinality.UNARY_UNARY, v1.ListJobsRequest, v1.ListJobsReply
            ),
        }

    async def _preview(self, stream: Any) -> None:
        with grpc_errors():
            principal = await user_principal(self._store, stream)
            request: v1.PreviewRequest = await stream.recv_message()
            admitted = await self._admit(request.jobspec_json)
            fleets = await self._store.fleet_names()
            s = admitted.summary
            if s.fleet not in fleets:
                raise jobspec.JobSpecError(
                    "resources.profile",
                    admitted.profile,
                    f"places Jobs on the Fleet {s.fleet!r}, which does not exist",
                    "Ask the coordinator's operator to create it or fix the Profile.",
                )
            slurm = await self._store.slurm_settings(s.fleet)
            if slurm is not None and not slurm.shared_dir:
                # Explicit, never a fallback: nothing could run it, so it is refused, not queued.
                raise jobspec.JobSpecError(
                    "resources.profile",
                    admitted.profile,
                    f"places Jobs on the Fleet {s.fleet!r}, of kind slurm, which has no shared "
                    "folder for its attempts",
                    "Ask the coordinator's operator to create the Fleet with --shared-dir.",
                )
            if slurm is not None and series_request(slurm.series, s.series) is None:
                mapped = ", ".join(m.series for m in slurm.series)
                raise jobspec.JobSpecError(
                    "resources.profile",
                    admitted.profile,
                    f"asks for the Series {s.series!r}, which the Fleet {s.fleet!r} (kind slurm) "
                    f"does not map to a Slurm GRES type or node feature (it maps {mapped})",
                    "Use a Profile of a Series it maps, or ask the coordinator's operator to "
                    f"create the Fleet with --series {s.series}=gres:gpu:TYPE.",
                )
            if (
                slurm is not None
                and not slurm.image_root
                and image_runtime(admitted.runtime_id) is not None
            ):
                # A Fleet with no image root has nowhere to cache an image: refused, never run
                # with the node's own interpreter instead.
                raise jobspec.JobSpecError(
                    "runtime_id",
                    admitted.runtime_id,
                    f"names a runtime image, and the Fleet {s.fleet!r} (kind slurm) has no image "
                    "root to cache images in on its nodes",
                    "Submit without --image (a host runtime), or ask the coordinator's operator "
                    "to create the Fleet with --image-root (and --registries-file).",
                )
            admitted = await self._derive(admitted, stream)
            admitted = await self._pin_image(admitted)
            # A Slurm Fleet's GPUs are Slurm's to count: slurmctld refuses a job that never fits.
            refusal = (
                None
                if slurm is not None
                else never_fits(
                    Request(admitted.gpus, admitted.members, admitted.gpus_per_member),
                    s.fleet,
                    s.series,
                    await healthy_gpus_per_node(self._store, s.fleet, s.series),
                    self._config.quotas.get((s.fleet, s.series)),
                )
            )
            if refusal is not None:
                raise refusal
            # The reply leaves without the resolved JobSpec, which is added while encoding:
            # both are proportional to the JobSpec, so a large one is done off the event loop.
            preview = Preview(
                preview_id="pv-" + secrets.token_hex(8),
                digest=admitted.digest,
                resolved_jobspec_json="",
                summary=admitted.summary,
                created_at_ms=now_ms(),
                owner=principal.name,
            )
            reply = preview_to_wire(preview)
            resolved_json, encoded = await self._off_loop(
                len(admitted.resolved_json), _finish_reply, reply, admitted.resolved_json
            )
            preview = attrs.evolve(preview, resolved_jobspec_json=resolved_json)
            await self._store.save_preview(preview)
            log.info(
                "preview stored preview_id=%s digest=%s owner=%s",
                preview.preview_id,
                preview.digest,
                principal.name,
            )
            await stream.send_message(pre_encoded(reply, encoded))

    async def _derive(self, admitted: Admitted, stream: Any) -> Admitted:
        """``admitted`` with its Derivation's source resolved into the JobSpec (so the digest
        covers it), or the JobSpecError on ``init_from`` saying why that run cannot be one."""
        if admitted.init_from is None:
            return admitted
        spec = await self._off_loop(
            len(admitted.resolved_json), jobspec.loads, admitted.resolved_json.decode("utf-8")
        )
        assert spec.init_from is not None
        fleet = admitted.summary.fleet
        settings = self._config.fleets.get(fleet)
        found = await _source_run(self._store, spec.init_from, await caller(self._store, stream))
        source = resolve_source(
            spec.init_from, found, fleet, settings.shared_output_root if settings else ""
        )
        log.info("derivation resolved run_id=%s out_dir=%s manifest_sha256=%s files=%d holder=%s",
                 source.run_id, source.out_dir, source.manifest_sha256, source.files,
                 source.node_id or "-")  # fmt: skip
        canonical = jobspec.canonical_json(attrs.evolve(spec, init_from_source=source)).encode()
        return attrs.evolve(admitted, resolved_json=canonical, digest=jobspec.digest_of(canonical))

    async def _pin_image(self, admitted: Admitted) -> Admitted:
        """``admitted`` with its ``image:`` runtime pinned to the digest its registry serves now
        (a tag resolved, a digest checked to exist) and the digest recomputed over it, or the
        :class:`RuntimeImageRefused` saying why not; a ``host:`` runtime as it is."""
        image = image_runtime(admitted.runtime_id)
        if image is None:
            return admitted
        fleet = admitted.summary.fleet
        settings = registry_for(image, admitted.runtime_id, fleet, self._config.fleets.get(fleet))
        pinned = await pin(image, settings, fleet, admitted.runtime_id)
        log.info("runtime image pinned runtime_id=%s tag=%s media_type=%s fleet=%s",
                 pinned.runtime_id, pinned.tag or "-", pinned.media_type, fleet)  # fmt: skip
        spec = await self._off_loop(
            len(admitted.resolved_json), jobspec.loads, admitted.resolved_json.decode("utf-8")
        )
        spec = attrs.evolve(spec, runtime_id=pinned.runtime_id)
        # The site's runtime policy names the runtime as Jobs run it: pinned.
        check_loader_policy(spec, self._config.loader_env_runtimes)
        canonical = await self._off_loop(
            len(admitted.resolved_json), lambda: jobspec.canonical_json(spec).encode()
        )
        return attrs.evolve(
            admitted,
            resolved_json=canonical,
            digest=jobspec.digest_of(canonical),
            runtime_id=pinned.runtime_id,
            summary=attrs.evolve(admitted.summary, image_tag=pinned.tag),
        )

    async def _admit(self, text: str) -> Admitted:
        """:func:`admit` where it holds the event loop for no more than a few milliseconds: inline
        for a small JobSpec, in a worker thread up to :data:`PROCESS_TEXT_CHARS`, in a worker
        process beyond (reading megabytes of JSON is a few long C calls that a thread would run
        with the interpreter lock held)."""
        if len(text) > PROCESS_TEXT_CHARS:
            return await in_process(admit, text, self._config, self._catalogue)
        return await self._off_loop(len(text), admit, text, self._config, self._catalogue)

    async def _off_loop(self, size: int, func: Callable[[*Args], T], *args: *Args) -> T:
        if size <= INLINE_DECODE_BYTES:
            return func(*args)
        return await in_thread(func, *args)

    async def _commit(self, stream: Any) -> None:
        with grpc_errors():
            principal = await user_principal(self._store, stream)
            request: v1.CommitRequest = await stream.recv_message()
            for field, value in (
                ("preview_id", request.preview_id),
                ("digest", request.digest),
                ("retry_key", request.retry_key),
            ):
                if not value:
                    raise GRPCError(
                        Status.INVALID_ARGUMENT,
                        f"CommitRequest.{field} is empty. Send the {field} from the preview "
                        "(tp does this for you).",
                    )
            if len(request.retry_key) > MAX_RETRY_KEY:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"CommitRequest.retry_key is longer than {MAX_RETRY_KEY} characters. "
                    "Use a shorter key.",
                )
            try:
                receipt = await self._store.commit(
                    request.preview_id,
                    request.digest,
                    request.retry_key,
                    principal.name,
                    "run-" + secrets.token_hex(6),
                    now_ms(),
                )
            except Exception:
                ADMISSIONS.labels("refused").inc()
                raise
            ADMISSIONS.labels("admitted" if receipt.created else "repeated").inc()
            if receipt.created:
                log.info(
                    "job admitted run_id=%s preview_id=%s owner=%s",
                    receipt.run_id,
                    receipt.preview_id,
                    principal.name,
                )
                self._on_admitted(receipt.run_id, receipt.backend)
            await stream.send_message(receipt_to_wire(receipt))

    async def _get_job(self, stream: Any) -> None:
        with grpc_errors():
            request = await read_request(self._store, stream)
            job = await self.job_view.shown(request.run_id)
            await stream.send_message(job_to_wire(job))

    async def _list_jobs(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.ListJobsRequest = await stream.recv_message()
            if request.limit > JOB_LIST_MAX:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"ListJobsRequest.limit is {request.limit}, over the {JOB_LIST_MAX} Jobs one "
                    f"call returns. Ask for at most {JOB_LIST_MAX}, or 0 for the default of "
                    f"{JOB_LIST_DEFAULT}, and narrow the list by project, state or mine.",
                )
            limit = request.limit or JOB_LIST_DEFAULT
            # Only the Jobs this user may read (job_access): another user's never show up.
            jobs = await store_access.readable_jobs(
                self._store, user, request.project, request.state, request.mine, limit
            )
            await stream.send_message(jobs_to_wire(jobs))


async def _source_run(store: Store, run_id: str, user: User) -> SourceRun | None:
    """What the store knows of the run an ``--init-from`` names (None: no such Job); whether
    ``user`` may read it is decided by :func:`.job_access.may_read`, as for ``tp job show``."""
    try:
        access = await store_access.job_access(store, run_id)
    except NotFound:
        return None
    if not may_read(access, user):
        return SourceRun(run_id, "", False, access.owner)
    job = await store.get_job(run_id)
    attempt = job.attempts[-1] if job.attempts else None
    first = next((m for m in attempt.members if m.index == 0), None) if attempt else None
    if attempt is None or first is None:
        return SourceRun(run_id, job.state, True, job.owner)
    return SourceRun(
        run_id, job.state, True, job.owner, attempt.number, first.out_dir,
        first.node_name or first.node_id, first.output_manifest,
        await holder(store, first.node_id) if first.node_id else None,
    )  # fmt: skip


def _finish_reply(reply: v1.PreviewReply, resolved_json: bytes) -> tuple[str, bytes]:
    """The resolved JobSpec as text (to store) and ``reply`` encoded with it (to send): both
    proportional to the JobSpec, so done off the event loop for a large one."""
    encoded = encode_with(reply, "resolved_jobspec_json", resolved_json)
    return resolved_json.decode("utf-8"), encoded
