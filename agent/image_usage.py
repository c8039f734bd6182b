"""Which cached runtime images this Node's live members use, as the journal and their JobSpecs say.

Rules:
- A member uses an image when it is in any live state (``LIVE_STATES``: preparing through
  cancelling; never one that ended) and the JobSpec its Prepare wrote
  (``<member_dir>/jobspec.json``) names an ``image:`` runtime; the image is its pinned digest's
  hex, the cache's own key.
- A live member whose JobSpec cannot be read yet (a Prepare before it wrote the file) is
  *unknown*: it may use any image, so nothing that removes images may run while one exists.
- The journal is only read (``journal_read``, read-only); nothing here writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from tuneplane.proto.contract import jobspec

from . import journal_read
from .image_ref import PREFIX, ImageRefError, parse_image_ref
from .journal_records import MemberKey, MemberRecord
from .member_state import LIVE_STATES
from .prepare import JOBSPEC_FILE


@attrs.frozen
class ImageUsage:
    """Live members by the image hex they use, and the live members whose runtime is unknown."""

    by_image: Mapping[str, tuple[MemberKey, ...]] = attrs.field(factory=dict)
    unknown: tuple[MemberKey, ...] = ()

    def users(self, digest_hex: str) -> tuple[MemberKey, ...]:
        return self.by_image.get(digest_hex, ())

    def unknown_sentence(self) -> str:
        """Why no image may be removed now (only when :attr:`unknown` is not empty)."""
        names = ", ".join(str(k) for k in self.unknown[:3])
        more = f" and {len(self.unknown) - 3} more" if len(self.unknown) > 3 else ""
        return (
            f"Member {names}{more} is live but its runtime is not on disk yet (its Prepare has "
            "not written its JobSpec), so it may need any cached image; run the command again "
            "once it is prepared."
        )


def runtime_image_hex(member_dir: Path) -> str | None:
    """The image hex the member's JobSpec pins; ``""`` for a host runtime; None when unreadable."""
    try:
        text = (member_dir / JOBSPEC_FILE).read_text()
        spec = jobspec.loads(text)
    except (OSError, UnicodeDecodeError, jobspec.JobSpecError):
        return None
    if not spec.runtime_id.startswith(PREFIX):
        return ""
    try:
        return parse_image_ref(spec.runtime_id).digest_hex
    except ImageRefError:
        return None


def usage_of(records: Iterable[MemberRecord]) -> ImageUsage:
    """The images the live ones among ``records`` use (reads each live member's JobSpec)."""
    by_image: dict[str, list[MemberKey]] = {}
    unknown: list[MemberKey] = []
    for record in records:
        if record.state not in LIVE_STATES:
            continue
        found = runtime_image_hex(Path(record.member_dir))
        if found is None:
            unknown.append(record.key)
        elif found:
            by_image.setdefault(found, []).append(record.key)
    return ImageUsage({h: tuple(keys) for h, keys in by_image.items()}, tuple(unknown))


def read_usage(journal_path: Path) -> ImageUsage:
    """:func:`usage_of` the members of the journal at ``journal_path`` (read-only). A Node with
    no journal yet has no members; a journal that cannot be read raises
    :class:`~tuneplane.agent.journal_read.JournalUnreadable` (never "nothing is in use")."""
    if not journal_path.exists():
        return ImageUsage()
    with journal_read.open_readonly(journal_path) as db:
        records = journal_read.members(db)
    return usage_of(records)
