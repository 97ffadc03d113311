"""A generator's bad output is refused before it is written, never logged.

Pauses and commits carry what a generator returned; the fold checks them. The log
writer folds them before the store write (``controller.core.prefold``): one that breaks
a rule is refused with nothing of its batch written and the state as it was, the
controller fails that group's attempt as its worker's failure, and the run goes on with
a log that folds. Before, the bad fact was written first and the log could never be
folded past it again.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from controller.config import load_config
from controller.core.errors import InvariantViolation
from controller.core.fold import fold
from controller.core.prefold import RejectedFact
from controller.core.reducer import apply_event
from controller.core.state import encode_state
from controller.log_writer import LogWriter
from controller.projector import Projector
from events import schema as ev
from events.errors import ConcurrencyError, StoreUnavailableError
from events.memory_store import MemoryEventStore
from sim import episodes as sim_episodes
from sim.harness import SimSpec, simulate
from sim.timings import Lognormal, SyntheticTimings
from tests.unit.log_builder import LogBuilder
from tests.unit.test_pause_fold import BENDS, N, _pauses

_replace = msgspec.structs.replace


def _writer_with_two_groups() -> tuple[LogWriter, MemoryEventStore, list, list]:
    """A writer over a real store holding a run with g1 and g2 admitted, and the
    pauses each group's episodes will make."""
    b = LogBuilder(run_id="r1", window=1, groups_per_step=2, samples_per_group=N).start()
    b.admit("g1").admit("g2")
    store = MemoryEventStore()
    assert store.claim_epoch("r1") == 1  # the builder's events carry epoch 1
    store.append("r1", [s.event for s in b.build()], expected_position=0, epoch=1)
    state = fold(b.build())
    p1, p2 = _pauses(random.Random(1), "g1", turns=3), _pauses(random.Random(2), "g2", turns=3)
    return LogWriter(store, "r1", 1, state), store, p1, p2


def _unchanged(writer: LogWriter, store: MemoryEventStore, before: bytes, last: int) -> None:
    assert encode_state(writer.state) == before
    assert store.last_position("r1") == last
    assert fold(store.read("r1")).position == last


@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_bad_pause_is_refused_and_nothing_of_its_batch_is_written(at: int):
    """Every bend that breaks a rule at this pause of g2 (folded on a copy of the state
    to know), batched after a valid pause of g1 that was applied first and put back."""
    writer, store, p1, p2 = _writer_with_two_groups()
    for k in range(at):
        writer.append(p1[k], p2[k])
    before, last = encode_state(writer.state), store.last_position("r1")
    refused = 0
    for name, bend in BENDS.items():
        bad = _replace(p2[at], **bend(p2[at]))
        try:
            apply_event(writer.state.copy(), bad, last + 1)
            continue  # a bend that is no bend here
        except InvariantViolation as err:
            rule = err.reason
        with pytest.raises(RejectedFact) as err:
            writer.append(p1[at], bad)
        assert err.value.index == 1 and err.value.event is bad, name
        assert str(err.value).endswith(f"refused before it was written: {rule}"), name
        _unchanged(writer, store, before, last)
        refused += 1
    assert refused > 20
    # the same batch without it is written and folds to the writer's state
    writer.append(p1[at], p2[at])
    assert encode_state(fold(store.read("r1"))) == encode_state(writer.state)


def test_a_malformed_pause_is_refused_like_a_bad_one():
    """A value of the wrong type (a worker's bug: structs are not validated when built)
    makes the handler raise something other than a broken rule: refused all the same."""
    writer, store, p1, p2 = _writer_with_two_groups()
    writer.append(p1[0], p2[0])
    before, last = encode_state(writer.state), store.last_position("r1")
    results = [_replace(p2[1].results[0], reward=None), *p2[1].results[1:]]
    with pytest.raises(RejectedFact, match="malformed: TypeError"):
        writer.append(p1[1], _replace(p2[1], results=results))
    _unchanged(writer, store, before, last)


