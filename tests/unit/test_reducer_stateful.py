"""Hypothesis drives the group and step state machines through random valid histories.

A small model (plain dicts and lists, written independently of the reducer) predicts
each group's status, the buffer order, versions, epochs and steps; after every rule the
folded ``RunState`` must agree with it and satisfy the structural invariants. Rules
prefixed ``bad_`` offer an invalid event instead: the reducer must raise
``InvariantViolation`` naming the next log position and leave the state untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from controller.core.errors import InvariantViolation
from controller.core.reducer import apply
from controller.core.state import GroupStatus, RunState, initial_state
from events.schema import (
    GroupCommitted,
    MicrobatchTrained,
    PayloadsReleased,
    RolloutAdmitted,
    StepBegun,
    StepFinished,
    StoredEvent,
)
from tests.unit.log_builder import LogBuilder

S = GroupStatus
WINDOW = 1


class ReducerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.b = LogBuilder(run_id="r-stateful", window=WINDOW, groups_per_step=2, samples_per_group=2)
        self.state: RunState = initial_state()
        self.applied = 0
        # the model
        self.status: dict[str, S] = {}
        self.attempt: dict[str, int] = {}
        self.dispatch: dict[str, int] = {}
        self.start: dict[str, int] = {}
        self.buffer: list[str] = []
        self.commit_pos: dict[str, int] = {}
        self.consumed_version: dict[str, int] = {}
        self.released: set[str] = set()
        self.trainer_version = 0
        self.weight_version = 0
        self.next_step = 0
        self.open: dict[str, Any] | None = None
        self.finished_steps: dict[int, tuple[int, list[str]]] = {}
        self.ckpts: list[list[Any]] = []  # [version, rejected, lost]
        self.epoch = 1
        self.run_finished = False
        self.n_groups = 0
        self.b.start()
        self._sync()

    # -- plumbing ---------------------------------------------------------------------

    def _sync(self) -> None:
        for stored in self.b.events[self.applied :]:
            apply(self.state, stored)
        self.applied = len(self.b.events)

    def _expect_violation(self, event: Any) -> None:
        position = self.b.next_position
        before = self.state.copy()
        with pytest.raises(InvariantViolation) as info:
            apply(self.state, StoredEvent(position=position, event=event))
        assert info.value.position == position
        assert self.state == before

    def _ts(self) -> float:
        return self.b.ts()

    def _in(self, *statuses: S) -> list[str]:
        return sorted(g for g, s in self.status.items() if s in statuses)

    def _covered(self) -> int:
        for version, rejected, lost in reversed(self.ckpts):
            if not rejected and not lost:
                return int(version)
        return -1

    def _releasable(self) -> list[str]:
        covered = self._covered()
        return sorted(
            g
            for g, s in self.status.items()
            if g not in self.released
            and (s in (S.EVICTED, S.FAILED, S.LOST) or (s is S.CONSUMED and self.consumed_version[g] <= covered))
        )

    def _eligible(self) -> list[str]:
        base = self.trainer_version
        return [g for g in self.buffer if 0 <= base - self.start[g] <= WINDOW]

    # -- valid rules ------------------------------------------------------------------

    @precondition(lambda self: not self.run_finished)
    @rule()
    def admit_new(self) -> None:
        gid = f"g{self.n_groups}"
        self.n_groups += 1
        self.b.admit(gid)
        self.status[gid], self.attempt[gid], self.dispatch[gid] = S.ADMITTED, 1, self.weight_version
        self._sync()

    @precondition(lambda self: not self.run_finished)
    @rule(n=st.integers(1, 3))
    def admit_and_commit(self, n: int) -> None:
        """Shortcut to a full buffer (so steps, aborts and evictions get reached)."""
        for _ in range(n):
            self.admit_new()
            gid = f"g{self.n_groups - 1}"
            self.b.commit(gid, start=self.dispatch[gid], end=self.weight_version)
            self.status[gid], self.start[gid] = S.COMMITTED, self.dispatch[gid]
            self.commit_pos[gid] = self.b.last_position
            self.buffer.append(gid)
        self._sync()

    @precondition(lambda self: not self.run_finished and self._in(S.FAILED))
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self._in(S.FAILED)))
        self.attempt[gid] += 1
        self.b.admit(gid, attempt=self.attempt[gid])
        self.status[gid], self.dispatch[gid] = S.ADMITTED, self.weight_version
        self.released.discard(gid)
        self._sync()

    @precondition(lambda self: self._in(S.ADMITTED))
    @rule(data=st.data(), fail=st.booleans())
    def complete(self, data: st.DataObject, fail: bool) -> None:
        gid = data.draw(st.sampled_from(self._in(S.ADMITTED)))
        if fail:
            self.b.fail(gid, attempt=self.attempt[gid])
            self.status[gid] = S.FAILED
        else:
            self.b.commit(gid, attempt=self.attempt[gid], start=self.dispatch[gid], end=self.weight_version)
            self.status[gid], self.start[gid] = S.COMMITTED, self.dispatch[gid]
            self.commit_pos[gid] = self.b.last_position
            self.buffer.append(gid)
        self._sync()

    @precondition(lambda self: self.buffer)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self.buffer))
        self.b.evict(gid, lag=self.trainer_version - self.start[gid])
        self.buffer.remove(gid)
        self.status[gid] = S.EVICTED
        self._sync()

    @precondition(lambda self: self.open is None and not self.run_finished)
    @rule()
    def begin(self) -> None:
        self.b.begin_step(self.next_step, base=self.trainer_version)
        self.open = {"step": self.next_step, "groups": [], "mbs": 0}
        self.next_step += 1
        self._sync()

    @precondition(lambda self: self.open is not None and self._eligible())
    @rule(data=st.data())
    def microbatch(self, data: st.DataObject) -> None:
        assert self.open is not None
        ids = data.draw(st.lists(st.sampled_from(self._eligible()), min_size=1, max_size=3, unique=True))
        self.b.microbatch(ids, step=self.open["step"], index=self.open["mbs"])
        self.open["mbs"] += 1
        self.open["groups"].extend(ids)
        for gid in ids:
            self.buffer.remove(gid)
            self.status[gid] = S.CLAIMED
        self._sync()

    @precondition(lambda self: self.open is not None and self.open["mbs"] > 0)
    @rule()
    def finish(self) -> None:
        assert self.open is not None
        self.trainer_version += 1
        self.b.finish_step(step=self.open["step"], trainer_version=self.trainer_version)
        for gid in self.open["groups"]:
            self.status[gid], self.consumed_version[gid] = S.CONSUMED, self.trainer_version
        self.finished_steps[self.open["step"]] = (self.trainer_version, self.open["groups"])
        self.open = None
        self._sync()

    @precondition(lambda self: self.open is not None)
    @rule()
    def abort(self) -> None:
        assert self.open is not None
        self.b.abort_step(step=self.open["step"])
        for gid in self.open["groups"]:
            self.status[gid] = S.COMMITTED
        self.buffer = sorted(self.buffer + self.open["groups"], key=self.commit_pos.__getitem__)
        self.open = None
        self._sync()

    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        version = data.draw(st.integers(self.weight_version, self.trainer_version))
        self.b.publish(version)
        self.weight_version = version
        self._sync()

    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        version = data.draw(st.integers(max(0, self.trainer_version - 2), self.trainer_version))
        self.b.checkpoint(version)
        self.ckpts.append([version, False, False])
        self._sync()

    @precondition(lambda self: self.ckpts)
    @rule(data=st.data())
    def reject_checkpoint(self, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from([c[0] for c in self.ckpts]))
        self.b.reject_checkpoint(version)
        for ckpt in self.ckpts:
            if ckpt[0] == version:
                ckpt[1] = True
        self._sync()

    @precondition(lambda self: self._releasable())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self._releasable()), min_size=1, max_size=4, unique=True))
        self.b.release(ids)
        for gid in ids:
            self.released.add(gid)
            if self.status[gid] is S.CONSUMED:
                self.status[gid] = S.RELEASED
        self._sync()

    @precondition(lambda self: self.open is None and any(not c[1] and not c[2] for c in self.ckpts))
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        to = data.draw(st.sampled_from(sorted({c[0] for c in self.ckpts if not c[1] and not c[2]})))
        lost = sorted(s for s, (v, _) in self.finished_steps.items() if v > to)
        groups = [g for s in lost for g in self.finished_steps[s][1]]
        self.b.rewind(to, lost_steps=lost, lost_group_ids=groups)
        for s in lost:
            del self.finished_steps[s]
        for gid in groups:
            self.status[gid] = S.LOST
        for ckpt in self.ckpts:
            if ckpt[0] > to:
                ckpt[2] = True
        self.trainer_version = to
        self.weight_version = min(self.weight_version, to)
        self._sync()

    @rule()
    def restart(self) -> None:
        self.epoch += 1
        self.b.controller_started(self.epoch)
        self.run_finished = False
        self._sync()

    @precondition(lambda self: self.open is None and not self.run_finished)
    @rule()
    def finish_run(self) -> None:
        self.b.finish_run()
        self.run_finished = True
        self._sync()

    # -- invalid events -----------------------------------------------------------------

    @precondition(lambda self: self.epoch > 1)
    @rule()
    def bad_stale_epoch(self) -> None:
        self._expect_violation(
            RolloutAdmitted(
                event_id="group:zz:admitted:a1", epoch=self.epoch - 1, ts=self._ts(), group_id="zz",
                attempt=1, prompt_index=0, prompt_ref="p#0", weight_version=0, n_samples=1, sample_seed=0,
            )
        )

    @precondition(lambda self: self.open is not None and self.open["mbs"] > 0)
    @rule(delta=st.sampled_from([0, 2, -1]))
    def bad_finish_version(self, delta: int) -> None:
        assert self.open is not None
        step = self.open["step"]
        self._expect_violation(
            StepFinished(
                event_id=f"step:{step}:finished", epoch=self.epoch, ts=self._ts(), step=step,
                trainer_version=self.trainer_version + delta, metrics={}, grad_norm=0.0, weights_digest="d",
            )
        )

    @precondition(
        lambda self: self.open is not None
        and self._in(S.ADMITTED, S.CLAIMED, S.CONSUMED, S.EVICTED, S.FAILED, S.RELEASED, S.LOST)
    )
    @rule(data=st.data())
    def bad_microbatch(self, data: st.DataObject) -> None:
        assert self.open is not None
        gid = data.draw(
            st.sampled_from(self._in(S.ADMITTED, S.CLAIMED, S.CONSUMED, S.EVICTED, S.FAILED, S.RELEASED, S.LOST))
        )
        step, index = self.open["step"], self.open["mbs"]
        self._expect_violation(
            MicrobatchTrained(
                event_id=f"step:{step}:microbatch:{index}", epoch=self.epoch, ts=self._ts(), step=step,
                index=index, group_ids=[gid], num_sequences=1, num_tokens=1,
            )
        )

    @precondition(lambda self: self._in(S.ADMITTED, S.COMMITTED, S.CLAIMED))
    @rule(data=st.data())
    def bad_release(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self._in(S.ADMITTED, S.COMMITTED, S.CLAIMED)))
        self._expect_violation(
            PayloadsReleased(event_id="release:bad", epoch=self.epoch, ts=self._ts(), group_ids=[gid])
        )

    @precondition(lambda self: self.open is not None)
    @rule()
    def bad_begin_while_open(self) -> None:
        self._expect_violation(
            StepBegun(
                event_id=f"step:{self.next_step}:begun", epoch=self.epoch, ts=self._ts(),
                step=self.next_step, base_trainer_version=self.trainer_version,
            )
        )

    @precondition(lambda self: self._in(S.COMMITTED, S.CLAIMED, S.CONSUMED))
    @rule(data=st.data())
    def bad_commit_twice(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self._in(S.COMMITTED, S.CLAIMED, S.CONSUMED)))
        self._expect_violation(
            GroupCommitted(
                event_id=f"group:{gid}:committed:a9", epoch=self.epoch, ts=self._ts(), group_id=gid,
                attempt=self.attempt[gid], weight_version_start=0, weight_version_end=0,
                payload_keys=["k"], rewards=[0.0], lengths=[1],
            )
        )

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def state_matches_model(self) -> None:
        s = self.state
        assert s.position == self.b.last_position
        assert {g: r.status for g, r in s.groups.items()} == self.status
        assert list(s.buffer) == self.buffer
        assert list(s.admitted) == [g for g in s.admitted if self.status[g] is S.ADMITTED]
        assert set(s.admitted) == set(self._in(S.ADMITTED))
        assert (s.trainer_version, s.weight_version, s.next_step, s.epoch) == (
            self.trainer_version, self.weight_version, self.next_step, self.epoch,
        )
        assert s.finished == self.run_finished
        assert (s.open_step is None) == (self.open is None)
        if self.open is not None and s.open_step is not None:
            assert [g for mb in s.open_step.microbatches for g in mb] == self.open["groups"]
        assert s.covered_trainer_version() == self._covered()
        assert {g for g, r in s.groups.items() if r.payload_released} == self.released

    @invariant()
    def structural_invariants(self) -> None:
        s = self.state
        assert sorted(s.version_steps) == list(range(1, s.trainer_version + 1))
        consumers: dict[str, int] = {}
        for step in s.steps.values():
            if step.trainer_version is not None and not step.lost:
                assert step.trainer_version == step.base_trainer_version + 1
                assert s.version_steps[step.trainer_version] == step.step
                for gid in step.group_ids:
                    assert gid not in consumers, "a group consumed by two finished steps"
                    consumers[gid] = step.step
        for gid, group in s.groups.items():
            if group.status in (S.CONSUMED, S.RELEASED):
                assert consumers[gid] == group.consumed_step
                assert group.lag is not None and 0 <= group.lag <= WINDOW
            if group.status is S.RELEASED:
                assert group.payload_released
        assert s.copy() == s


ReducerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReducerStateMachine = ReducerMachine.TestCase
