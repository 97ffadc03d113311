"""Durable episodes through the real controller loop (in-process workers, memory log).

The calculator task with partial rollouts on: every model turn is a ``SegmentsRecorded``
(kind model), every env call an ``EnvStepsRequested`` before it and an
``EnvStepsCompleted`` after it, every observation a kind observation segment. The log
must fold and audit clean, and a generator that loses a group mid-episode must see it
resumed at its last recorded turn: recorded turns served, recorded results not made
again, an intent without a result re-issued with its key.
"""

from __future__ import annotations

from collections import Counter

from controller.core.turns import expanded
from controller.retraining import microbatch_ref
from events import schema as ev
from tests.unit.test_loop_inprocess import Harness, make_config
from workers.service import GeneratorWorker, TrainerWorker

EPISODES = ("task.name=\"calculator\"", "rollout.partial.enabled=true", "model.context_len=32",
            "sampling.max_new_tokens=6")


class LosingGenerator(GeneratorWorker):
    """Forgets a group (as a restarted process would) once the log holds ``after`` of its
    events."""

    lose: frozenset[str] = frozenset()
    after = 2

    def generate_groups(self, reqs):
        for req in reqs:
            if req.group_id in self.lose and req.attempt == 1 and req.flushes == self.after:
                held = self.inflight.held.pop(req.group_id, None)
                if held is not None:
                    held.channel.close()
        return super().generate_groups(reqs)


class RecordingTrainer(TrainerWorker):
    """Keeps every microbatch reference the controller sent."""

    refs: list

    def train_microbatch(self, ref):
        self.refs.append(ref)
        return super().train_microbatch(ref)


def _by_group(events, gid):
    return [e for e in events if getattr(e, "group_id", None) == gid]


def test_episodes_record_turns_calls_and_results_in_write_ahead_order(tmp_path):
    refs: list = []
    h = Harness(make_config("run.steps=2", *EPISODES), tmp_path, trainer=RecordingTrainer, refs=refs)
    assert h.run() == "completed"
    h.check_log()
    events = h.events()
    commits = [e for e in events if isinstance(e, ev.GroupCommitted)]
    assert commits
    for commit in commits:
        mine = _by_group(events, commit.group_id)
        asked = [e for e in mine if isinstance(e, ev.EnvStepsRequested)]
        done = [e for e in mine if isinstance(e, ev.EnvStepsCompleted)]
        assert asked and len(asked) == len(done)
        for intent, result in zip(asked, done):
            # the model turn before its intent, the intent before its result
            model = [e for e in mine[:mine.index(intent)] if isinstance(e, ev.SegmentsRecorded)
                     and e.kind == "model"]
            assert {(s.sample, s.turn) for m in model for s in m.segments} >= {
                (c.sample, c.turn) for c in intent.calls}
            assert mine.index(intent) < mine.index(result)
            assert [(c.sample, c.turn) for c in intent.calls] == [(r.sample, r.turn) for r in result.results]
        per_sample = Counter()
        for result in done:
            for r in result.results:
                per_sample[r.sample] += r.reward
        assert [per_sample[i] for i in range(len(commit.rewards))] == commit.rewards
        group = h.writer.state.groups[commit.group_id]
        assert group.episode is not None and [sum(r) for r in group.episode.rewards] == commit.rewards
    # the trainer got per-turn advantages, and re-training rebuilds the very same references
    state = h.writer.state
    trained = [mb for s in state.finished_steps() for mb in s.microbatches]
    assert len(refs) == len(trained)
    for ref, ids in zip(refs, trained):
        assert ref == microbatch_ref(state, ids)
        assert len(ref.turn_advantages) == len(ref.payload_keys)  # one run per episode


