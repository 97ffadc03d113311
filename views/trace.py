"""A run's log as a Chrome trace (Perfetto, chrome://tracing): ``rl-controller trace``.

Tracks (processes and threads in the viewer)::

    run RUN            trainer          step N [ microbatch 0 | microbatch 1 | finish ]
                       publish/ckpt     publish vN | checkpoint vN
                       controller       decisions: admit k, begin step, evict g, abort ...
                       counters         groups buffered / in flight, lag, reward, version
    generator-0        slot 0, 1, ...   generate gX (admitted -> committed or failed),
                                        an episode's records as instants in it
    generator-1        ...

A generator serves several groups at once (a call carries ``groups_per_call``), and a
thread's slices must nest, so each group takes the generator's first free *slot* while
it generates. Each group's life is a flow (an arrow) across tracks: its generate slice
(admitted -> committed), the microbatch that claimed it (again after an aborted step),
then the finish of the step that consumed it, or the controller's eviction. Failed
attempts end their slice with the reason; no flow starts for them.

The builder is a fold over events with bounded memory: it keeps only live groups (in
flight, buffered or claimed), the open step and a few cursors, and writes entries as it
goes (``views.trace_writer``). ``--steps A:B`` writes from step A's begin through step
B's end (groups already in flight then are drawn from their admission) and stops
reading there.
"""

from __future__ import annotations

from typing import Any, Callable

from events import schema as ev
from views.trace_episodes import EPISODE_RECORDS, episode_instant
from views.trace_tracks import CONTROLLER, PUBLISH, RUN_PID, TRAINER, Tracks
from views.trace_writer import INSIDE_US, TraceWriter

#: the generator name for admissions that did not record one (older logs)
UNKNOWN_GENERATOR = "generators"


class _Group:
    __slots__ = ("attempt", "pid", "slot", "admitted", "version", "reward", "flow", "flow_at",
                 "drawn")

    def __init__(self, attempt: int, pid: int, slot: int, admitted: float) -> None:
        self.attempt = attempt
        self.pid = pid
        self.slot = slot  # -1 once committed (the slot is free again)
        self.admitted = admitted
        self.version = 0  # weight_version_start, once committed
        self.reward = 0.0  # mean over its samples, once committed
        self.flow = 0  # its flow's id once the flow started (0: not started)
        self.flow_at = 0.0  # where its flow started (its later points come after)
        self.drawn = False  # its generate slice was begun in the trace


class _Step:
    __slots__ = ("step", "base", "cursor", "claimed")

    def __init__(self, step: int, base: int, begun: float) -> None:
        self.step = step
        self.base = base
        self.cursor = begun  # where the next child slice (microbatch, finish) starts
        self.claimed: list[str] = []


