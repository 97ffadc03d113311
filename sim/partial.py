"""Simulated generators with partial rollouts: calls that return at every flush point.

The same contract as ``workers.generator.inflight`` (``docs/segments.md``), in virtual
time and without a model. A group's generation time T (the timings' draw) is spread
evenly over its longest completion's L tokens, so a token takes T / L and sample i
stops at its own length. A call returns at the first flush point of its groups:
``segment_tokens`` more tokens since the last flush, or once all are done (a group that
ends first waits in the call, as the protocol says; ``docs/segments.md``). A group that
another group's flush pauses keeps the part of a token it had decoded. A window that
spans refits is flushed one version at a time.

A refit (the publisher moved the fleet's weight version while the group was generating)
applies from the next token on, as the real generator does at a token boundary, and
closes a segment without a flush (the call keeps its timer: a refit is no flush point,
and the token being decoded when it lands is finished, not started again); with
``flush_on_refit`` it also ends the call, and the tokens since the last flush, all of the
old version, are flushed. A refit that lands while a group waits between calls is
applied when the next call starts, as the real generator reads its version there.

A group pauses at its flush point until the controller's next call (which follows its
``SegmentsRecorded`` append at once), so what the log records is exactly what a real
run's would: one event per flush, one segment per sample with new tokens. Groups of a
call run side by side; those not at a flush point come back ``pending`` with their
progress kept. The final outcome has the oldest and the newest token versions (a refit
before a group's first token or after its last moves neither).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from events.schema import Segment
from sim.workers import Fleet
from workers.api import GenerationOutcome, GenerationRequest, SegmentFlush


@dataclass
class _Group:
    lengths: list[int]
    #: virtual seconds per token step
    token_s: float
    #: work-clock seconds already spent on the token being decoded when its call
    #: returned: a group of several in a call is paused between two tokens of its own
    #: whenever another group flushes, and the next call goes on from there
    into_s: float = 0.0
    #: token steps taken; tokens of each sample made durable so far; flushes so far;
    #: token steps at the last flush
    steps: int = 0
    durable: list[int] = field(default_factory=list)
    flushes: int = 0
    flushed_at: int = 0
    #: version of the oldest tokens since the last flush
    version: int = 0
    #: (token step, version) where each newer version began since the last flush
    changes: list[tuple[int, int]] = field(default_factory=list)
    #: (token step, version) where each version began, over the group's life
    history: list[tuple[int, int]] = field(default_factory=list)

    def tokens(self, i: int) -> int:
        return min(self.lengths[i], self.steps)

    @property
    def done(self) -> bool:
        return self.steps >= max(self.lengths)

    def fresh(self) -> bool:
        return any(self.tokens(i) > d for i, d in enumerate(self.durable))

    @property
    def newest(self) -> int:
        return self.changes[-1][1] if self.changes else self.version

    def refit(self, version: int, at: int) -> None:
        """The weights moved to ``version`` at token step ``at`` (no flush)."""
        began = self.changes[-1][0] if self.changes else self.flushed_at
        if at > began:
            self.changes.append((at, version))
        elif self.changes:  # no token of the version before: it never began
            self.changes[-1] = (at, version)
        else:
            self.version = version
        self.began(version, at)

    def began(self, version: int, at: int | None = None) -> None:
        """Tokens from step ``at`` (the current one) on have ``version`` (for ``version_runs``)."""
        at = self.steps if at is None else at
        if self.history and self.history[-1][0] == at:
            self.history[-1] = (at, version)
        elif not self.history or self.history[-1][1] != version:
            self.history.append((at, version))

    def version_runs(self) -> list[list[int]]:
        """Each sample's token versions, run-length encoded (``workers.generator.segments``)."""
        bounds = self.history + [(max(self.lengths), -1)]
        out = []
        for n in self.lengths:
            runs: list[int] = []
            for (at, v), (until, _) in zip(bounds, bounds[1:]):
                k = min(n, until) - min(n, at)
                if k > 0:
                    runs += [v, k]
            out.append(runs)
        return out


