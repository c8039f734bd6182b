"""A member's runtime image at Prepare: the pull with its progress told as it goes, an Abort
that cancels it, and a pull cut short by a restart finished afterwards.

Rules:
- A pull runs in a task of the daemon's nursery (agent/members_prepare.py starts it and answers
  the Prepare when it ends); its progress is journaled and sent to the coordinator at a bounded
  rate (agent/image_progress.py), never once per chunk.
- An Abort cancels the pull and waits for its task to end, so the Abort's journal write comes
  after anything the task wrote.
- After a restart the member whose pull was cut short is refused (as every cut-short Prepare is),
  and the pull is finished in the background, so the cache holds the image when the Job is
  retried.
"""

from __future__ import annotations

import logging

import trio

from . import messages as m
from .image_cache import PullProgress, ReadyImage
from .image_errors import ImageError
from .image_progress import ProgressPace
from .image_ref import ImageRef, ImageRefError, parse_image_ref
from .journal_records import (
    IMAGE_PULL_CANCELLED,
    IMAGE_PULL_FAILED,
    IMAGE_PULL_PROGRESS,
    IMAGE_PULL_STARTED,
    IMAGE_READY,
    MemberKey,
    MemberRecord,
)
from .members_base import MemberBase, now_ms

log = logging.getLogger(__name__)


class MemberPulls(MemberBase):
    """The image pulls of members being prepared (one task each, in :attr:`preparations`)."""

    async def stop_preparation(self, key: MemberKey) -> None:
        """Cancel the member's image pull, if one runs, and wait until its task has ended, so
        the caller's journal write comes after anything the task wrote (an Abort's does)."""
        preparation = self.preparations.get(key)
        if preparation is not None:
            preparation.scope.cancel()
            await preparation.done.wait()

    async def _pull(self, key: MemberKey, ref: ImageRef) -> ReadyImage:
        """``images.ensure(ref)``, its progress journaled and sent to the coordinator at a
        bounded rate (agent/image_progress.py) while it runs."""
        told = ProgressPace()
        latest: list[PullProgress] = []
        moved = trio.Event()
        found: list[ReadyImage] = []

        def on_progress(progress: PullProgress) -> None:
            nonlocal moved
            latest.append(progress)
            del latest[:-1]
            moved.set()

        async def pull(nursery: trio.Nursery) -> None:
            found.append(await self.images.ensure(ref, on_progress))
            nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull, nursery)
                while not found:
                    await moved.wait()
                    moved = trio.Event()
                    progress = latest[-1]
                    if progress.phase == "ready" or not told.due(progress, trio.current_time()):
                        continue
                    await self.journal.member_event(
                        key, now_ms(), IMAGE_PULL_PROGRESS, image=str(ref),
                        bytes_done=progress.bytes_done, bytes_total=progress.bytes_total,
                        layers_done=progress.layers_done, layers_total=progress.layers_total,
                        phase=progress.phase,
                    )  # fmt: skip
                    await self.publish(
                        m.PrepareProgress(
                            key, str(ref), progress.bytes_done, progress.bytes_total,
                            progress.layers_done, progress.layers_total, progress.phase,
                        )
                    )  # fmt: skip
        except BaseExceptionGroup as group:
            # The pull's ImageError is the answer; anything else goes on as it is.
            errors = group.subgroup(lambda e: isinstance(e, ImageError))
            if errors is not None and errors.split(ImageError)[1] is None:
                leaf: BaseException = errors
                while isinstance(leaf, BaseExceptionGroup):
                    leaf = leaf.exceptions[0]
                raise leaf from None
            raise
        # Only the pull ends the nursery without an error, once the image is ready; an Abort
        # that cancelled it meanwhile surfaces at this checkpoint.
        await trio.lowlevel.checkpoint()
        assert found, "the pull ends the nursery only once the image is ready"
        return found[0]

    async def resume_pull(self, record: MemberRecord) -> None:
        """After a restart, finish in the background the image pull a member that was cut
        short was waiting for (the member itself is refused, as every cut-short Prepare is), so
        the cache holds the image when the Job is retried. Owned by the daemon's nursery."""
        ref = await self._interrupted_pull(record.key)
        if ref is None:
            return
        log.info("image pull resumed after restart member=%s image=%s", record.key, ref)

        async def finish() -> None:
            try:
                image = await self.images.ensure(ref)
            except ImageError as exc:
                log.warning("image pull after restart failed image=%s reason=%s", ref, exc)
                return
            await self.journal.member_event(
                record.key, now_ms(), IMAGE_READY, "pulled again after the agent restarted; "
                "no member waits for it", image=str(ref), bytes=image.bytes, layers=image.layers,
            )  # fmt: skip

        self.nursery.start_soon(finish)

    async def _interrupted_pull(self, key: MemberKey) -> ImageRef | None:
        """The image whose pull the member's journal shows started and never ended, or None."""
        pulling: str | None = None
        for event in await self.journal.events(key):
            if event["kind"] == IMAGE_PULL_STARTED:
                pulling = str(event["details"].get("image", ""))
            elif event["kind"] in (IMAGE_READY, IMAGE_PULL_FAILED, IMAGE_PULL_CANCELLED):
                pulling = None
        if not pulling:
            return None
        try:
            return parse_image_ref(pulling)
        except ImageRefError:
            return None