def test_a_commit_that_disagrees_with_the_recorded_turns_is_refused():
    writer, store, p1, p2 = _writer_with_two_groups()
    for p in p1:
        writer.append(p)
    recorded = writer.state.inflight["g1"].recorded
    rewards = [sum(t.result.reward for t in e.turns) for e in writer.state.episodes["g1"].samples]

    def commit(lengths: list[int]) -> ev.GroupCommitted:
        return writer.make(ev.GroupCommitted, event_id=ev.group_event_id("g1", "committed", 1),
                           group_id="g1", attempt=1, weight_version_start=0, weight_version_end=0,
                           payload_keys=[f"k{i}" for i in range(N)], rewards=rewards, lengths=lengths)

    before, last = encode_state(writer.state), store.last_position("r1")
    with pytest.raises(RejectedFact, match="tokens committed but"):
        writer.append(commit([n - 1 for n in recorded]))
    _unchanged(writer, store, before, last)
    writer.append(commit(list(recorded)), p2[0])  # applied with what its checks found
    assert writer.state.groups["g1"].committed_position == last + 1
    assert encode_state(fold(store.read("r1"))) == encode_state(writer.state)


def test_a_write_that_fails_leaves_the_pauses_it_applied_unapplied():
    writer, store, p1, p2 = _writer_with_two_groups()
    before, last = encode_state(writer.state), store.last_position("r1")
    # another writer got there first: the store refuses the batch at its position
    intruder = writer.make(ev.GroupFailed, event_id="intruder", group_id="g1", attempt=1, reason="x")
    store.append("r1", [intruder], expected_position=last, epoch=1)
    with pytest.raises(ConcurrencyError):
        writer.append(p1[0], p2[0])
    assert encode_state(writer.state) == before and writer.diverged is not None


class _LandsThenTimesOut(MemoryEventStore):
    """A store whose next append lands and then reports the store unavailable, as a
    reply lost to a timeout does."""

    lose_reply = False

    def append(self, run_id, events, *, expected_position, epoch):  # type: ignore[no-untyped-def]
        positions = super().append(run_id, events, expected_position=expected_position, epoch=epoch)
        if self.lose_reply:
            self.lose_reply = False
            raise StoreUnavailableError("reply lost after the batch landed")
        return positions


def test_a_batch_that_landed_but_timed_out_is_folded_once_when_retried():
    """The pauses applied before the write are taken back when the store reports a
    failure, though the batch landed; the retry (same position: the store recognises
    the batch) applies them again, and the state is the log's fold, byte for byte."""
    _, plain, p1, p2 = _writer_with_two_groups()
    store = _LandsThenTimesOut()
    assert store.claim_epoch("r1") == 1
    store.append("r1", [s.event for s in plain.read("r1")], expected_position=0, epoch=1)
    writer = LogWriter(store, "r1", 1, fold(store.read("r1")))
    writer.append(p1[0], p2[0])
    before = encode_state(writer.state)
    store.lose_reply = True
    with pytest.raises(StoreUnavailableError):
        writer.append(p1[1], p2[1])
    assert encode_state(writer.state) == before  # not folded: the writer does not know
    writer.append(p1[1], p2[1])
    assert store.last_position("r1") == writer.position
    for a, b in zip(p1[2:], p2[2:]):
        writer.append(a, b)
    assert encode_state(fold(store.read("r1"))) == encode_state(writer.state)


def _bent_run(monkeypatch: pytest.MonkeyPatch, bend_pause: bool,
             groups_per_call: int = 1) -> tuple[MemoryEventStore, list[str]]:
    """A simulated run whose generators return one bad pause (or one bad commit)."""
    bent: list[str] = []
    pause, done = sim_episodes.SimEpisodeGenerator._pause, sim_episodes.SimEpisodeGenerator._done

    def bad_pause(self, req, ep):  # type: ignore[no-untyped-def]
        out = pause(self, req, ep)
        if bend_pause and not bent and out.episode is not None and out.episode.segments and ep.pauses == 2:
            f = out.episode.segments[-1]
            first = _replace(f.segments[0], start=f.segments[0].start + 1)
            flush = _replace(f, segments=[first, *f.segments[1:]])
            out = _replace(out, episode=_replace(out.episode, segments=[*out.episode.segments[:-1], flush]))
            bent.append(req.group_id)
        return out

    def bad_done(self, req, ep):  # type: ignore[no-untyped-def]
        out = done(self, req, ep)
        if not bend_pause and not bent:
            out = _replace(out, lengths=[n + 3 for n in out.lengths])
            bent.append(req.group_id)
        return out

    monkeypatch.setattr(sim_episodes.SimEpisodeGenerator, "_pause", bad_pause)
    monkeypatch.setattr(sim_episodes.SimEpisodeGenerator, "_done", bad_done)
    cfg = load_config(None, [
        "run.steps=4", "rollout.num_generators=4", f"rollout.groups_per_call={groups_per_call}",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.samples_per_group=2", "rollout.max_attempts=2"])
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=3)
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="bent", episode_turns=3))
    return store, bent