def _advance(g: _Group, target: int, stop: int, elapsed: float, refit: bool) -> None:
    """``g`` ran ``elapsed`` work-clock seconds of its call, toward token step ``target``
    (its flush point or end, ``stop``, or as far as the call's first flush let it go); the
    part of a token it had decoded is kept for the next call, never decoded again."""
    if g.done:
        return
    ran = g.into_s + elapsed
    reached = min(target, g.steps + int(ran / g.token_s + 1e-9)) if refit else target
    g.into_s = 0.0 if reached >= stop else max(
        0.0, ran - (reached - g.steps) * g.token_s)
    g.steps = reached


class SimPartialGenerator:
    """A generator whose calls end at their groups' next flush point."""

    def __init__(
        self, name: str, fleet: Fleet, segment_tokens: int, flush_on_refit: bool = False
    ) -> None:
        self.name = name
        self.fleet = fleet
        self.segment_tokens = segment_tokens
        self.flush_on_refit = flush_on_refit
        self.held: dict[str, _Group] = {}

    def generate(self, requests: list[GenerationRequest]) -> asyncio.Future:
        fleet = self.fleet
        with fleet.loop.uncharged():
            fut = fleet.loop.create_future()
            fleet.calls += 1
            self.held = {r.group_id: self._hold(r) for r in requests}
            call = _Call(self, fut, requests)
            call.schedule()
            if any(g.newest != fleet.weight_version for g in call.groups):
                call._refit()  # one that landed while they waited between calls
        return fut

    def _hold(self, req: GenerationRequest) -> _Group:
        group = self.held.get(req.group_id)
        if group is not None:
            return group
        fleet = self.fleet
        lengths = fleet.timings.group_lengths(req.group_id, req.n_samples)
        fleet.lengths_by_group[req.group_id] = lengths
        duration = fleet.timings.generation_s(req.group_id, req.attempt)
        fleet.generator_busy_s += duration
        fleet.groups += 1
        v = fleet.weight_version
        return _Group(lengths, duration / max(1, max(lengths)), durable=[0] * len(lengths),
                      version=v, history=[(0, v)])

    async def weight_version(self) -> int:
        return self.fleet.weight_version


