"""The scheduler task: places queued Jobs and aborts launches whose Prepare timed out.

Rules:
- One scheduler task per coordinator, so placement decisions never race each other; the store's
  reservation key would refuse an over-commit anyway.
- It wakes on events (a Job admitted, a Node connected, GPUs released) and at least every tick;
  wakes that arrive during a pass are coalesced into one more pass, not one pass each.
- A pass that cannot reach the store (:class:`StoreUnavailable`: the database gone, or a lock
  held past its timeout) is logged and the next wake or tick tries again: the scheduler never ends
  the coordinator's round by itself. On PostgreSQL the lease decides whether this coordinator still
  leads (:mod:`.leadership`), on its own deadline.
- A pass is the pure :func:`tuneplane.coordinator.queue_plan.plan_pass` over the whole queue
  (placement, cordoned and draining Nodes, quotas); this shell only reads its inputs, writes each
  reservation, sends Prepare and records why the other Jobs wait.
- A pass woken only by admissions plans only the Jobs admitted since the last pass, so an
  admission never walks the queue. That is the whole queue's pass: GPUs free and quotas leave
  room only for what they did at the last pass, and less after its launches, so every Job that
  waited then waits still (the pass's own rule, "a request that failed once fails again", held
  across passes), and the new Jobs come after them in queue order. Anything that can free GPUs
  or change a Node (a release, a Node connecting, a cordon) calls :meth:`Scheduler.wake`, which
  asks for a pass over the whole queue.
- A pass over new Jobs leaves the expired launches and the drained Nodes to the whole passes
  (at least one every tick, as when no Job is admitted): both follow the clock, and an admission
  changes neither, so it need not pay their two reads.
- At least every tick a pass looks at the whole queue's inputs, whatever woke it (a wake that
  was missed must not leave a Job waiting). It reads the queue itself only if those inputs
  changed since the last whole pass: the connected Nodes of the queue's Fleets with their free
  GPUs, the GPUs in use, and the queue's length and newest admission. With all of them as they
  were, the last whole pass's decisions and reasons stand (the same pure function of the same
  inputs), and a long queue costs a tick nothing. A whole pass that launched something leaves
  no such record: its launches change the inputs anyway.
- A tick that finds Jobs admitted since the last pass plans them first, as a pass over new Jobs,
  then makes its check: while admissions keep coming, one is nearly always waiting when a tick
  comes, and planned inside the whole pass it would move the mark and make every tick read the
  whole queue.
- A pass over new Jobs does not count the queue either (a count walks the whole queue's index
  range): it adds the Jobs it planned to the record's mark. Anything else that joined or left
  the queue meanwhile makes the real mark differ from that sum, and the next tick reads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import anyio
import attrs

from tuneplane.agent.crashpoint import crashpoint
from tuneplane.proto.contract import jobspec

from .. import capsule
from ..catalogue import Catalogue
from ..clock import now_ms
from ..counters import SCHEDULING_PASS
from ..gateways import outputs_grants
from ..gateways.sessions import SessionRegistry
from ..jobspec import check_loader_policy
from ..offload import PROCESS_TEXT_CHARS, in_process
from ..placement import Placement
from ..queue_plan import NodeState, PoolKey, plan_pass
from ..store.core import Store
from ..store.handle import StoreUnavailable
from ..store.lifecycle import cancel_job
from ..store.node_scheduling import mark_drained
from ..store.queue_status import (
    gpus_in_use,
    node_states,
    queue_mark,
    queued_requests,
    set_wait_reasons,
)

log = logging.getLogger(__name__)


@attrs.frozen
class PassInputs:
    """What a whole pass's outcome depends on besides the quotas (fixed for the scheduler's
    life): equal inputs, equal decisions and reasons."""

    fleets: frozenset[str]
    nodes: tuple[NodeState, ...]
    in_use: tuple[tuple[PoolKey, int], ...]
    queue: tuple[int, int]


class Scheduler:
    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        catalogue: Catalogue,
        prepare_timeout_s: float,
        tick_s: float = 1.0,
        quotas: Mapping[PoolKey, int] | None = None,
        loader_env_runtimes: frozenset[str] = frozenset(),
    ) -> None:
        self._quotas: Mapping[PoolKey, int] = quotas or {}
        # coordinator.toml's runtimes whose JobSpecs may set loader variables; re-checked at
        # launch, as Preview checked them, so a policy tightened since admission holds.
        self._loader_env_runtimes = loader_env_runtimes
        self._store = store
        self._registry = registry
        self._catalogue = catalogue
        self._prepare_timeout_ms = int(prepare_timeout_s * 1000)
        self._tick_s = tick_s
        self._wake = anyio.Event()
        self._passes = 0
        self._failed = 0
        self._partial = 0
        # What the next pass must plan: the whole queue, or only the Jobs admitted since.
        self._full = True
        self._admitted: set[str] = set()
        self._full_at = -float("inf")
        # The inputs of the last whole pass that launched nothing, while they still describe
        # the queue (see the module's rules); None when the next tick must read the queue.
        self._settled: PassInputs | None = None
        self._skipped = 0

    def wake(self) -> None:
        """Ask for a pass over the whole queue soon (safe to call from any coordinator task).

        Requests coalesce: however many arrive while a pass runs, one more pass follows it.
        """
        self._full = True
        self._wake.set()

    def admitted(self, run_id: str) -> None:
        """Job ``run_id`` joined the queue: plan it soon, without walking the rest of the queue
        unless something else asked for that (see the module's rules)."""
        self._admitted.add(run_id)
        self._wake.set()

    @property
    def passes(self) -> int:
        """How many passes this scheduler has started."""
        return self._passes

    @property
    def partial_passes(self) -> int:
        """How many passes planned only newly admitted Jobs."""
        return self._partial

    @property
    def skipped_passes(self) -> int:
        """How many ticks found the whole queue's inputs unchanged and read no queue."""
        return self._skipped

    @property
    def failed_passes(self) -> int:
        """How many passes ended because the store could not be reached."""
        return self._failed

    async def run(self) -> None:
        """Schedule until cancelled."""
        while True:
            with anyio.move_on_after(self._tick_s):
                await self._wake.wait()
            # A fresh event before the pass: a wake during the pass sets it, and only once.
            self._wake = anyio.Event()
            started = anyio.current_time()
            asked = self._full
            full = asked or started - self._full_at >= self._tick_s
            admitted, self._admitted, self._full = self._admitted, set(), False
            try:
                with SCHEDULING_PASS.time():
                    if full and not asked:
                        await self.tick(admitted)
                    else:
                        await self.step(None if full else admitted)
                if full:
                    self._full_at = started
            except StoreUnavailable as exc:
                self._failed += 1
                self._settled = None
                self._full = True  # whatever this pass missed, the next one reads
                log.warning("scheduling pass failed; the next pass tries again reason=%s", exc)

    async def tick(self, admitted: set[str]) -> None:
        """The pass every tick, which no wake asked for: the Jobs ``admitted`` since the last pass
        first, as a pass of their own, then the whole pass, which finds its record standing
        with them in it (and reads no queue) when nothing else changed. Planned in one whole
        pass instead, they would move the queue's mark and make every tick read the whole queue
        while admissions keep coming."""
        if admitted:
            await self.step(admitted)
        await self.step(None, tick=True)

    async def step(self, only: set[str] | None = None, tick: bool = False) -> None:
        """One pass: abort expired launches, mark drained Nodes, then plan the whole queue; or
        plan only the Jobs ``only`` names (admitted since the last pass; see the module's rules).
        ``tick``: a whole pass no one asked for, which reads no queue when its inputs are as the
        last whole pass left them."""
        self._passes += 1
        if only is not None:
            self._partial += 1
        if only is None:
            aborts = await self._store.abort_expired_prepares(now_ms())
            if aborts:
                crashpoint("after-abort-decided")
            self._registry.dispatch(aborts)
            await mark_drained(self._store, now_ms())
        settled, self._settled = self._settled, None
        if tick and settled is not None and await self._inputs(settled.fleets) == settled:
            self._skipped += 1
            self._settled = settled
            return
        # A whole pass reads the queue's mark before the queue: a Job queued in between is
        # planned now and still moves the next tick's mark, which costs one more read, never a
        # Job left waiting. A pass over new Jobs reads no mark: counting the queue walks it.
        mark = await queue_mark(self._store) if only is None else None
        queue, reasons, newest = await queued_requests(self._store, only)
        fleets = frozenset(j.fleet for j in queue)
        launched = False
        nodes: list[NodeState] = []
        in_use = await gpus_in_use(self._store)
        if queue:
            nodes = await node_states(self._store, self._registry.is_connected, sorted(fleets))
            plan = plan_pass(queue, nodes, in_use, self._quotas)
            for launch in plan.launches:
                await self._launch(launch.run_id, launch.placement)
            await set_wait_reasons(self._store, plan.waiting, reasons, now_ms())
            launched = bool(plan.launches)
        if launched:
            return
        if mark is not None:
            self._settled = PassInputs(fleets, tuple(nodes), _in_use_key(in_use), mark)
        elif settled is not None and fleets <= settled.fleets:
            # The new Jobs were planned against the inputs the whole pass saw (nothing launched
            # since), so its record stands with them added to the queue's mark. The mark is
            # counted here, not read: if anything else joined or left the queue meanwhile, the
            # next tick's read of the real mark differs from it and that tick reads the queue.
            count, latest = settled.queue
            self._settled = attrs.evolve(settled, queue=(count + len(queue), max(latest, newest)))

    async def _inputs(self, fleets: frozenset[str]) -> PassInputs:
        """The whole queue's inputs now, for the Fleets ``fleets``."""
        mark = await queue_mark(self._store)
        nodes = await node_states(self._store, self._registry.is_connected, sorted(fleets))
        return PassInputs(fleets, tuple(nodes), _in_use_key(await gpus_in_use(self._store)), mark)

    async def _launch(self, run_id: str, placement: Placement) -> None:
        job = await self._store.queued_job(run_id)
        if job is None:
            return  # cancelled since the pass read the queue
        try:
            if len(job.resolved_json) > PROCESS_TEXT_CHARS:  # megabytes: off the event loop
                spec = await in_process(jobspec.loads, job.resolved_json)
            else:
                spec = jobspec.loads(job.resolved_json)
            check_loader_policy(spec, self._loader_env_runtimes)
        except jobspec.JobSpecError as exc:
            # Admitted under looser rules (an older coordinator, a coordinator.toml that allowed
            # more then) or edited in the store: the Job ends with the sentence, and the
            # scheduler goes on with the rest of the queue.
            why = f"its JobSpec does not pass this coordinator's checks ({exc}) Submit it again"
            await cancel_job(self._store, job.run_id, "the coordinator", True, why, now_ms())
            log.warning("queued job refused run_id=%s reason=%s", job.run_id, exc)
            return
        recipe = self._catalogue.get(spec.method_id)
        launcher = recipe.launcher if recipe is not None else "member"
        count = len(placement.members)
        now = now_ms()
        orders = await self._store.reserve_launch(
            job,
            placement,
            lambda attempt: capsule.seal(spec, launcher, job.run_id, attempt, count, job.digest),
            now + self._prepare_timeout_ms,
            now,
        )
        if orders is None:
            return
        crashpoint("after-reservation-written")
        log.info(
            "launch reserved run_id=%s members=%d gpus_per_member=%d nodes=%s",
            job.run_id,
            count,
            placement.gpus_per_member,
            ",".join(m.node_id for m in placement.members),
        )
        # A Derivation fetched from another Node: each Prepare gets its grant as it leaves.
        self._registry.dispatch(await outputs_grants.attach(self._store, orders, now_ms()))


def _in_use_key(in_use: Mapping[PoolKey, int]) -> tuple[tuple[PoolKey, int], ...]:
    return tuple(sorted(in_use.items()))
