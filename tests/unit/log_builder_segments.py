"""``LogBuilder``'s in-flight and episode events: segments, env steps, restarts.

A mixin of :class:`tests.unit.log_builder.LogBuilder` (which holds the bookkeeping it
reads: ``attempts``, ``flushes``, ``env_events``, and ``_emit``).
"""

from __future__ import annotations

from typing import Any

from events.schema import (
    EnvCall,
    EnvResult,
    EnvStepsCompleted,
    EnvStepsRequested,
    EpisodesRestarted,
    Segment,
    SegmentsDropped,
    SegmentsRecorded,
    env_steps_event_id,
    episodes_restarted_id,
    segments_dropped_id,
    segments_event_id,
)


class SegmentEvents:
    """SegmentsRecorded / SegmentsDropped / EnvSteps* / EpisodesRestarted builders."""

    attempts: dict[str, int]
    flushes: dict[tuple[str, int], int]
    env_events: dict[tuple[str, int], int]
    _emit: Any  # LogBuilder._emit

    def flush(
        self,
        group_id: str,
        spans: dict[int, tuple[int, int]] | dict[int, tuple[int, int, bool]],
        *,
        version: int | None = 0,
        index: int | None = None,
        kind: str = "model",
        turn: int = 0,
        **overrides: Any,
    ) -> Any:
        """SegmentsRecorded: ``spans`` = {sample: (start, length[, stopped])}; the index
        counts this attempt's flushes unless given."""
        attempt = self.attempts.get(group_id, 1)
        counted = (group_id, attempt)
        index = self.flushes.get(counted, 0) if index is None else index
        self.flushes[counted] = index + 1
        segments = [
            Segment(sample=i, start=span[0], length=span[1], key=f"{group_id}/a{attempt}/s{i}/k{index}",
                    turn=turn, stopped=bool(span[2]) if len(span) > 2 else False)
            for i, span in spans.items()
        ]
        fields = dict(group_id=group_id, attempt=attempt, index=index, kind=kind,
                      weight_version=version, segments=segments)
        self._emit(SegmentsRecorded, segments_event_id(group_id, attempt, index), fields, overrides)
        return self

    def _env_index(self, group_id: str) -> tuple[int, int]:
        attempt = self.attempts.get(group_id, 1)
        index = self.env_events.get((group_id, attempt), 0)
        self.env_events[(group_id, attempt)] = index + 1
        return attempt, index

    def request(
        self, group_id: str, calls: dict[int, tuple[int, str]], *, env: str = "calc",
        dedupes: bool = True, restart: int = 0, **overrides: Any,
    ) -> Any:
        """EnvStepsRequested: ``calls`` = {sample: (turn, request fingerprint)}."""
        attempt, index = self._env_index(group_id)
        fields = dict(group_id=group_id, attempt=attempt, index=index, env=env,
                      dedupes_by_key=dedupes,
                      calls=[EnvCall(sample=i, turn=t, request=r, restart=restart)
                             for i, (t, r) in calls.items()])
        self._emit(EnvStepsRequested, env_steps_event_id(group_id, "requested", attempt, index),
                   fields, overrides)
        return self

    def complete(
        self, group_id: str, results: dict[int, tuple[int, float, bool, int]], *,
        restart: int = 0, **overrides: Any,
    ) -> Any:
        """EnvStepsCompleted: ``results`` = {sample: (turn, reward, ended, observation tokens)}."""
        attempt, index = self._env_index(group_id)
        fields = dict(group_id=group_id, attempt=attempt, index=index, results=[
            EnvResult(sample=i, turn=t, reward=r, ended=e, end_reason="done" if e else "",
                      observation_tokens=o, restart=restart)
            for i, (t, r, e, o) in results.items()])
        self._emit(EnvStepsCompleted, env_steps_event_id(group_id, "completed", attempt, index),
                   fields, overrides)
        return self

    def restart_episodes(self, group_id: str, samples: list[int], **overrides: Any) -> Any:
        attempt = self.attempts.get(group_id, 1)
        fields = dict(group_id=group_id, attempt=attempt, samples=samples, reason="test")
        self._emit(EpisodesRestarted, episodes_restarted_id(group_id, attempt), fields, overrides)
        return self

    def drop_segments(self, group_id: str, keys: list[str], **overrides: Any) -> Any:
        """SegmentsDropped by the group's current (failed) attempt."""
        attempt = self.attempts.get(group_id, 1)
        fields = dict(group_id=group_id, attempt=attempt, keys=keys, reason=f"missing {keys[:1]}")
        self._emit(SegmentsDropped, segments_dropped_id(group_id, attempt), fields, overrides)
        return self
