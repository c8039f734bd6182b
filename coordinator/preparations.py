"""The image preparations Nodes report for their preparing members (PrepareProgress), kept in
memory for ``GetJob`` to show with each member.

Rules: a live view, never stored: a coordinator that restarts (or takes over) shows none until
the Node's next report, and the Node's journal keeps the durable record. A Node's report counts
only for a member the Job places on that Node and only while the member is ``preparing``; the
book holds at most :data:`MAX_ENTRIES` members and forgets the oldest report first.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from .values.jobs import ImagePreparation, Job, MemberKey

#: The most preparing members remembered at once (a report is about 200 bytes).
MAX_ENTRIES = 10_000
PREPARING = "preparing"


class PreparationBook:
    """The latest image preparation each Node reported, by member."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max = max_entries
        self._latest: OrderedDict[MemberKey, tuple[str, ImagePreparation]] = OrderedDict()

    def record(self, node_id: str, key: MemberKey, preparation: ImagePreparation) -> None:
        """Remember ``preparation`` as what ``node_id`` says of member ``key`` now."""
        self._latest[key] = (node_id, preparation)
        self._latest.move_to_end(key)
        while len(self._latest) > self._max:
            self._latest.popitem(last=False)

    def shown(self, job: Job) -> Job:
        """``job`` with each preparing member's preparation, as its own Node reported it;
        reports of members that are no longer preparing are forgotten."""
        attempts = []
        for attempt in job.attempts:
            members = []
            for member in attempt.members:
                key = MemberKey(job.run_id, attempt.number, member.index)
                found = self._latest.get(key)
                if found is not None and member.state != PREPARING:
                    del self._latest[key]
                    found = None
                if found is not None and found[0] == member.node_id:
                    member = attrs.evolve(member, preparation=found[1])
                members.append(member)
            attempts.append(attrs.evolve(attempt, members=tuple(members)))
        return attrs.evolve(job, attempts=tuple(attempts))
