"""``views.trace``: a run's log as Chrome trace-event JSON, checked against the format.

Logs come from ``tests.unit.log_builder`` (hand-built, and random runs with failures,
evictions, aborts and controller restarts) in a ``MemoryEventStore``; the trace is read
back as JSON and checked by ``tests.trace_check`` (B/E pairs, time order per track,
flows s t* f inside slices), then for what it must show.
"""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from events.codec import encode
from events.memory_store import MemoryEventStore
from tests.trace_check import check_trace
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run, stream_random_run
from views.trace import TraceBuilder
from views.trace_file import parse_steps, write_trace
from views.trace_writer import TraceWriter

VIEWS = Path(__file__).resolve().parents[2] / "views"


def store_of(b: LogBuilder) -> MemoryEventStore:
    store = MemoryEventStore()
    store.claim_epoch(b.run_id)
    for s in b.events:
        store.append_raw(b.run_id, encode(s.event), event_type=type(s.event).__name__,
                         event_id=s.event.event_id)
    return store


def trace_of(b: LogBuilder, steps: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    out = io.BytesIO()
    write_trace(store_of(b), b.run_id, out, steps)
    return json.loads(out.getvalue())


def small_log() -> LogBuilder:
    """g1, g2 on generator-0 at once; g3 fails then is evicted; one step consumes g1, g2."""
    b = LogBuilder(run_id="r-small", window=1, groups_per_step=2).start()
    b.admit("g1", generator="generator-0").admit("g2", generator="generator-0")
    b.admit("g3", generator="generator-1").fail("g3", "generator-1 lost")
    b.admit("g3", generator="generator-1")
    b.commit("g1").commit("g2").commit("g3")
    b.begin_step().microbatch(["g1"]).microbatch(["g2"]).finish_step().publish()
    b.evict("g3", reason="lag 2 past window 1", lag=2)
    return b


def test_a_small_run_draws_tracks_slices_and_flows() -> None:
    found = check_trace(trace_of(small_log()))
    names = set(found.names.values())
    assert {"run r-small", "trainer", "publish / checkpoint", "controller", "generator-0",
            "generator-1", "slot 0", "slot 1"} <= names
    # two groups generating at once on one generator take two slots
    gen0 = next(pid for (pid, tid), n in found.names.items() if n == "generator-0" and tid is None)
    assert sorted(n for (pid, _), s in found.slices.items() if pid == gen0 for *_, n in s) == [
        "generate g1", "generate g2"]
    trainer = [n for _, _, n in sorted(found.slices[(1, 1)], key=lambda s: (s[0], -s[1]))]
    assert trainer == ["step 0", "microbatch 0", "microbatch 1", "finish"]
    # g1 and g2: generator -> microbatch -> finish; g3 (second attempt): generator -> evict
    assert len(found.flows) == 3
    ends = sorted(found.track(p[-1][1], p[-1][2]) for p in found.flows.values())
    assert ends == ["controller", "trainer", "trainer"]
    for points in found.flows.values():
        assert found.track(points[0][1]).startswith("generator-")
    assert "generate g3" in [n for s in found.slices.values() for *_, n in s]
    admits = [i["name"] for i in found.instants if i["name"].startswith("admit")]
    assert admits == ["admit 3", "admit 1"]  # consecutive admissions are one decision


def test_a_group_admitted_while_its_step_waits_flows_forward_in_time() -> None:
    """A step that waits for data trains groups admitted after its previous microbatch
    (an episode run does it every few steps). The microbatch slice starts at that
    previous point, and the flow's step sat at the slice's start: before the group's
    own admission, where its flow starts (a crash-resumed calculator run's trace failed
    the format check there)."""
    b = LogBuilder(run_id="r-wait", window=1, groups_per_step=2).start()
    b.admit("g1", generator="generator-0").commit("g1")
    b.begin_step().microbatch(["g1"])
    b.admit("g2", generator="generator-0").commit("g2")  # while the step waits for it
    b.microbatch(["g2"]).finish_step()
    found = check_trace(trace_of(b))  # every flow in time order, each point in a slice
    assert len(found.flows) == 2


def test_an_episodes_records_are_small_instants_on_its_generate_slice() -> None:
    """Each pause's parts (tokens, calls, results) were instants on the controller's
    track carrying every segment and result: 99 % of an episode run's trace file."""
    b = LogBuilder(run_id="r-ep", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1", generator="generator-0").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 0.25, False, 4), 1: (1, 0.5, True, 0)})
    b.flush("g1", {0: (3, 4)}, kind="observation", version=None, turn=1)
    b.flush("g1", {0: (7, 2)}, turn=2).request("g1", {0: (2, "c")})
    b.complete("g1", {0: (2, 0.5, True, 0)})
    b.commit("g1", rewards=[0.75, 0.5], lengths=[9, 5]).train_step(["g1"])
    found = check_trace(trace_of(b))
    drawn = [(found.track(i["pid"], i["tid"]), i["name"], i["args"]) for i in found.instants
             if i["name"] in ("model tokens", "observation tokens", "calls", "results")]
    assert [(track, name) for track, name, _ in drawn] == [
        ("slot 0", "model tokens"), ("slot 0", "calls"), ("slot 0", "results"),
        ("slot 0", "observation tokens"), ("slot 0", "model tokens"), ("slot 0", "calls"),
        ("slot 0", "results")]
    assert drawn[0][2] == {"attempt": 1, "samples": 2, "tokens": 8, "turns": [1], "weight_version": 0}
    assert drawn[2][2] == {"attempt": 1, "results": 2, "ended": 1, "turns": [1], "reward": 0.75}
    assert not [i for i in found.instants if i["name"] in (
        "SegmentsRecorded", "EnvStepsRequested", "EnvStepsCompleted")]


def test_counters_follow_the_buffer_and_in_flight_groups() -> None:
    found = check_trace(trace_of(small_log()))
    series = [(v["buffered"], v["in flight"]) for _, v in found.counters["groups"]]
    # one value per run of same-type events: 3 admitted, g3 failed, re-admitted, 3
    # commits, two microbatches' claims, the eviction
    assert series == [(0, 3), (0, 2), (0, 3), (3, 0), (1, 0), (0, 0)]
    [(_, lag)] = found.counters["lag"]
    assert lag == {"mean": 0.0, "max": 0}
    assert found.counters["trainer_version"][-1][1] == {"version": 1}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_runs_with_failures_aborts_and_restarts_are_well_formed(seed: int) -> None:
    b = random_run(seed, 40, p_fail=0.1, p_abort=0.1, p_restart=0.05)
    found = check_trace(trace_of(b))
    state = b.fold()
    consumed = [g for g in state.groups.values() if g.consumed_step is not None]
    # every consumed group's flow runs from a generator to the trainer's finish
    to_trainer = [p for p in found.flows.values() if found.track(p[-1][1], p[-1][2]) == "trainer"]
    assert len(to_trainer) == len(consumed)
    steps = [n for *_, n in found.slices[(1, 1)] if n.startswith("step ")]
    assert len(steps) == len(state.steps)


def test_a_live_log_ends_with_what_is_open() -> None:
    b = LogBuilder(run_id="r-live", groups_per_step=2).start()
    b.admit("g1", generator="generator-0").admit("g2", generator="generator-0").commit("g1")
    b.begin_step().microbatch(["g1"])
    doc = trace_of(b)
    found = check_trace(doc)  # still: every begin has its end
    ends = [e for e in doc["traceEvents"] if e["ph"] == "E"]
    assert sum(1 for e in ends if e.get("args", {}).get("open")) == 2  # g2's generate, the step
    assert [n for *_, n in found.slices[(1, 3)] if n.startswith("open at end")] == [
        "open at end (1 groups)"]


def test_steps_window_draws_only_those_steps_and_stops_reading() -> None:
    b = random_run(5, 30, p_abort=0.0, p_restart=0.0)
    doc = trace_of(b, (10, 12))
    found = check_trace(doc)
    steps = sorted(n for *_, n in found.slices[(1, 1)] if n.startswith("step "))
    assert steps == ["step 10", "step 11", "step 12"]
    assert doc["metadata"]["last_position"] < b.last_position
    # groups generating when step 10 began are drawn from their admission
    begun = [e for e in doc["traceEvents"] if e["ph"] == "B" and e["args"].get("before_window")]
    assert begun


def test_parse_steps() -> None:
    assert parse_steps("") == (None, None)
    assert parse_steps("3:9") == (3, 9) and parse_steps("3:") == (3, None)
    assert parse_steps(":9") == (None, 9) and parse_steps("4") == (4, 4)
    for bad in ("a:b", "9:3", "-1:2"):
        with pytest.raises(ValueError, match=f"steps '{bad}'"):
            parse_steps(bad)


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


def _traced_peak(steps: int) -> tuple[int, int]:
    """Peak bytes allocated by the trace code (not the log generator) over a streamed run."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    builder = TraceBuilder(TraceWriter(_Discard()), "big")
    events = 0
    only_views = [tracemalloc.Filter(True, str(VIEWS / "*"))]
    peak = 0
    for chunk in stream_random_run(7, steps, groups_per_step=8, window=2, microbatch_groups=2):
        for stored in chunk:
            builder.feed(stored.position, stored.event)
            events += 1
            if events % 5000 == 0:  # a snapshot walks every traced block: now and then
                builder.w.flush()  # the batch of entries is bounded anyway: leave it out
                snap = tracemalloc.take_snapshot().filter_traces(only_views)
                peak = max(peak, sum(stat.size for stat in snap.statistics("filename")))
    builder.finish()
    tracemalloc.stop()
    return events, peak


def test_memory_stays_bounded_on_a_long_log() -> None:
    short_events, short_peak = _traced_peak(400)
    long_events, long_peak = _traced_peak(1600)
    assert long_events > 3.5 * short_events
    # what the trace keeps is the live groups (and a batch of entries): not the log
    assert 0 < long_peak < 1.5 * short_peak + 64_000, (short_peak, long_peak)
