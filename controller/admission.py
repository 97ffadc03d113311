"""The admission side of the controller loop (a part of ``Controller``).

The admission pump asks the gate (``policies.admission_room``) how many groups may be
dispatched, appends their ``RolloutAdmitted`` in one batch (intent before the side
effect), and issues one generator call for them right after that append -- which a
fenced controller's store refuses, so no separate epoch check is needed. The call's
outcome becomes facts: ``GroupCommitted`` for every group it carried (one append), or
``GroupFailed`` for every group and a retry, or a generator replacement when the worker
died (``controller.worker_loss``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import structlog

from controller.core import policies
from workers.api import GenerationOutcome, GenerationRequest, GeneratorClient
from controller.crashpoints import crash_point
from workers.api import WorkerLostError
from events import schema as ev

log = structlog.get_logger("rl_controller.loop")


def sample_seed(run_seed: int, prompt_index: int, attempt: int) -> int:
    """Deterministic per-group sampling seed (no global RNG anywhere)."""
    return (run_seed * 1_000_003 + prompt_index * 7_919 + attempt * 104_729) % (2**31 - 1)


class AdmissionSide:
    """Mixed into ``controller.loop.Controller``; uses its writer, settings and pumps."""

    def _free_generator(self) -> GeneratorClient | None:
        for gen in self.generators:
            if gen.name in self._restarting:
                continue
            if self._busy[gen.name] < self.s.generator_slots:
                return gen
        return None

    def _admission_room(self) -> int:
        """Groups the gate admits now (up to one call's worth); records why it is shut."""
        if self.state.trainer_version >= self.s.target_version:
            return 0
        gate = dict(
            dispatch_version=self.state.weight_version,
            window=self.s.window_versions,
            groups_per_step=self.s.groups_per_step,
            capacity=self.s.capacity,
        )
        room = policies.admission_room(self.state, limit=self.s.groups_per_call, **gate)
        self._gate_reason = "" if room else policies.admission(self.state, **gate).reason
        return room

    async def _admission_pump(self) -> None:
        while True:
            room = self._admission_room()
            gen = self._free_generator() if room else None
            if gen is None:
                await self._wait_wake()
                continue
            # Up to groups_per_call groups for one call, admitted in one append: the
            # same decision as that many single admissions (policies.admission_room).
            batch = self._next_admissions(room)
            self._append(*batch)  # intent before the side effect
            for admitted in batch:
                crash_point("after_rollout_admitted", admitted.group_id)
            self._dispatch(gen, batch)

    def _next_admissions(self, n: int) -> list[ev.RolloutAdmitted]:
        """The next ``n`` admissions: failed groups' retries first, then new groups."""
        out: list[ev.RolloutAdmitted] = []
        new = 0
        for _ in range(n):
            if self._retry_queue:
                prev = self.state.groups[self._retry_queue.pop(0)]
                group_id, index, attempt = prev.group_id, prev.prompt_index, prev.attempt + 1
            else:
                index = len(self.state.groups) + new  # new groups: numbered in order
                new += 1
                group_id, attempt = f"g{index:06d}", 1
            prompt_index = index % self.s.num_prompts
            out.append(self.w.make(
                ev.RolloutAdmitted,
                event_id=ev.group_event_id(group_id, "admitted", attempt),
                group_id=group_id,
                attempt=attempt,
                prompt_index=prompt_index,
                prompt_ref=f"prompt:{prompt_index}",
                weight_version=self.state.weight_version,
                n_samples=self.s.samples_per_group,
                sample_seed=sample_seed(self.s.seed, index, attempt),
            ))
        return out

    def _dispatch(self, gen: GeneratorClient, batch: list[ev.RolloutAdmitted]) -> None:
        requests = [
            GenerationRequest(
                group_id=admitted.group_id,
                attempt=admitted.attempt,
                prompt_index=admitted.prompt_index,
                n_samples=admitted.n_samples,
                seed=admitted.sample_seed,
            )
            for admitted in batch
        ]
        self._busy[gen.name] += 1
        # Issued here, right after the appends that fencing would have refused: no
        # event-loop turn in between, so no separate epoch check (a store round trip).
        pending = gen.generate(requests)
        task = asyncio.create_task(self._generate(gen, requests, pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if isinstance(pending, asyncio.Future):  # a task cancelled before it awaited it
            task.add_done_callback(lambda t: pending.cancel() if t.cancelled() else None)

    async def _generate(
        self,
        gen: GeneratorClient,
        reqs: list[GenerationRequest],
        pending: Awaitable[list[GenerationOutcome]],
    ) -> None:
        started = self.clock()
        try:
            try:
                outcomes = list(await pending)
                if len(outcomes) != len(reqs):
                    raise RuntimeError(f"{len(outcomes)} outcomes for {len(reqs)} groups")
            except asyncio.CancelledError:
                raise
            except WorkerLostError as err:
                self._busy[gen.name] -= 1
                for req in reqs:
                    self._on_generation_failed(req, f"{gen.name}: {err}")
                await self._replace_generator(gen, err)
                return
            except Exception as err:  # a worker failure is data, not a crash
                self._busy[gen.name] -= 1
                for req in reqs:
                    self._on_generation_failed(req, f"{gen.name}: {type(err).__name__}: {err}")
                return
            self._busy[gen.name] -= 1
            self.t.generator_busy += self.clock() - started
            self._commit(reqs, outcomes)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # fenced, store gone, or the restart failed: stop the run
            self._stop_with(err)

    def _commit(self, reqs: list[GenerationRequest], outs: list[GenerationOutcome]) -> None:
        """One call's groups, committed in one append (the facts after the side effect)."""
        for req in reqs:
            crash_point("before_group_committed", req.group_id)
        self._append(*(
            self.w.make(
                ev.GroupCommitted,
                event_id=ev.group_event_id(req.group_id, "committed", req.attempt),
                group_id=req.group_id,
                attempt=req.attempt,
                weight_version_start=out.weight_version_start,
                weight_version_end=out.weight_version_end,
                payload_keys=list(out.payload_keys),
                rewards=list(out.rewards),
                lengths=list(out.lengths),
            )
            for req, out in zip(reqs, outs)
        ))
        for req in reqs:
            crash_point("after_group_committed", req.group_id)

    def _on_generation_failed(self, req: GenerationRequest, reason: str) -> None:
        log.warning("generation_failed", group_id=req.group_id, attempt=req.attempt, reason=reason)
        self._append(
            self.w.make(
                ev.GroupFailed,
                event_id=ev.group_event_id(req.group_id, "failed", req.attempt),
                group_id=req.group_id,
                attempt=req.attempt,
                reason=reason[:500],
            )
        )
        crash_point("after_group_failed", req.group_id)
        self.t.failed += 1
        if req.attempt < self.s.max_attempts:
            self._retry_queue.append(req.group_id)
