"""What the dashboard shows of one run: a fold of its log into JSON-ready pieces.

``RunView`` folds the log with the reducer (so every invariant is checked: that is the
page's audit status) and keeps, besides the state, what the page draws: a row per
ended step (reward, lag, times), buffer / in-flight samples and the newest events. The
history comes from one fold (``views.source.fold``, observers at each step's end); live
events then go through ``apply`` one by one as the stream delivers them.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from controller.core.errors import InvariantViolation
from controller.core.reducer import apply_event
from controller.core.state import RunState, StepRecord, initial_state
from controller.core.turns import parts
from events import schema as ev
from events.codec import full_form
from controller.projector import Projection

#: samples of buffer / in-flight kept for the chart
SERIES_POINTS = 2000
#: newest events kept for the table (older ones come from /api/.../events)
RECENT_EVENTS = 200


#: fields every event has (shown in their own columns, or not at all)
_COMMON = ("event_id", "epoch", "ts", "schema_version")
#: an event's own fields are cut to this many characters in the table
DETAILS_CHARS = 400


def event_row(position: int, event: Any) -> dict[str, Any]:
    """One line of the event table: position, time, type, the event's own fields."""
    # every field, as ``tail`` prints it: the wire leaves defaults out of an event's values
    own = {k: full_form(getattr(event, k)) for k in event.__struct_fields__ if k not in _COMMON}
    details = msgspec.json.encode(own).decode()[1:-1].replace('","', '", "')
    if len(details) > DETAILS_CHARS:
        details = details[:DETAILS_CHARS] + "..."
    return {"position": position, "ts": event.ts, "type": type(event).__name__,
            "epoch": event.epoch, "details": details,
            "group": getattr(event, "group_id", None), "step": getattr(event, "step", None)}


def step_row(state: RunState, rec: StepRecord) -> dict[str, Any]:
    lags = [lag for g in rec.group_ids if (lag := state.groups[g].lag) is not None]
    rewards = [sum(r) / len(r) for g in rec.group_ids if (r := state.groups[g].rewards)]
    return {
        "step": rec.step, "status": rec.status.value, "trainer_version": rec.trainer_version,
        "begun_ts": rec.begun_ts, "ended_ts": rec.ended_ts, "groups": len(rec.group_ids),
        "reward": sum(rewards) / len(rewards) if rewards else None,
        "lag_mean": sum(lags) / len(lags) if lags else None,
        "lag_max": max(lags) if lags else None,
        "abort_reason": rec.abort_reason,
    }


class RunView:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.state = initial_state()
        self.problem: str | None = None
        self.steps: list[dict[str, Any]] = []
        self.series: deque[tuple[float, int, int]] = deque(maxlen=SERIES_POINTS)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self.last_ts = 0.0

    # -- history -------------------------------------------------------------------------

    def watches(self) -> dict[type, Any]:
        """An observer of the history's fold (``controller.core.fold.Observer``): a step
        row and a buffer sample at each step's end."""
        return {ev.StepFinished: self._ended, ev.StepAborted: self._ended}

    def _ended(self, event: Any, position: int, state: RunState) -> None:
        self.steps.append(step_row(state, state.steps[event.step]))
        self.series.append((event.ts, len(state.buffer), len(state.admitted)))

    def loaded(self, result: Projection, tail: list[dict[str, Any]]) -> None:
        """The history's fold is done; ``tail`` are the table rows of its newest events."""
        self.state = result.state
        self.problem = None if result.problem is None else result.problem.describe()
        self.last_ts = result.last_ts
        self.recent.extend(tail)

    # -- live --------------------------------------------------------------------------

    def apply(self, batch: list[tuple[int, Any]]) -> dict[str, Any]:
        """Fold newly read events; returns the update the page merges."""
        rows, steps = [], []
        for position, event in batch:
            for part in parts(event):  # a pause's row is the rows of its parts
                row = event_row(position, part)
                self.recent.append(row)
                rows.append(row)
            self.last_ts = event.ts
            if self.problem is not None:
                continue  # the state stops at the first problem; the table goes on
            try:
                apply_event(self.state, event, position)
            except InvariantViolation as err:
                self.problem = str(err)
                continue
            if isinstance(event, (ev.StepFinished, ev.StepAborted)):
                row_ = step_row(self.state, self.state.steps[event.step])
                self.steps.append(row_)
                steps.append(row_)
        point = (self.last_ts, len(self.state.buffer), len(self.state.admitted))
        self.series.append(point)
        return {"kind": "update", **self.summary(), "steps": steps, "series": [point],
                "events": rows}

    # -- what the page gets ------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        s = self.state
        open_step = s.open_step
        return {
            "run_id": self.run_id, "position": s.position, "last_ts": self.last_ts,
            "trainer_version": s.trainer_version, "weight_version": s.weight_version,
            "buffer": len(s.buffer), "in_flight": len(s.admitted), "finished": s.finished,
            "epoch": s.epoch, "window_versions": s.window_versions,
            "open_step": None if open_step is None else {
                "step": open_step.step, "begun_ts": open_step.begun_ts,
                "microbatches": len(open_step.microbatches)},
            "audit": {"ok": self.problem is None, "position": s.position,
                      "text": self.problem or f"every invariant holds through position {s.position}"},
        }

    def snapshot(self) -> dict[str, Any]:
        return {"kind": "snapshot", **self.summary(), "steps": self.steps,
                "series": list(self.series), "events": list(self.recent)}