def test_a_deduplicating_envs_results_ride_with_the_next_turns_intent(tmp_path):
    # the calculator deduplicates (it is pure): one pause per turn, the results of turn t
    # in the append of turn t + 1's intent, the last results in a pause of their own
    h = Harness(make_config("run.steps=1", *EPISODES), tmp_path)
    batches: list[list] = []
    h.writer.listeners.append(lambda batch, state: batches.append(list(batch)))
    assert h.run() == "completed"
    h.check_log()
    for commit in h.events(ev.GroupCommitted):
        gid = commit.group_id
        pauses = [[e for e in expanded(b) if isinstance(e, (ev.EnvStepsRequested, ev.EnvStepsCompleted))
                   and e.group_id == gid] for b in batches]
        pauses = [p for p in pauses if p]
        # each pause is ONE appended event, whatever it stands for
        appended = [[type(e) for e in b if getattr(e, "group_id", None) == gid
                     and not isinstance(e, (ev.RolloutAdmitted, ev.GroupCommitted))] for b in batches]
        assert all(len(a) <= 1 for a in appended), appended
        assert sum(a == [ev.EpisodeTurnsRecorded] for a in appended) == len(pauses)
        kinds = [[type(e).__name__ for e in p] for p in pauses]
        assert kinds[0] == ["EnvStepsRequested"] and kinds[-1] == ["EnvStepsCompleted"], kinds
        assert all(k == ["EnvStepsCompleted", "EnvStepsRequested"] for k in kinds[1:-1]), kinds
        assert len(pauses) == sum(k.count("EnvStepsRequested") for k in kinds) + 1


def test_a_group_lost_mid_episode_resumes_at_its_last_recorded_turn(tmp_path):
    # after 2 events (turn 1's model segments + intent) the worker forgets the group: the
    # calls were asked for and never answered; attempt 2 serves turn 1 from the log and
    # re-issues those calls with their keys (the calculator deduplicates: it is pure)
    h = Harness(make_config("run.steps=1", *EPISODES), tmp_path, generator=LosingGenerator,
                lose=frozenset({"g000001"}))
    assert h.run() == "completed"
    h.check_log()
    mine = _by_group(h.events(), "g000001")
    failed = [e for e in mine if isinstance(e, ev.GroupFailed)]
    assert failed and "does not hold it after 2 recorded events" in failed[0].reason
    first = [e for e in mine if getattr(e, "attempt", 0) == 1]
    second = [e for e in mine if getattr(e, "attempt", 0) == 2]
    turn1 = {(s.sample, s.turn) for e in first if isinstance(e, ev.SegmentsRecorded) for s in e.segments}
    again = {(s.sample, s.turn) for e in second if isinstance(e, ev.SegmentsRecorded)
             and e.kind == "model" for s in e.segments}
    assert turn1 and not (turn1 & again), "a recorded model turn was sampled again"
    (asked1,) = [e for e in first if isinstance(e, ev.EnvStepsRequested)]
    reissued = [e for e in second if isinstance(e, ev.EnvStepsRequested)][0]
    assert reissued.calls == asked1.calls  # same keys, same requests
    (commit,) = [e for e in mine if isinstance(e, ev.GroupCommitted)]
    assert commit.attempt == 2



def test_a_pending_group_keeps_what_it_resumes_from_until_it_has_started():
    # a call runs its groups in order up to the first pause: a re-admitted group behind
    # one that paused has not started, so its next request still carries the recorded
    # flushes (without them it would sample again what the log holds); a paused one's
    # worker holds them already
    from controller.core.state import RunState
    from controller.partial import next_requests
    from workers.api import GenerationOutcome, GenerationRequest, SegmentFlush

    recorded = [SegmentFlush(weight_version=0, segments=[ev.Segment(sample=0, start=0, length=3, key="k")])]
    reqs = [GenerationRequest(group_id=g, attempt=2, prompt_index=0, n_samples=1, seed=0,
                              resume=recorded) for g in ("g1", "g2", "g3")]
    outs = [GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                              weight_version_end=0, status=s) for s in ("flushed", "pending", "done")]
    flushed, pending = next_requests(RunState(), reqs, outs)
    assert (flushed.group_id, flushed.resume) == ("g1", [])
    assert (pending.group_id, pending.resume) == ("g2", recorded)