class TraceBuilder:
    """Feed it the log's events in order (``feed``), then ``finish``."""

    def __init__(self, writer: TraceWriter, run_id: str,
                 steps: tuple[int | None, int | None] = (None, None)) -> None:
        self.w = writer
        self.run_id = run_id
        self.first_step, self.last_step = steps
        self.drawing = self.first_step is None
        self.t0: float | None = None
        self.now = 0.0
        self.groups: dict[str, _Group] = {}
        self.tracks = Tracks(writer)
        self.step: _Step | None = None
        self.finished_at: dict[int, float] = {}  # trainer_version -> its finish (us)
        self.publish_cursor = 0.0
        self.marker_end = 0.0
        self.buffered = self.in_flight = 0
        self.shown: tuple[int, int] | None = None
        self.dirty_at: float | None = None
        self.last_kind: type | None = None
        self.admits: list[tuple[float, str, int]] = []
        self.next_flow = 1
        self.events = 0
        self.first_position = self.last_position = 0
        #: the newest step begun in what was read (-1: none), to say what a window missed
        self.newest_step = -1
        self.handlers: dict[type, Callable[[Any, float], bool | None]] = {
            ev.RunStarted: self._run_started, ev.ControllerStarted: self._controller_started,
            ev.RolloutAdmitted: self._admitted, ev.GroupCommitted: self._committed,
            ev.GroupFailed: self._failed, ev.GroupEvicted: self._evicted,
            ev.StepBegun: self._step_begun, ev.MicrobatchTrained: self._microbatch,
            ev.StepFinished: self._step_finished, ev.StepAborted: self._step_aborted,
            ev.WeightsPublished: self._published, ev.CheckpointSaved: self._checkpoint,
            ev.CheckpointRejected: self._note, ev.PayloadsReleased: self._note,
            ev.WorkerLost: self._note, ev.RunRewound: self._note, ev.RunFinished: self._note,
            **dict.fromkeys(EPISODE_RECORDS, self._episode_record),
        }

    # -- the fold ----------------------------------------------------------------------

    def feed(self, position: int, event: ev.Event) -> bool:
        """Apply one event; False once the requested steps are all written (stop reading)."""
        if self.t0 is None:
            self.t0 = event.ts
            self.first_position = position
        us = (event.ts - self.t0) * 1e6
        if us > self.now:
            self.now = us
        kind = type(event)
        if kind is not self.last_kind:
            # The counts are shown once per run of same-type events (an append batch of
            # admissions or commits is one step in the counter, not one per group).
            if self.dirty_at is not None:
                self._show_counts()
            if self.admits:
                self._flush_admits()
            self.last_kind = kind
        self.events += 1
        self.last_position = position
        # a type this builder does not draw yet (a newer event) is an instant, not an error
        more = self.handlers.get(kind, self._note)(event, us) is not False
        self.w.maybe_flush()
        return more

    def finish(self) -> None:
        """Close what is still open at the end (marked ``open``) and the file."""
        if self.drawing:
            self._close_open()
        self.w.close({
            "run_id": self.run_id, "events": self.events, "first_position": self.first_position,
            "last_position": self.last_position, "source": "rl-controller trace",
        })

    # -- generators --------------------------------------------------------------------

    def _admitted(self, e: ev.RolloutAdmitted, us: float) -> None:
        pid = self.tracks.generator(e.generator or UNKNOWN_GENERATOR, self.drawing)
        slot = self.tracks.take_slot(pid)
        g = self.groups[e.group_id] = _Group(e.attempt, pid, slot, us)
        self.in_flight += 1
        self.dirty_at = us
        if self.drawing:
            self.tracks.name_slot(pid, slot)
            self._draw_generate(e.group_id, g, {"dispatch_version": e.weight_version})
            self.admits.append((us, e.group_id, e.weight_version))

    def _draw_generate(self, group_id: str, g: _Group, args: dict[str, Any]) -> None:
        g.drawn = True
        g.admitted = self.w.begin((g.pid, g.slot + 1), g.admitted, f"generate {group_id}",
                                  {"group": group_id, "attempt": g.attempt, **args})

    def _committed(self, e: ev.GroupCommitted, us: float) -> None:
        g = self.groups.get(e.group_id)
        if g is None:
            return  # committed without an admission this fold saw: nothing to draw
        g.version = e.weight_version_start
        g.reward = sum(e.rewards) / len(e.rewards) if e.rewards else 0.0
        self.in_flight -= 1
        self.buffered += 1
        self.dirty_at = us
        track = self._free_slot(g)
        if g.drawn:
            self._start_flow(g, track, g.admitted + INSIDE_US)
            self.w.end(track, us, {"weight_version_start": e.weight_version_start,
                                   "weight_version_end": e.weight_version_end,
                                   "reward_mean": g.reward})

    def _failed(self, e: ev.GroupFailed, us: float) -> None:
        g = self.groups.get(e.group_id)
        if g is None or g.slot < 0:
            return
        del self.groups[e.group_id]
        self.in_flight -= 1
        self.dirty_at = us
        track = self._free_slot(g)
        if g.drawn:
            self.w.end(track, us, {"failed": e.reason})

    def _free_slot(self, g: _Group) -> tuple[int, int]:
        track = self.tracks.free_slot(g.pid, g.slot)
        g.slot = -1
        return track

    def _evicted(self, e: ev.GroupEvicted, us: float) -> None:
        g = self.groups.pop(e.group_id, None)
        if g is None:
            return
        self.buffered -= 1
        self.dirty_at = us
        if self.drawing:
            start = self._marker(us, f"evict {e.group_id}", {"lag": e.lag, "reason": e.reason})
            if g.flow:
                self.w.flow("f", CONTROLLER, start + INSIDE_US, g.flow)

    # -- the trainer -------------------------------------------------------------------

    def _step_begun(self, e: ev.StepBegun, us: float) -> None:
        self.newest_step = max(self.newest_step, e.step)
        if not self.drawing and self.first_step is not None and e.step >= self.first_step:
            self._start_drawing()
        self.step = _Step(e.step, e.base_trainer_version, us)
        if self.drawing:
            self.w.begin(TRAINER, us, f"step {e.step}",
                         {"step": e.step, "base_trainer_version": e.base_trainer_version})
            self.w.instant(CONTROLLER, us, f"begin step {e.step}", {"step": e.step})

    def _microbatch(self, e: ev.MicrobatchTrained, us: float) -> None:
        st = self.step
        if st is None:
            return
        start = st.cursor
        if self.drawing:
            start, st.cursor = self.w.complete(
                TRAINER, st.cursor, us, f"microbatch {e.index}",
                {"groups": e.group_ids[:16], "sequences": e.num_sequences, "tokens": e.num_tokens})
        else:
            st.cursor = us
        claimed = [(gid, g) for gid in e.group_ids if (g := self.groups.get(gid)) is not None]
        # One point for the microbatch's flows, after each one's start: the slice starts
        # at the step's previous point, which a group admitted while the step waited
        # for it follows (and the track's entries must go forward in time)
        at = max([start + INSIDE_US] + [g.flow_at for _, g in claimed if g.flow])
        for group_id, g in claimed:
            st.claimed.append(group_id)
            self.buffered -= 1
            if self.drawing:
                self._start_flow(g, TRAINER, at) if not g.flow else \
                    self.w.flow("t", TRAINER, self.w.at(TRAINER, at), g.flow)
        self.dirty_at = us

    def _step_finished(self, e: ev.StepFinished, us: float) -> bool:
        st = self.step
        self.step = None
        self.finished_at = {e.trainer_version: us}  # only the newest is ever published
        if st is None:
            return True
        if self.drawing:  # the finish call: from the last microbatch to StepFinished
            start, st.cursor = self.w.complete(TRAINER, st.cursor, us, "finish", {})
        lags, rewards = [], []
        for group_id in st.claimed:
            g = self.groups.pop(group_id, None)
            if g is not None:
                lags.append(st.base - g.version)
                rewards.append(g.reward)
                if self.drawing and g.flow:
                    self.w.flow("f", TRAINER, start + INSIDE_US, g.flow)
        if self.drawing:
            self.w.end(TRAINER, max(us, st.cursor), {
                "trainer_version": e.trainer_version, "grad_norm": e.grad_norm,
                "groups": len(st.claimed)})
            self._step_counters(us, e.trainer_version, lags, rewards)
        return self._window_open(e.step)

    def _step_counters(self, us: float, version: int, lags: list[int], rewards: list[float]) -> None:
        w = self.w
        w.counter(RUN_PID, us, "trainer_version", {"version": version})
        if lags:
            w.counter(RUN_PID, us, "lag", {"mean": sum(lags) / len(lags), "max": max(lags)})
            w.counter(RUN_PID, us, "reward", {"mean": sum(rewards) / len(rewards)})

    def _step_aborted(self, e: ev.StepAborted, us: float) -> bool:
        st = self.step
        self.step = None
        if st is not None:
            self.buffered += sum(1 for g in st.claimed if g in self.groups)
            self.dirty_at = us
            if self.drawing:
                self.w.end(TRAINER, max(us, st.cursor), {"aborted": e.reason})
        if self.drawing:
            self.w.instant(CONTROLLER, us, f"abort step {e.step}", {"reason": e.reason})
        return self._window_open(e.step)

    def _window_open(self, step: int) -> bool:
        return self.last_step is None or step < self.last_step

    def _published(self, e: ev.WeightsPublished, us: float) -> None:
        start = max(self.finished_at.get(e.weight_version, us), self.publish_cursor)
        if self.drawing:
            _, self.publish_cursor = self.w.complete(
                PUBLISH, start, us, f"publish v{e.weight_version}",
                {"weight_version": e.weight_version, "generators": len(e.generators)})
        else:
            self.publish_cursor = us

    def _checkpoint(self, e: ev.CheckpointSaved, us: float) -> None:
        start = max(self.finished_at.get(e.trainer_version, us), self.publish_cursor)
        if self.drawing:
            _, self.publish_cursor = self.w.complete(
                PUBLISH, start, us, f"checkpoint v{e.trainer_version}", {"uri": e.uri})
        else:
            self.publish_cursor = us

    # -- the controller's other decisions and facts ------------------------------------

    def _run_started(self, e: ev.RunStarted, us: float) -> None:
        if self.drawing:
            self._start_drawing()
            self.w.instant(CONTROLLER, us, "run started", {
                "window_versions": e.window_versions, "groups_per_step": e.groups_per_step,
                "samples_per_group": e.samples_per_group})

    def _controller_started(self, e: ev.ControllerStarted, us: float) -> None:
        if self.drawing:
            self.w.instant(CONTROLLER, us, f"controller started (epoch {e.epoch})",
                           {"host": e.host, "pid": e.pid})

    def _episode_record(self, e: Any, us: float) -> None:
        g = self.groups.get(e.group_id)
        if self.drawing and g is not None and g.drawn and g.slot >= 0:
            name, args = episode_instant(e)
            self.w.instant((g.pid, g.slot + 1), us, name, args)

    def _note(self, e: ev.Event, us: float) -> None:
        if self.drawing:
            args = {k: getattr(e, k) for k in e.__struct_fields__ if k not in _COMMON}
            self.w.instant(CONTROLLER, us, type(e).__name__, args)

    def _flush_admits(self) -> None:
        us, _, version = self.admits[0]
        groups = [g for _, g, _ in self.admits]
        self.w.instant(CONTROLLER, us, f"admit {len(groups)}",
                       {"groups": groups[:16], "weight_version": version})
        self.admits = []

    # -- helpers -----------------------------------------------------------------------

    def _start_flow(self, g: _Group, track: tuple[int, int], at: float) -> None:
        """Flow ``g`` from ``at`` (just inside a slice's start), or from the track's last
        entry after it: the slice may already hold an episode's records, and a track's
        entries go forward in time."""
        g.flow = self.next_flow
        self.next_flow += 1
        g.flow_at = self.w.at(track, at)
        self.w.flow("s", track, g.flow_at, g.flow)

    def _marker(self, us: float, name: str, args: dict[str, Any]) -> float:
        """A short controller slice a flow can end in (after the previous one: siblings
        must not overlap); returns its start."""
        start, self.marker_end = self.w.complete(
            CONTROLLER, max(us, self.marker_end), us, name, args)
        return start

    def _show_counts(self) -> None:
        now = (self.buffered, self.in_flight)
        if self.drawing and now != self.shown:
            self.w.counter(RUN_PID, self.dirty_at or 0.0, "groups",
                           {"buffered": self.buffered, "in flight": self.in_flight})
            self.shown = now
        self.dirty_at = None

    def _start_drawing(self) -> None:
        """From here on entries are written: name the tracks, draw what is in flight."""
        self.drawing = True
        self.tracks.name_run(self.run_id)
        for group_id, g in sorted(self.groups.items(), key=lambda kv: kv[1].admitted):
            if g.slot >= 0:
                self.tracks.name_slot(g.pid, g.slot)
                self._draw_generate(group_id, g, {"before_window": True})

    def _close_open(self) -> None:
        if self.admits:
            self._flush_admits()
        end = self.now
        flowing = []
        for group_id, g in self.groups.items():
            if g.slot >= 0 and g.drawn:
                self.w.end((g.pid, g.slot + 1), end, {"open": True})
            elif g.flow:
                flowing.append(g.flow)
        if flowing:
            start = self._marker(end, f"open at end ({len(flowing)} groups)", {})
            for flow in flowing:
                self.w.flow("f", CONTROLLER, start + INSIDE_US, flow)
        if self.step is not None:
            self.w.end(TRAINER, max(end, self.step.cursor), {"open": True})
        if self.dirty_at is not None:
            self._show_counts()


_COMMON = {"event_id", "epoch", "ts", "schema_version"}
