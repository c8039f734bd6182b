"""Previews and admission: an immutable preview stored, then committed as a Job once per
retry key.

Rules:
- Repeating a confirmation returns the same receipt; a different digest, another user's
  preview or another user's retry key is refused and names no Job.
- The UNIQUE constraint on ``jobs.retry_key`` decides between two processes admitting the same
  key at once: the loser answers with the winner's receipt.
"""

from __future__ import annotations

import json

import attrs

from .. import lifecycle as lc
from ..values.jobs import Preview, Receipt
from .base import Conflict, NotFound, StoreBase
from .handle import Handle, IntegrityViolation


class Admission(StoreBase):
    """Previews and their admission as Jobs."""

    async def save_preview(self, preview: Preview) -> None:
        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "INSERT INTO previews (id, digest, resolved_json, summary_json, owner, "
                    "created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        preview.preview_id,
                        preview.digest,
                        preview.resolved_jobspec_json,
                        json.dumps(attrs.asdict(preview.summary), sort_keys=True),
                        preview.owner,
                        preview.created_at_ms,
                    ),
                )

        await self.shielded(work)

    async def commit(
        self, preview_id: str, digest: str, retry_key: str, owner: str, run_id: str, now: int
    ) -> Receipt:
        """Admit a preview as a Job, once per retry key (the UNIQUE constraint decides)."""

        async def work() -> Receipt:
            async with self.transaction() as db:
                earlier = await self._receipt_for_key(db, retry_key, owner)
                if earlier is not None:
                    if (earlier.preview_id, earlier.digest) != (preview_id, digest):
                        raise Conflict(
                            f"the retry key {retry_key!r} already confirmed preview "
                            f"{earlier.preview_id} (Job {earlier.run_id}); this confirmation "
                            "names a different preview or digest. Use a new retry key."
                        )
                    return earlier
                rows = list(
                    await db.execute_fetchall(
                        "SELECT digest, resolved_json, summary_json FROM previews "
                        "WHERE id = ? AND owner = ?",
                        (preview_id, owner),
                    )
                )
                # Another user's preview reads as absent: a preview is its author's intent,
                # and committing it would run their code (and show its output) as the caller.
                if not rows:
                    raise NotFound(
                        f"there is no preview {preview_id!r}. Run `tp submit --preview` again."
                    )
                stored_digest, resolved_json, summary_json = rows[0]
                if stored_digest != digest:
                    raise Conflict(
                        f"the digest {digest!r} does not match preview {preview_id} "
                        f"({stored_digest}): the intent changed since it was previewed. "
                        "Run `tp submit --preview` again and confirm the new preview."
                    )
                spec = json.loads(resolved_json)
                # A stored JobSpec without a runtime_id (an older Preview) is recorded with none.
                summary = json.loads(summary_json)
                res = spec["resources"]
                await db.execute(
                    "INSERT INTO jobs (run_id, preview_id, digest, retry_key, owner, project, "
                    "experiment, method_id, profile, fleet, series, gpus, members_wanted, "
                    "gpus_per_member, init_from, state, state_reason, created_at_ms, "
                    "updated_at_ms, runtime_id) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        run_id,
                        preview_id,
                        digest,
                        retry_key,
                        owner,
                        spec["project"],
                        spec["experiment"],
                        spec["method_id"],
                        res["profile"],
                        summary["fleet"],
                        res["series"],
                        res["gpus"],
                        res.get("members"),
                        res.get("gpus_per_member"),
                        spec.get("init_from"),
                        lc.QUEUED,
                        "admitted; waiting for free GPUs",
                        now,
                        now,
                        spec.get("runtime_id", ""),
                    ),
                )
                await db.execute(
                    "INSERT INTO job_states (run_id, state, reason, at_ms) VALUES (?, ?, ?, ?)",
                    (run_id, lc.QUEUED, "admitted; waiting for free GPUs", now),
                )
                detail = {
                    "preview_id": preview_id,
                    "digest": digest,
                    "owner": owner,
                    "runtime_id": spec.get("runtime_id", ""),
                }
                if summary.get("image_tag"):
                    # The image is pinned by digest; the tag it was resolved from at Preview.
                    detail["image_tag"] = summary["image_tag"]
                await self.log_decision(db, now, "admission", detail, run_id=run_id)
                return Receipt(
                    run_id,
                    preview_id,
                    digest,
                    retry_key,
                    now,
                    True,
                    str(summary.get("backend", "")),
                )

        try:
            return await self.shielded(work)
        except IntegrityViolation:
            # Another process admitted the same retry key between our read and our insert: the
            # UNIQUE constraint refused ours, so the earlier receipt is the answer.
            async with self.transaction() as db:
                earlier = await self._receipt_for_key(db, retry_key, owner)
            if earlier is None:
                raise
            return earlier

    async def _receipt_for_key(self, db: Handle, retry_key: str, owner: str) -> Receipt | None:
        """The receipt this owner already got for ``retry_key``; None when the key is unused.

        Another user's key is a Conflict that names no Job: answering with their receipt would
        hand a guesser someone else's run id.
        """
        rows = list(
            await db.execute_fetchall(
                "SELECT run_id, preview_id, digest, created_at_ms, owner FROM jobs "
                "WHERE retry_key = ?",
                (retry_key,),
            )
        )
        if not rows:
            return None
        r = rows[0]
        if r[4] != owner:
            raise Conflict(
                f"the retry key {retry_key!r} is already in use. Confirm with a new retry key."
            )
        return Receipt(str(r[0]), str(r[1]), str(r[2]), retry_key, int(r[3]), created=False)
