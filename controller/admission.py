"""The admission side of the controller loop: admit, dispatch, commit.

The admission pump asks the gate (``policies.admission_room``) how many groups may be
dispatched, appends their ``RolloutAdmitted`` in one batch (intent before the side
effect), and issues one generator call for them right after that append -- which a
fenced controller's store refuses, so no separate epoch check is needed. The call's
outcome becomes facts: ``GroupCommitted`` for every group it carried (one append), or
``GroupFailed`` for every group and a retry, or a generator replacement when the worker
died (``controller.worker_loss``). A group the worker returns as ``"failed"`` (its own
error, ``workers.errors``) gets ``GroupFailed`` and a retry alone; the rest commit.

Failures are bounded (``controller.core.failures``): a generator whose calls keep
failing is held back before its next call, longer after each (``_held_back``), and
when the run's failure budget runs out -- groups failing in a row, none committed --
``RunStopped`` is appended and the run stops with :class:`RunStoppedError`.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from controller.core import decisions, failures, policies
from controller.core.failures import FailuresSection
from controller.core.policies import StalenessSection
from controller.core.state import GroupStatus
from controller.journal import Journal
from controller.settings import RolloutSection
from controller.worker_loss import WorkerLossHandling
from events import schema as ev
from controller.commits import PendingCommits, commit_events
from controller.core.prefold import RejectedFact
from controller.episodes import episode_resume, restarts_before
from controller.partial import PartialRecorder, resume_flushes
from controller.pausing import PausingCall
from workers.api import (
    GenerationOutcome,
    GenerationRequest,
    GeneratorClient,
    PayloadStore,
    WorkerLostError,
    error_line,
)

log = structlog.get_logger("rl_controller.loop")

#: concurrent calls per generator
GENERATOR_SLOTS = 1


def sample_seed(run_seed: int, prompt_index: int, attempt: int) -> int:
    """Deterministic per-group sampling seed (no global RNG anywhere)."""
    return (run_seed * 1_000_003 + prompt_index * 7_919 + attempt * 104_729) % (2**31 - 1)


#: told of every failed generator call: (worker, the call's group ids, the worker's error)
OnFailure = Callable[[str, list[str], str], None]


class RunStoppedError(RuntimeError):
    """The failure budget ran out: ``RunStopped`` is in the log; the message says why."""


class AdmissionSide:
    """The admission pump and the generator calls it issues."""

    def __init__(
        self,
        journal: Journal,
        *,
        generators: list[GeneratorClient],
        loss: WorkerLossHandling,
        rollout: RolloutSection,
        staleness: StalenessSection,
        groups_per_step: int,
        target_version: int,
        num_prompts: int,
        seed: int,
        failures: FailuresSection | None = None,
        on_failure: OnFailure | None = None,
        payloads: PayloadStore | None = None,
    ) -> None:
        self.journal = journal
        self.generators = generators
        self.loss = loss
        self.rollout = rollout
        self.staleness = staleness
        self.groups_per_step = groups_per_step
        self.target_version = target_version
        self.num_prompts = num_prompts
        self.seed = seed
        self.failures = failures or FailuresSection()
        #: groups failing in a row that stop the run (``controller.core.failures``)
        self.failure_budget = self.failures.budget(len(generators), rollout.groups_per_call)
        self.on_failure = on_failure
        #: calls in flight per generator
        self.busy: dict[str, int] = {g.name: 0 for g in generators}
        #: their sum, kept as they change (the recorder asks it at every pause: O(fleet))
        self.calls_in_flight = 0
        #: why the gate is closed ("" when open), for the stall watchdog
        self.gate_reason = ""
        self.tasks: set[asyncio.Task] = set()
        #: partial rollouts: records flushes (calls share appends), deletes segment rows
        self.segment_rows = PartialRecorder(journal, payloads, linger_s=rollout.partial.record_linger_s,
                                            siblings=rollout.partial.record_linger_siblings,
                                            linger_max=rollout.partial.record_linger_max,
                                            in_flight=lambda: self.calls_in_flight)
        self._retry_queue: list[str] = []
        self._fatal: asyncio.Future | None = None
        #: returned generator calls waiting for their shared commit append
        self.pending_commits = PendingCommits(journal, self.segment_rows)
        #: one entry (a generator's index) per free call slot: the first free generator
        #: in list order is found in O(log n), not by scanning 1024 of them
        self._gen_index = {gen.name: i for i, gen in enumerate(generators)}
        self._free_slots = [i for i in range(len(generators)) for _ in range(GENERATOR_SLOTS)]

    def start(self) -> asyncio.Future:
        """Before the pump runs: queue the failed groups' retries; returns the future a
        generation task fails with when the run must stop."""
        state = self.journal.state
        self._retry_queue = [
            g.group_id for g in state.groups.values()
            if g.status is GroupStatus.FAILED and g.attempt < self.rollout.max_attempts
        ]
        self._fatal = asyncio.get_running_loop().create_future()
        return self._fatal

    def _stop_with(self, err: BaseException) -> None:
        """A generation task hit a fatal error: stop the run with it."""
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(err)

    def _held_back(self) -> set[str]:
        """Generators not to call now: restarting, or backing off after failed calls
        (``failures.ready_at``: when a worker's calls keep failing, its next one waits)."""
        held = self.loss.restarting
        streaks = self.journal.state.failures
        if not streaks.workers:
            return held
        now, per_call = self.journal.stamp().ts, self.rollout.groups_per_call
        backing = {w for w in streaks.workers
                   if failures.ready_at(streaks, w, self.failures, per_call) > now}
        return held | backing if backing else held

    def _take_free_calls(self, n: int, held: set[str]) -> list[GeneratorClient]:
        """Up to ``n`` free call slots, first generators first (``held`` ones skipped)."""
        out: list[GeneratorClient] = []
        skipped: list[int] = []
        heap = self._free_slots
        while heap and len(out) < n:
            i = heapq.heappop(heap)
            gen = self.generators[i]
            if held and gen.name in held:
                skipped.append(i)
            else:
                out.append(gen)
        for i in skipped:
            heapq.heappush(heap, i)
        return out

    def _free_count(self, held: set[str]) -> int:
        free, gens = self._free_slots, self.generators
        return sum(1 for i in free if gens[i].name not in held) if held else len(free)

    def _release_slot(self, gen: GeneratorClient) -> None:
        self.busy[gen.name] -= 1
        self.calls_in_flight -= 1
        self.segment_rows.recheck()  # a flush lingering for this call waits no longer
        heapq.heappush(self._free_slots, self._gen_index[gen.name])

    def _admission_room(self, limit: int) -> int:
        """Groups the gate admits now (up to ``limit``); records why it is shut."""
        state = self.journal.state
        if state.trainer_version >= self.target_version:
            return 0
        gate = dict(
            dispatch_version=state.weight_version,
            window=self.staleness.window_versions,
            groups_per_step=self.groups_per_step,
            capacity=self.staleness.capacity(self.groups_per_step),
            basis=self.staleness.budget_basis,
        )
        room = policies.admission_room(state, limit=limit, **gate)
        self.gate_reason = "" if room else policies.admission(state, **gate).reason
        return room

    async def pump(self) -> None:
        per_call = self.rollout.groups_per_call
        while True:
            held = self._held_back()
            free = self._free_count(held)
            room = self._admission_room(per_call * free) if free > 0 else 0
            gens = self._take_free_calls(-(-room // per_call), held) if room else []
            if not gens:
                await self.journal.wait_wake()
                continue
            room = min(room, per_call * len(gens))
            # Every call the gate and the free generators allow now, admitted in ONE append
            # (one round trip, one fsync): the same decisions as one admission at a time
            # (policies.admission_room), each call carrying <= groups_per_call groups.
            batch = self._next_admissions(
                room, [gen.name for gen in gens for _ in range(per_call)]
            )
            try:  # intent before the side effect (episodes that start over go first)
                await self.journal.append(*restarts_before(self.journal, batch), *batch)
            except BaseException:
                for gen in gens:  # nothing was dispatched: the slots stay free
                    heapq.heappush(self._free_slots, self._gen_index[gen.name])
                raise
            for i, gen in zip(range(0, room, per_call), gens):
                self._dispatch(gen, batch[i:i + per_call])

    def _next_admissions(self, n: int, generators: list[str]) -> list[ev.RolloutAdmitted]:
        """The next ``n`` admissions: failed groups' retries first, then new groups;
        the i-th goes to ``generators[i]`` (recorded, so views can tell them apart)."""
        state = self.journal.state
        out: list[ev.RolloutAdmitted] = []
        new = 0
        for i in range(n):
            if self._retry_queue:
                prev = state.groups[self._retry_queue.pop(0)]
                group_id, index, attempt = prev.group_id, prev.prompt_index, prev.attempt + 1
            else:
                index = len(state.groups) + new  # new groups: numbered in order
                new += 1
                group_id, attempt = f"g{index:06d}", 1
            prompt_index = index % self.num_prompts
            out.append(self.journal.make(
                ev.RolloutAdmitted,
                event_id=ev.group_event_id(group_id, "admitted", attempt),
                group_id=group_id,
                attempt=attempt,
                prompt_index=prompt_index,
                prompt_ref=f"prompt:{prompt_index}",
                weight_version=state.weight_version,
                n_samples=self.rollout.samples_per_group,
                sample_seed=sample_seed(self.seed, index, attempt),
                generator=generators[i],
            ))
        return out

    def _dispatch(self, gen: GeneratorClient, batch: list[ev.RolloutAdmitted]) -> None:
        inflight = self.journal.state.inflight
        requests = [
            GenerationRequest(
                group_id=admitted.group_id,
                attempt=admitted.attempt,
                prompt_index=admitted.prompt_index,
                n_samples=admitted.n_samples,
                seed=admitted.sample_seed,
                # a re-admitted group resumes from what its earlier attempts recorded
                resume=resume_flushes(inflight.get(admitted.group_id)) if inflight else [],
                episode=episode_resume(self.journal.state, admitted.group_id),
            )
            for admitted in batch
        ]
        self.busy[gen.name] += 1
        self.calls_in_flight += 1
        # Issued here, right after the appends that fencing would have refused: no
        # event-loop turn in between, so no separate epoch check (a store round trip).
        call = PausingCall(gen, requests, gen.generate(requests), self._record_flushes)
        task = self._spawn(self._generate(call))
        # a task cancelled before its first step never awaited the call
        task.add_done_callback(lambda t: call.cancel() if t.cancelled() else None)

    async def _generate(self, call: PausingCall) -> None:
        """Until the call's groups are all done (its pauses are recorded on the way,
        ``controller.pausing``): commit them, or fail their attempts."""
        gen, started = call.gen, self.journal.clock()
        try:
            try:
                outcomes = await call.result
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if not call.worker_failed:
                    raise  # a pause could not be recorded: stop the run
                self._release_slot(gen)
                if isinstance(err, WorkerLostError):
                    await self._on_generation_failed(gen, call.reqs, str(err))
                    await self.loss.replace_generator(gen, err)
                else:
                    await self._on_generation_failed(gen, call.reqs, error_line(err), err)
                return
            self._release_slot(gen)
            self.journal.timers.generator_busy += self.journal.clock() - started
            ok = [(r, o) for r, o in zip(call.reqs, outcomes) if o.status == "done"]
            if ok:
                self._queue_commit(gen, [r for r, _ in ok], [o for _, o in ok])
            self._fail_own(gen, call.reqs, outcomes)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # fenced, store gone, or the restart failed: stop the run
            self._stop_with(err)

    def _record_flushes(self, call: PausingCall, outs: list[GenerationOutcome]) -> None:
        """Flushes and finished groups in one append (``controller.partial``); that
        append is also the fencing check before the next call, as the admission's is
        before the first."""
        done = [(r, o) for r, o in zip(call.reqs, outs) if o.status == "done"]
        commits = commit_events(self.journal, [r for r, _ in done], [o for _, o in done], runs=True)
        self.segment_rows.hold(call, outs, commits)
        self._fail_own(call.gen, call.reqs, outs)

    def _fail_own(self, gen: GeneratorClient, reqs: list[GenerationRequest],
                  outs: list[GenerationOutcome]) -> None:
        """The groups the worker returned as failed (their own error, ``workers.errors``)
        fail alone; the call's others commit or go on."""
        for req, out in zip(reqs, outs):
            if out.status == "failed":
                self._spawn(self._fail_alone(gen, req, out.reason))

    def _queue_commit(self, gen: GeneratorClient, reqs: list[GenerationRequest],
                      outs: list[GenerationOutcome]) -> None:
        """Calls that return in the same turn of the loop commit in one append (group
        commit: one round trip and one fsync for all of them), with the pauses'
        append if one is gathering. The flush runs right after the tasks of that turn;
        ``drain`` flushes what is left. A commit the log refuses fails its group's
        attempt, as its generator's failure (``controller.commits``)."""
        def refused(gid: str, err: RejectedFact) -> None:
            req = next(r for r in reqs if r.group_id == gid)
            self._spawn(self._fail_alone(gen, req, error_line(err)))

        if self.rollout.partial.enabled:  # with the pauses' next append: one, not two
            self.segment_rows.join(commit_events(self.journal, reqs, outs, runs=True), self._stop_with, refused)
            return
        if self.pending_commits.add(reqs, outs, refused):
            # a task's first step is scheduled like ``call_soon``: right after this turn
            self._spawn(self.pending_commits.flush(self._stop_with))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """A task of this side's, held until it is done (``drain`` waits for them)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _fail_alone(self, gen: GeneratorClient, req: GenerationRequest, cause: str) -> None:
        """One group of a call failed (its own error, or a commit the log refused)."""
        try:
            await self._on_generation_failed(gen, [req], cause)
        except Exception as stop:  # fenced, store gone, or the failure budget ran out
            self._stop_with(stop)

    async def _on_generation_failed(
        self, gen: GeneratorClient, reqs: list[GenerationRequest], cause: str,
        err: BaseException | None = None,
    ) -> None:
        """A call failed: each of its groups' attempt failed (one append each, with its
        ``SegmentsDropped`` if recorded rows were missing), then :meth:`_retry_later`
        decides its next attempt -- unless the failure budget ran out: then ``RunStopped``
        is appended and the run stops with :class:`RunStoppedError` (``decisions.run_stopped``)."""
        j = self.journal
        reason = f"{gen.name}: {cause}"
        dropped = self.segment_rows.dropped(reqs, err)
        for req in reqs:
            log.warning("generation_failed", group_id=req.group_id, attempt=req.attempt,
                        reason=reason)
            await j.append(decisions.group_failed(req.group_id, req.attempt, reason, j.stamp()),
                           *dropped.get(req.group_id, ()))
            j.timers.failed += 1
            self._retry_later(req)
        if self.on_failure is not None:
            self.on_failure(gen.name, [req.group_id for req in reqs], cause)
        stop = decisions.run_stopped(j.state, self.failure_budget, j.stamp())
        if stop is not None:
            await j.append(stop)
            raise RunStoppedError(stop.reason)

    def _retry_later(self, req: GenerationRequest) -> None:
        """The one place a failed group's next attempt is decided: queued (retries go
        before new groups) while it has attempts left, else dropped."""
        if req.attempt < self.rollout.max_attempts:
            self._retry_queue.append(req.group_id)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Let in-flight generations commit (their groups stay buffered for a resume)."""
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
        await self.pending_commits.flush(self._stop_with)
        await self.segment_rows.settle(timeout_s)  # commits riding with a pause's append
        if self.tasks:  # a group's own failure, or a refused commit's (``_fail_alone``)
            await asyncio.wait(self.tasks, timeout=timeout_s)
        self.segment_rows.drop([], now=True)
        if self.segment_rows.deletes:  # best effort: recovery deletes what is left
            await asyncio.wait(self.segment_rows.deletes, timeout=timeout_s)

    def cancel_all(self) -> None:
        """Fenced: nothing these generations return may be logged or acted on."""
        for task in list(self.tasks):
            task.cancel()
