"""Checks of a Chrome trace-event file against the format's rules (used by the trace tests).

``check_trace`` returns what it found (slices per track, flows) after asserting:
every ``B`` has its ``E`` on the same track (slices nest: a stack per track) and every
``X`` a non-negative ``dur``; timestamps never go back within a track in file order;
each flow has one start, then steps, then one finish, in time order, and each point lies
inside a slice of its track (the slice it binds to).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Found:
    names: dict[tuple[int, int | None], str] = field(default_factory=dict)
    #: (pid, tid) -> [(start, end, name)]
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = field(
        default_factory=lambda: defaultdict(list))
    #: flow id -> [(phase, pid, tid, ts)]
    flows: dict[int, list[tuple[str, int, int, float]]] = field(
        default_factory=lambda: defaultdict(list))
    instants: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, list[tuple[float, dict[str, float]]]] = field(
        default_factory=lambda: defaultdict(list))

    def track(self, pid: int, tid: int | None = None) -> str:
        return self.names.get((pid, tid), "?")


def check_trace(doc: dict[str, Any]) -> Found:
    found = Found()
    open_: dict[tuple[int, int], list[tuple[float, str]]] = defaultdict(list)
    last: dict[tuple[int, int], float] = {}
    for i, e in enumerate(doc["traceEvents"]):
        ph = e["ph"]
        if ph == "M":
            if e["name"] in ("process_name", "thread_name"):
                found.names[(e["pid"], e.get("tid"))] = e["args"]["name"]
            continue
        track = (e["pid"], e.get("tid", 0))
        ts = e["ts"]
        assert ts >= last.get(track, float("-inf")), f"entry {i} {e} goes back in time on {track}"
        last[track] = ts
        if ph == "B":
            open_[track].append((ts, e["name"]))
        elif ph == "E":
            assert open_[track], f"entry {i}: an E with no open B on {track}"
            start, name = open_[track].pop()
            found.slices[track].append((start, ts, name))
        elif ph == "X":
            assert e["dur"] >= 0, e
            found.slices[track].append((ts, ts + e["dur"], e["name"]))
        elif ph == "i":
            found.instants.append(e)
        elif ph == "C":
            found.counters[e["name"]].append((ts, e["args"]))
        elif ph in "stf":
            found.flows[e["id"]].append((ph, e["pid"], e["tid"], ts))
        else:
            raise AssertionError(f"entry {i}: unexpected phase {ph!r}")
    unclosed = {t: s for t, s in open_.items() if s}
    assert not unclosed, f"slices begun and never ended: {unclosed}"
    for flow_id, points in found.flows.items():
        phases = "".join(p[0] for p in points)
        assert phases[0] == "s" and phases[-1] == "f" and set(phases[1:-1]) <= {"t"}, (
            f"flow {flow_id} is {phases!r}, not s t* f")
        times = [p[3] for p in points]
        assert times == sorted(times), f"flow {flow_id} goes back in time: {points}"
        for _, pid, tid, ts in points:
            assert any(a <= ts < b for a, b, _ in found.slices[(pid, tid)]), (
                f"flow {flow_id}'s point at {ts} on {(pid, tid)} is in no slice")
    return found