@pytest.mark.parametrize("bend_pause", [True, False], ids=["pause", "commit"])
def test_a_run_refuses_a_generators_bad_output_fails_its_group_and_goes_on(monkeypatch, bend_pause):
    store, bent = _bent_run(monkeypatch, bend_pause)
    assert len(bent) == 1
    result = Projector(store).get("bent")
    assert result.problem is None, result.problem  # the log folds: nothing bad was written
    state = result.state
    assert state.finished and state.trainer_version == 4
    failed = [e for e in (s.event for s in store.read("bent"))
              if type(e) is ev.GroupFailed and e.group_id == bent[0]]
    want = "EpisodeTurnsRecorded" if bend_pause else "GroupCommitted"
    assert failed and f"{want} group:{bent[0]}" in failed[0].reason
    assert "refused before it was written" in failed[0].reason
    assert ("segment starts at token" if bend_pause else "tokens committed but") in failed[0].reason
    # the retry resumes from what attempt 1 recorded (the pending call asked again with
    # its key) and commits: one failed attempt, not the group
    assert len(failed) == 1
    group = state.groups[bent[0]]
    assert group.attempt == 2 and group.committed_position is not None
    assert [len(r) for r in group.episode.rewards] == [3, 3]
    again = [e for e in (s.event for s in store.read("bent"))
             if type(e) is ev.EpisodeTurnsRecorded and e.group_id == bent[0] and e.attempt == 2]
    if bend_pause:  # turn 1's call was pending: asked again first, alone, same key
        assert again and not again[0].results and not again[0].flushes
        assert [c.turn for c in again[0].calls] == [1, 1]
    else:  # every turn was recorded: the retry only commits
        assert again == []


def test_a_refused_pause_fails_every_group_of_its_call_once(monkeypatch):
    """A generator call is one unit: its refused pause fails the attempt of each of its
    groups, the valid one's too (none of the call's events is written), each once, the
    reason naming the refused event; no other group of the run fails."""
    store, bent = _bent_run(monkeypatch, True, groups_per_call=2)
    assert Projector(store).get("bent").problem is None
    failed = [e for e in (s.event for s in store.read("bent")) if type(e) is ev.GroupFailed]
    first = [e for e in failed if e.attempt == 1]
    assert len(first) == 2 and bent[0] in {e.group_id for e in first}
    assert all(f"EpisodeTurnsRecorded group:{bent[0]}:" in e.reason for e in first)
    pairs = [(e.group_id, e.attempt) for e in failed]
    assert len(pairs) == len(set(pairs))  # an attempt fails once
    assert {e.group_id for e in failed} == {e.group_id for e in first}


def test_without_partial_rollouts_a_refused_commit_fails_its_group_and_the_rest_commit(monkeypatch):
    """Partial rollouts off: calls' commits share an append of their own (``controller.commits``)."""
    bent: list[str] = []
    lengths = SyntheticTimings.group_lengths

    def one_short(self, group_id, n_samples):  # type: ignore[no-untyped-def]
        out = lengths(self, group_id, n_samples)
        if not bent:
            bent.append(group_id)
            return out[:-1]  # a commit with fewer lengths than payload keys
        return out

    monkeypatch.setattr(SyntheticTimings, "group_lengths", one_short)
    cfg = load_config(None, [
        "run.steps=3", "rollout.num_generators=4", "rollout.groups_per_call=2",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", "rollout.samples_per_group=2"])
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=5)
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="short"))
    result = Projector(store).get("short")
    assert result.problem is None, result.problem
    assert result.state.finished and result.state.trainer_version == 3
    events = [s.event for s in store.read("short")]
    failed = [e for e in events if type(e) is ev.GroupFailed and e.group_id == bent[0]]
    assert failed and "must have the same non-zero length" in failed[0].reason
    # no other group failed: the batch's other commits were appended without it
    assert not [e for e in events if type(e) is ev.GroupFailed and e.group_id != bent[0]]
    assert sum(type(e) is ev.GroupCommitted for e in events) >= 12
