"""Applying a Node's MemberReport: judged by the pure
:func:`~tuneplane.coordinator.lifecycle.judge_report`, then carried out in one transaction.

Rules:
- Report numbers decide nothing: a repeat or a late copy is stale by the member's own state.
- A refused report changes nothing but an audit row in ``decisions``, against the reporting
  Node only; an early one changes nothing and is not acknowledged.
"""

from __future__ import annotations

import attrs

from .. import lifecycle as lc
from ..derivation import stored_manifest
from ..values.orders import Report
from .handle import first_row
from .member_states import MemberStates


@attrs.frozen
class ReportOutcome:
    """What :meth:`Store.apply_report` did with one MemberReport.

    ``applied``: the member moved. ``ended``: the member has ended (now or before), so its
    collector credential and failed-sibling handling follow. ``early``: the report overtook the
    ones before it; nothing was changed and it must not be acknowledged (the Node sends it again).
    ``refused``: the sentence sent back to the Node; nothing was changed.
    """

    applied: bool = False
    ended: bool = False
    early: bool = False
    refused: str = ""


class Reports(MemberStates):
    """Member reports from Nodes."""

    async def apply_report(self, node_id: str, report: Report, now: int) -> ReportOutcome:
        """Judge a Node's MemberReport (:func:`lifecycle.judge_report`) and apply what it allows.

        Report numbers decide nothing: a repeat or a late copy is stale by the member's own
        state, so a restarted journal or a forged number can never hide a true report. A refused
        report changes nothing but an audit row in ``decisions``.
        """

        async def work() -> ReportOutcome:
            async with self.transaction() as db:
                key = report.member
                row = await first_row(
                    db,
                    "SELECT m.node_id, m.state, m.known_state, m.out_dir, a.decision, "
                    "m.declared_lost FROM members m JOIN attempts a ON a.run_id = m.run_id "
                    "AND a.number = m.attempt "
                    "WHERE m.run_id = ? AND m.attempt = ? AND m.member_index = ?",
                    (key.run_id, key.attempt, key.member_index),
                )
                facts = lc.ReportFacts(
                    node_id=node_id,
                    member=f"{key.run_id} attempt {key.attempt} member {key.member_index}",
                    run_id=key.run_id,
                    attempt=key.attempt,
                    member_index=key.member_index,
                    reported=report.state,
                    has_exit=report.has_exit,
                    out_dir=report.out_dir,
                    placed_on=None if row is None else str(row[0]),
                    known=lc.M_RESERVED if row is None else str(row[2]),
                    decision=None if row is None or row[4] is None else str(row[4]),
                    recorded_out_dir="" if row is None else str(row[3]),
                    declared_lost="" if row is None else str(row[5]),
                )
                verdict = lc.judge_report(facts)
                if isinstance(verdict, lc.RefuseReport):
                    # Audited against the reporting Node only: the member it named may be
                    # another user's, and this row must not read as that Job's history.
                    await self.log_decision(
                        db, now, "report refused",
                        {"reason": verdict.reason, "member": str(key), "state": report.state,
                         "report_seq": report.report_seq, "journal_id": report.journal_id},
                        node_id=node_id,
                    )  # fmt: skip
                    return ReportOutcome(refused=verdict.reason)
                assert row is not None
                if isinstance(verdict, lc.EarlyReport):
                    return ReportOutcome(early=True)
                known = str(row[2])
                if isinstance(verdict, lc.StaleReport):
                    if str(row[1]) == lc.M_UNKNOWN:
                        # Its Node is talking again: the member shows its last real state.
                        await self.set_member_state(
                            db, key, known, now, f"reported {report.state} by its Node",
                            known=known,
                        )  # fmt: skip
                        await self.refresh_job(db, key.run_id, now)
                    return ReportOutcome(ended=known in lc.TERMINAL_MEMBER_STATES)
                moved = verdict.state
                why = report.reason or f"reported {moved} by its Node"
                await self.set_member_state(db, key, moved, now, why, known=moved)
                if report.has_exit and moved == lc.M_EXITED:
                    await db.execute(
                        "UPDATE members SET has_exit = 1, exit_code = ?, signal = ? "
                        "WHERE run_id = ? AND attempt = ? AND member_index = ?",
                        (report.exit_code, report.signal, key.run_id, key.attempt,
                         key.member_index),
                    )  # fmt: skip
                if report.out_dir:
                    await db.execute(
                        "UPDATE members SET out_dir = ? WHERE run_id = ? AND attempt = ? "
                        "AND member_index = ?",
                        (report.out_dir, key.run_id, key.attempt, key.member_index),
                    )
                if report.manifest is not None and moved == lc.M_EXITED:
                    await db.execute(
                        "UPDATE members SET output_manifest_json = ? WHERE run_id = ? AND "
                        "attempt = ? AND member_index = ?",
                        (stored_manifest(report.manifest).to_json(), key.run_id, key.attempt,
                         key.member_index),
                    )  # fmt: skip
                if moved in lc.TERMINAL_MEMBER_STATES:
                    await db.execute(
                        "UPDATE members SET ended_at_ms = ? WHERE run_id = ? AND attempt = ? "
                        "AND member_index = ?",
                        (report.at_ms or now, key.run_id, key.attempt, key.member_index),
                    )
                    await self.release_member(db, key, now, f"the member {moved}")
                await self.refresh_job(db, key.run_id, now)
                return ReportOutcome(applied=True, ended=moved in lc.TERMINAL_MEMBER_STATES)

        return await self.shielded(work)
