"""Partial rollouts through the real controller loop (in-process workers, memory log).

Every group is flushed several times (``segment_tokens = 1``); the log must fold and
audit clean, each flush must precede its group's commit, committed groups' segment
rows must be gone from the data plane, and a generator that loses a group mid-way must
see it re-admitted and resumed from what was recorded -- never sampled again.
"""

from __future__ import annotations

from events import schema as ev
from tests.unit.test_loop_inprocess import RUN, Harness, make_config
from workers.service import GeneratorWorker

PARTIAL = ("rollout.partial.enabled=true", "rollout.partial.segment_tokens=1")


class LosingGenerator(GeneratorWorker):
    """Forgets a group (as a restarted process would) after its first recorded flush."""

    lose: frozenset[str] = frozenset()

    def generate_groups(self, reqs):
        for req in reqs:
            if req.group_id in self.lose and req.attempt == 1 and req.flushes == 1:
                self.inflight.held.pop(req.group_id, None)
        return super().generate_groups(reqs)


def _run(h: Harness) -> str:
    """Run, keeping the data plane readable afterwards (closing it empties it)."""
    h.workers.dataplane.close = lambda: None  # type: ignore[method-assign]
    return h.run()


def _segment_rows(h: Harness) -> list[str]:
    return [k for k in h.workers.dataplane.list(RUN) if _is_segment(k)]


def _is_segment(key: str) -> bool:
    """A segment row's key ends in ``/k{index}`` (a final row's in ``/s{sample}``)."""
    return key.rsplit("/", 1)[-1].startswith("k")


def test_partial_rollouts_record_flushes_and_commit_them(tmp_path):
    cfg = make_config("run.steps=3", "rollout.groups_per_call=2", *PARTIAL)
    h = Harness(cfg, tmp_path)
    assert _run(h) == "completed"
    h.check_log()
    flushes = h.events(ev.SegmentsRecorded)
    assert flushes, "segment_tokens = 1 must flush"
    log = h.events()
    committed_at = {e.group_id: i for i, e in enumerate(log) if isinstance(e, ev.GroupCommitted)}
    for f in flushes:
        assert log.index(f) < committed_at.get(f.group_id, len(log))
        assert f.kind == "model" and f.weight_version is not None
    assert any(k.endswith("/s0") for k in h.workers.dataplane.list(RUN))  # final rows kept
    assert not _segment_rows(h)  # committed groups' scratch rows were deleted
    assert not h.writer.state.inflight or all(
        g in h.writer.state.admitted or g in {x.group_id for x in h.writer.state.failed_groups()}
        for g in h.writer.state.inflight
    )


def test_a_lost_group_is_resumed_from_its_recorded_tokens(tmp_path):
    cfg = make_config("run.steps=2", *PARTIAL)
    h = Harness(cfg, tmp_path, generator=LosingGenerator, lose=frozenset({"g000001"}))
    assert _run(h) == "completed"
    h.check_log()
    failed = [e for e in h.events(ev.GroupFailed) if e.group_id == "g000001"]
    assert failed and "does not hold it after 1 recorded flushes" in failed[0].reason
    flushes = [e for e in h.events(ev.SegmentsRecorded) if e.group_id == "g000001"]
    first, resumed = [f for f in flushes if f.attempt == 1], [f for f in flushes if f.attempt == 2]
    assert len(first) == 1 and resumed
    recorded = {s.sample: s.start + s.length for s in first[0].segments}
    for seg in resumed[0].segments:  # attempt 2 starts where attempt 1's record ends
        assert seg.start == recorded.get(seg.sample, 0)
    (commit,) = [e for e in h.events(ev.GroupCommitted) if e.group_id == "g000001"]
    assert commit.attempt == 2
    rows = h.workers.dataplane.get(RUN, commit.payload_keys)
    for seg in first[0].segments:  # the final rows hold the recorded tokens, versioned
        row = rows[seg.sample]
        p = int(row["prompt_len"])
        assert row["token_versions"][p:p + seg.length].eq(first[0].weight_version).all()
        assert commit.lengths[seg.sample] >= seg.length