class _Call:
    """One call in flight: advances its groups to the first flush point in virtual time."""

    def __init__(self, gen: SimPartialGenerator, fut: asyncio.Future, reqs: list[GenerationRequest]) -> None:
        self.gen, self.fut, self.reqs = gen, fut, reqs
        self.groups = [gen.held[r.group_id] for r in reqs]
        self.timer: Any = None
        #: on the fleet's work clock (virtual seconds, or decode work: ``sim.decode``)
        self.started = 0.0
        #: whether its groups' sequences count in the decode load now
        self.decoding = False
        #: token steps each group reaches at the timer (the first to flush reaches it exactly)
        self.target: list[int] = []
        #: the token step of each group's flush point (or end) at the last schedule
        self.stops: list[int] = []

    def _until_flush(self, g: _Group) -> int:
        """Token steps until this group's next flush point (or its end)."""
        since = g.steps - g.flushed_at
        return max(1, min(self.gen.segment_tokens - since, max(g.lengths) - g.steps))

    def schedule(self) -> None:
        # a group that ended waits in the call for the others' flush point (it takes no steps)
        groups = self.groups
        live = [k for k, g in enumerate(groups) if not g.done]
        steps = [self._until_flush(g) for g in groups]
        need = [n * g.token_s - g.into_s for n, g in zip(steps, groups)]
        wait = min(need[k] for k in live)
        self.target = [
            g.steps if g.done else g.steps + min(n, int((wait + g.into_s) / g.token_s + 1e-9))
            for n, g in zip(steps, groups)
        ]
        first = min(live, key=lambda k: need[k])
        self.target[first] = groups[first].steps + steps[first]
        self.stops = [g.steps + n for n, g in zip(steps, groups)]
        fleet = self.gen.fleet
        if not self.decoding:  # a call re-timed after a refit keeps decoding
            self.decoding = True
            fleet.decoding(sum(len(g.lengths) for g in self.groups))
        clock = fleet.work_clock
        self.started = clock.time()
        self.timer = clock.call_later(wait, self.resolve, False)
        fleet.on_refit[self._refit] = None

    def _stop_decoding(self) -> None:
        if self.decoding:
            self.decoding = False
            self.gen.fleet.decoding(-sum(len(g.lengths) for g in self.groups))

    def _refit(self) -> None:
        """The fleet's weights moved: each group closes a segment at its current token
        (with ``flush_on_refit``, groups flush the old version's tokens)."""
        if self.gen.flush_on_refit:
            if self.timer is not None:
                self.timer.cancel()
            self.resolve(True)
            return
        # the call's flush point and timer stand (a refit is no flush point): each group
        # only notes the token step the new version begins at; re-timing the call from
        # the last whole token would lose the part of the token already decoded
        fleet = self.gen.fleet
        with fleet.loop.uncharged():
            elapsed = fleet.work_clock.time() - self.started
            for g, target in zip(self.groups, self.target):
                if not g.done:  # an ended group has no next token for the new version
                    g.refit(fleet.weight_version, min(target, g.steps + int((g.into_s + elapsed) / g.token_s + 1e-9)))

    def resolve(self, refit: bool) -> None:
        fleet = self.gen.fleet
        fleet.on_refit.pop(self._refit, None)
        if self.fut.done():  # cancelled (the run stopped)
            self._stop_decoding()
            return
        with fleet.loop.uncharged():
            elapsed = fleet.work_clock.time() - self.started
            for g, target, stop in zip(self.groups, self.target, self.stops):
                _advance(g, target, stop, elapsed, refit)
            v = fleet.weight_version
            if refit and not any(g.done or (g.fresh() and g.version != v) for g in self.groups):
                for g in self.groups:  # nothing to flush: the next tokens are the new weights'
                    g.version = fleet.weight_version
                    g.began(v)
                self.schedule()
                return
            if not any(self._flushes(g, refit) for g in self.groups) and not all(
                    g.done for g in self.groups):
                # the protocol: a call returns at a flush point of one of its groups, or
                # once all are done; one that ended first waits for the others (the real
                # generator runs the rest before it returns), never "done" beside "pending"
                for g in self.groups:
                    if refit and not g.done and not g.fresh():
                        g.version = v  # as a pending outcome after a refit would note
                        g.began(v)
                self.schedule()
                return
            self._stop_decoding()
            self.fut.set_result([self._outcome(r, g, refit) for r, g in zip(self.reqs, self.groups)])

    def _flushes(self, g: _Group, refit: bool) -> bool:
        """Whether ``_outcome`` flushes this group now."""
        full = g.steps - g.flushed_at >= self.gen.segment_tokens
        return not g.done and g.fresh() and (full or (refit and self.gen.fleet.weight_version != g.version))

    def _outcome(self, req: GenerationRequest, g: _Group, refit: bool) -> GenerationOutcome:
        fleet = self.gen.fleet
        if g.done:
            del self.gen.held[req.group_id]
            # the versions its tokens have, as the real generator's final rows say: a refit
            # before its first token or after its last moves neither bound
            runs = g.version_runs()
            start = min((r[0] for r in runs if r), default=g.version)
            end = max((r[-2] for r in runs if r), default=g.newest)
            return GenerationOutcome(
                payload_keys=[f"{req.group_id}/{req.attempt}/{i}" for i in range(len(g.lengths))],
                rewards=fleet.timings.group_rewards(req.group_id, len(g.lengths)),
                lengths=list(g.lengths), weight_version_start=start, weight_version_end=end,
                version_runs=runs,
            )
        if not self._flushes(g, refit):
            if refit and not g.fresh():
                g.version = fleet.weight_version
                g.began(g.version)
            return GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                                     weight_version_end=0, status="pending")
        # one version per flush: up to where the next version began (or to the end)
        until = g.changes[0][0] if g.changes else g.steps
        segments = []
        for i, durable in enumerate(g.durable):
            end = min(g.lengths[i], until)
            if end > durable:
                segments.append(Segment(
                    sample=i, start=durable, length=end - durable,
                    stopped=end >= g.lengths[i],
                    key=f"seg:{req.group_id}/a{req.attempt}/s{i}/k{g.flushes}",
                ))
                g.durable[i] = end
        flush = SegmentFlush(weight_version=g.version, segments=segments)
        g.flushes, g.flushed_at = g.flushes + 1, until
        if g.changes:
            g.version = g.changes.pop(0)[1]
        else:
            g.version = fleet.weight_version  # the next tokens are the new weights'
            g.began(g.version)
        return GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                                 weight_version_end=0, status="flushed", flush=flush)
