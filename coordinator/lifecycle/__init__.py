"""Job and member lifecycles as the coordinator records them: tables, not branches.

Rules:
- The words and the moves that exist are data (:mod:`.states`): a Job moves only along
  ``JOB_TRANSITIONS``, a member forward only along ``MEMBER_RANK``; terminal states are terminal.
- The Job's state is *derived* from its attempt's decision and members (:mod:`.job_state`); a lost
  connection never makes a Job ``failed``.
- A Node's report is judged before anything is written (:mod:`.reports`): applied, stale, early
  or refused with a sentence; a member declared lost has ended for good.

Everything here is pure. This front door names what callers use, so they read
``lifecycle.judge_report`` or ``lifecycle.QUEUED`` whichever module holds it; the package reads
as states <- reports, states <- job_state.
"""

from .job_state import MemberFacts as MemberFacts
from .job_state import NotRetryable as NotRetryable
from .job_state import check_retry as check_retry
from .job_state import derive_job_state as derive_job_state
from .job_state import describe_failure as describe_failure
from .job_state import describe_launch_failure as describe_launch_failure
from .job_state import failure_sentence as failure_sentence
from .job_state import may_follow as may_follow
from .job_state import next_job_state as next_job_state
from .reports import NEEDS_COMMIT as NEEDS_COMMIT
from .reports import REPORT_LATER as REPORT_LATER
from .reports import REPORT_MOVES as REPORT_MOVES
from .reports import REPORTABLE as REPORTABLE
from .reports import ApplyReport as ApplyReport
from .reports import EarlyReport as EarlyReport
from .reports import RefuseReport as RefuseReport
from .reports import ReportFacts as ReportFacts
from .reports import ReportVerdict as ReportVerdict
from .reports import StaleReport as StaleReport
from .reports import held_after_hello as held_after_hello
from .reports import judge_report as judge_report
from .states import ABORT as ABORT
from .states import ABORTED as ABORTED
from .states import CANCELLED as CANCELLED
from .states import CANCELLING as CANCELLING
from .states import COMMIT as COMMIT
from .states import FAILED as FAILED
from .states import JOB_TRANSITIONS as JOB_TRANSITIONS
from .states import M_ABORTED as M_ABORTED
from .states import M_CANCELLING as M_CANCELLING
from .states import M_COMMITTED as M_COMMITTED
from .states import M_EXITED as M_EXITED
from .states import M_LOST as M_LOST
from .states import M_PREPARED as M_PREPARED
from .states import M_PREPARING as M_PREPARING
from .states import M_RESERVED as M_RESERVED
from .states import M_RUNNING as M_RUNNING
from .states import M_STARTING as M_STARTING
from .states import M_UNKNOWN as M_UNKNOWN
from .states import MEMBER_RANK as MEMBER_RANK
from .states import PREPARING as PREPARING
from .states import QUEUED as QUEUED
from .states import RESERVED as RESERVED
from .states import RETRYABLE as RETRYABLE
from .states import RUNNING as RUNNING
from .states import STARTING as STARTING
from .states import SUCCEEDED as SUCCEEDED
from .states import TERMINAL_JOB_STATES as TERMINAL_JOB_STATES
from .states import TERMINAL_MEMBER_STATES as TERMINAL_MEMBER_STATES
from .states import UNKNOWN as UNKNOWN
from .states import IllegalTransition as IllegalTransition
from .states import check_job_move as check_job_move
from .states import member_after_report as member_after_report
