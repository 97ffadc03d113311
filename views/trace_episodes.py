"""An episode's records in the trace: small instants on its group's generate slice.

A multi-turn group records every pause of its episodes (``docs/agents.md``): the model
turns' and observations' tokens (``SegmentsRecorded``), the intent of the calls
(``EnvStepsRequested``) and their results (``EnvStepsCompleted``). They are the
group's progress, drawn where the group generates, one instant each with a summary of
what it holds. Dumped whole on the controller's track instead, they buried the
controller's decisions and were 99 % of an episode run's trace file (5.1 MB of 5.2 for
40 calculator steps, every segment and result of every pause as an instant's args).
"""

from __future__ import annotations

from typing import Any

from events import schema as ev

#: the records drawn on their group's slice
EPISODE_RECORDS = (ev.SegmentsRecorded, ev.EnvStepsRequested, ev.EnvStepsCompleted)


def episode_instant(e: ev.SegmentsRecorded | ev.EnvStepsRequested | ev.EnvStepsCompleted,
                    ) -> tuple[str, dict[str, Any]]:
    """The instant's name and its args: counts and turns, never the per-sample lists."""
    if isinstance(e, ev.SegmentsRecorded):
        return f"{e.kind} tokens", {
            "attempt": e.attempt, "samples": len(e.segments),
            "tokens": sum(s.length for s in e.segments),
            "turns": sorted({s.turn for s in e.segments}), "weight_version": e.weight_version}
    if isinstance(e, ev.EnvStepsRequested):
        return "calls", {"attempt": e.attempt, "calls": len(e.calls),
                         "turns": sorted({c.turn for c in e.calls})}
    return "results", {
        "attempt": e.attempt, "results": len(e.results),
        "ended": sum(1 for r in e.results if r.ended),
        "turns": sorted({r.turn for r in e.results}),
        "reward": sum(r.reward for r in e.results)}