class RowLosingGenerator(LosingGenerator):
    """Also loses the group's recorded segment rows (a data plane without its spill)."""

    def generate_groups(self, reqs):
        plane = self.generator.dataplane
        for req in reqs:
            if req.group_id in self.lose and req.attempt == 1 and req.flushes == 1:
                prefix = f"{RUN}/{req.group_id}/a1/"
                plane.clear(RUN, [k for k in plane.list(RUN) if k.startswith(prefix) and "/k" in k])
        return super().generate_groups(reqs)


def test_a_group_whose_recorded_rows_are_gone_restarts_from_the_prompt(tmp_path):
    cfg = make_config("run.steps=2", *PARTIAL)
    h = Harness(cfg, tmp_path, generator=RowLosingGenerator, lose=frozenset({"g000001"}))
    assert _run(h) == "completed"
    h.check_log()
    (drop,) = h.events(ev.SegmentsDropped)
    (recorded,) = [e for e in h.events(ev.SegmentsRecorded) if e.group_id == "g000001" and e.attempt == 1]
    lost = [s.key for s in recorded.segments]
    assert drop.group_id == "g000001" and drop.attempt == 2 and drop.keys == lost
    assert lost[0] in drop.reason and "restart from the prompt" in drop.reason
    failed = [e for e in h.events(ev.GroupFailed) if e.group_id == "g000001"]
    assert [f.attempt for f in failed] == [1, 2] and "MissingPayloadError" in failed[1].reason
    third = [e for e in h.events(ev.SegmentsRecorded) if e.group_id == "g000001" and e.attempt == 3]
    assert third and all(s.start == 0 for s in third[0].segments)  # from the prompt
    (commit,) = [e for e in h.events(ev.GroupCommitted) if e.group_id == "g000001"]
    assert commit.attempt == 3


class _FlushWaitsForRefit:
    """The generator's data plane, whose first segment ``put`` waits until a weight
    update is queued for the step boundary: the flush is inside the group's generating
    window, past its last boundary, so the update is pending over it by construction."""

    def __init__(self, plane, weights) -> None:
        self._plane = plane
        self._weights = weights
        #: the version each held flush saw waiting (None: no update came)
        self.seen: list[int | None] = []

    def put(self, partition, keys, *args, **kwargs):
        if not self.seen and _is_segment(keys[0]):
            self.seen.append(self._weights.wait_for_pending(timeout_s=120))
        return self._plane.put(partition, keys, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._plane, name)


class RefitDuringFlushGenerator(GeneratorWorker):
    """generator-0 holds its first flush until a publish waits on it; the others run."""

    def __init__(self, spec, name, dataplane) -> None:
        super().__init__(spec, name, dataplane)
        if name == "generator-0":
            gen = self.generator
            gen.dataplane = self.held = _FlushWaitsForRefit(gen.dataplane, gen.weights)


def test_a_refit_waiting_on_a_flush_does_not_deadlock_it(tmp_path):
    # A weight update that must wait for the group's next step boundary used to wait
    # holding the worker's fence; the flush it waited for writes its rows under that
    # fence first. Each waited on the other: the run stalled with a publish and a
    # generator call in flight (the resumed chaos runs saw it at random).
    # ready_first: step 1 fills from generator-1's groups while generator-0's waits
    cfg = make_config("run.steps=2", "staleness.selection=ready_first", *PARTIAL)
    h = Harness(cfg, tmp_path, generator=RefitDuringFlushGenerator)
    held = h.workers.generators[0].handle.obj.held
    try:
        assert _run(h) == "completed"
    finally:
        # a run that deadlocked anyway: let the worker threads go, or exit waits on them
        h.workers.generators[0].handle.obj.generator.weights.at_step_boundary()
    assert held.seen == [1]  # the publish of v1 was waiting on the held flush
    h.check_log()
    assert h.writer.state.trainer_version == 2
