"""Segments in the folded state: what an in-flight group has recorded, and per-token lag.

``SegmentsRecorded`` events (``docs/segments.md``) make an in-flight group's tokens
durable flush by flush. The state keeps, per group that has recorded any and is not
committed yet, an :class:`InflightSegments`: the flushes themselves (a resumed attempt's
generator is handed them), and per sample how many tokens are recorded and whether it
stopped -- which is what the reducer checks each new flush against, so that a recorded
token is never recorded twice and nothing follows a stopped sample.

At the commit the record is folded into three numbers kept on the group
(:func:`commit_summary`): the oldest and newest token version and the token-weighted
version sum, from which every per-token lag is computed (:func:`token_lags`). A refit
closes a segment without a flush, so the tokens after the last flush may span versions:
a commit whose tokens do carries every token's version (``version_runs``), checked
against each recorded flush (:func:`runs_problem`); one without carries none, and its
unflushed tail has one version, the commit's ``weight_version_end``.

Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from events.schema import SegmentsRecorded

#: which token's version the staleness window bounds (``[staleness] window_basis``)
WindowBasis = Literal["oldest_token", "newest_token"]
WINDOW_BASES: tuple[WindowBasis, ...] = ("oldest_token", "newest_token")

_NONE = -1  # "no version": observation tokens, or a sample with nothing recorded


class InflightSegments(msgspec.Struct, kw_only=True, gc=False):
    """What an uncommitted group has recorded, over all its attempts."""

    #: every recorded flush, in log order (a resumed attempt starts from these)
    flushes: list[SegmentsRecorded] = []
    #: per sample: recorded tokens, and whether its last segment ended it
    recorded: list[int]
    stopped: list[bool]
    #: per sample: version of its first / last recorded model token (-1: none yet)
    first_version: list[int]
    last_version: list[int]
    #: the attempt now admitted, and how many flushes it has recorded
    attempt: int
    attempt_flushes: int = 0
    #: sum of version x tokens over the recorded model tokens, and their count
    version_token_sum: int = 0
    model_tokens: int = 0

    @classmethod
    def empty(cls, n_samples: int, attempt: int) -> InflightSegments:
        return cls(
            recorded=[0] * n_samples, stopped=[False] * n_samples,
            first_version=[_NONE] * n_samples, last_version=[_NONE] * n_samples,
            attempt=attempt,
        )


def segment_keys(inflight: Mapping[str, InflightSegments], group_ids: Iterable[str]) -> list[str]:
    """Data-plane keys of every segment row these groups recorded (all attempts)."""
    return [
        seg.key for gid in group_ids if gid in inflight
        for f in inflight[gid].flushes for seg in f.segments
    ]


def segments_problem(rec: InflightSegments, ev: SegmentsRecorded, trainer_version: int) -> str:
    """Why ``ev`` cannot follow what ``rec`` holds ("" when it can)."""
    if ev.index != rec.attempt_flushes:
        return f"flush index {ev.index}, expected {rec.attempt_flushes} for attempt {ev.attempt}"
    if (ev.kind == "model") != (ev.weight_version is not None):
        return f"a {ev.kind} flush with weight_version {ev.weight_version}"
    if ev.weight_version is not None and not 0 <= ev.weight_version <= trainer_version:
        return (f"weight_version {ev.weight_version} is newer than trainer_version "
                f"{trainer_version}: no such weights existed to sample these tokens")
    if not ev.segments:
        return "a flush with no segments"
    recorded, stopped = rec.recorded, rec.stopped  # this loop runs per segment: locals
    n = len(recorded)
    # a list of bools, not a bytearray: 3.11 specialises list[int] loads and stores and
    # tests a bool by identity, where a bytearray takes the generic paths (-5.5 % of the
    # fold's instructions, ``docs/episode-cost.md``, "Eighth pass")
    seen = [False] * n
    for seg in ev.segments:
        i = seg.sample
        if not 0 <= i < n or seen[i]:
            return f"sample {i} is outside the group of {n} or twice in one flush"
        seen[i] = True
        if seg.length < 1 or not seg.key:
            return f"sample {i}: a segment needs length >= 1 and a payload key"
        if stopped[i]:
            return f"sample {i} already stopped"
        if seg.start != recorded[i]:
            return (f"sample {i}: segment starts at token {seg.start}, but {recorded[i]} "
                    f"are recorded (a recorded token is never produced again)")
    return ""


def record_flush(rec: InflightSegments, ev: SegmentsRecorded) -> None:
    """Fold a checked flush into ``rec``."""
    rec.flushes.append(ev)
    rec.attempt_flushes += 1
    # once per segment of every flush: the lists as locals, and a flush's one version
    # tested once (the integer sums are the same added per segment or per flush)
    recorded, stopped = rec.recorded, rec.stopped
    v = ev.weight_version
    if v is None:
        for seg in ev.segments:
            i = seg.sample
            recorded[i] += seg.length
            stopped[i] = seg.stopped
        return
    first, last = rec.first_version, rec.last_version
    tokens = 0
    for seg in ev.segments:
        i, n = seg.sample, seg.length
        recorded[i] += n
        stopped[i] = seg.stopped
        if first[i] == _NONE:
            first[i] = v
        last[i] = v
        tokens += n
    rec.version_token_sum += v * tokens
    rec.model_tokens += tokens


def lost_samples(rec: InflightSegments, keys: Iterable[str]) -> tuple[set[int], list[str]]:
    """(samples with a segment among ``keys``, the keys that are no segment of ``rec``)."""
    owner = {seg.key: seg.sample for f in rec.flushes for seg in f.segments}
    samples, unknown = set(), []
    for key in keys:
        if key in owner:
            samples.add(owner[key])
        else:
            unknown.append(key)
    return samples, unknown


def without_samples(rec: InflightSegments, samples: set[int]) -> InflightSegments | None:
    """``rec`` with every segment of ``samples`` dropped (they restart from the prompt),
    rebuilt flush by flush; None when nothing recorded is left."""
    out = InflightSegments.empty(len(rec.recorded), rec.attempt)
    for f in rec.flushes:
        kept = [seg for seg in f.segments if seg.sample not in samples]
        if kept:
            record_flush(out, f if len(kept) == len(f.segments) else msgspec.structs.replace(f, segments=kept))
    if not out.flushes:
        return None
    out.attempt_flushes = rec.attempt_flushes
    return out


def commit_problem(
    rec: InflightSegments, lengths: Sequence[int], start: int, end: int
) -> str:
    """Why a commit with these lengths and versions disagrees with the recorded flushes."""
    if len(lengths) != len(rec.recorded):
        return f"{len(lengths)} samples committed, {len(rec.recorded)} recorded"
    for i, (n, done) in enumerate(zip(lengths, rec.recorded)):
        if n < done or (rec.stopped[i] and n != done):
            return f"sample {i}: {n} tokens committed but {done} were recorded" + (
                " and it had stopped" if rec.stopped[i] else "")
        if rec.first_version[i] != _NONE and not start <= rec.first_version[i] <= rec.last_version[i] <= end:
            return (f"sample {i}: recorded versions {rec.first_version[i]}..{rec.last_version[i]} "
                    f"outside the commit's {start}..{end}")
    return ""


def runs_problem(
    runs: Sequence[Sequence[int]], lengths: Sequence[int], start: int, end: int,
    rec: InflightSegments | None,
) -> str:
    """Why a commit's ``version_runs`` disagree with its lengths, its versions, or the
    group's recorded flushes ('' when they agree)."""
    if len(runs) != len(lengths):
        return f"version_runs for {len(runs)} samples, {len(lengths)} committed"
    for i, (r, n) in enumerate(zip(runs, lengths)):
        if len(r) % 2 or sum(r[1::2]) != n or any(k < 1 for k in r[1::2]):
            return f"sample {i}: version_runs {list(r)} do not encode its {n} tokens"
        versions = r[0::2]
        if any(not start <= v <= end for v in versions) or any(
            a >= b for a, b in zip(versions, versions[1:])
        ):
            return f"sample {i}: version_runs {list(r)} not rising within {start}..{end}"
    if rec is None:
        return ""
    # every recorded segment, not just a sample's first and last version: runs that
    # agree at both ends can still move a middle flush's tokens to another version,
    # and the fold would sum them at it
    for f in rec.flushes:
        v = _NONE if f.weight_version is None else f.weight_version
        for seg in f.segments:
            r = runs[seg.sample]
            if not _one_version(r, seg.start, seg.length, v):
                i = seg.sample
                return (f"sample {i}: version_runs {list(r)} disagree with its recorded "
                        f"versions {rec.first_version[i]}..{rec.last_version[i]}")
    return ""


def _one_version(runs: Sequence[int], start: int, length: int, version: int) -> bool:
    """Whether tokens ``start .. start + length - 1`` of ``runs`` all have ``version``."""
    at = 0
    for v, n in zip(runs[0::2], runs[1::2]):
        if at + n > start:  # the run holding ``start``: it must hold the whole segment
            return v == version and at + n >= start + length
        at += n
    return False


def commit_summary(
    rec: InflightSegments | None, lengths: Sequence[int], start: int, end: int,
    runs: Sequence[Sequence[int]] = (),
) -> tuple[int, int, int]:
    """(version sum over the model tokens, largest version span of one sample,
    observation tokens) of a commit.

    An episode's observation tokens (its env's replies, recorded in flushes without a
    version) are in ``lengths`` but not model tokens: they add nothing to the sum, and
    the reports leave them out of per-token lags. With ``runs`` (the commit's
    ``version_runs``: every token's version) the sum and span are exact. Otherwise the
    tokens after the last recorded flush (model tokens: a turn's observation is
    recorded at its pause) count at ``end``; and without recorded flushes (partial
    rollouts off, or a log written before them) each sample's tokens are counted at
    ``start``, its oldest possible version, and the span is ``end - start`` -- the
    bounds the event gives, no finer.
    """
    if runs:
        total = span = 0
        for r in runs:
            versions = r[0::2]
            total += sum(v * n for v, n in zip(versions, r[1::2]))
            if versions:
                span = max(span, versions[-1] - versions[0])
        return total, span, 0
    if rec is None:
        return start * sum(lengths), end - start, 0
    recorded = sum(rec.recorded)
    tail = sum(lengths) - recorded  # all at the newest version
    span = 0
    for i, n in enumerate(lengths):
        first = rec.first_version[i]
        if first == _NONE:
            continue
        last = end if n > rec.recorded[i] else rec.last_version[i]
        span = max(span, last - first)
    return rec.version_token_sum + end * tail, span, recorded - rec.model_tokens


def token_lags(
    trainer_version: int, start: int, end: int, version_token_sum: int, tokens: int
) -> tuple[int, int, float]:
    """(oldest-token lag, newest-token lag, token-weighted mean lag) at ``trainer_version``."""
    mean = trainer_version - version_token_sum / tokens if tokens else float(trainer_version - start)
    return trainer_version - start, trainer_version - end, mean
