"""``segments.record_flush`` adds a flush's tokens per flush, not per segment: the same record.

The pause-fold tests compare the one-pass fold with the parts' handlers, and both call
``record_flush``, so they cannot see a wrong sum in it. Here generated flushes (model and
observation, stopping samples, several versions, a huge version that takes the sums
past 64 bits) are folded by it and by the rule as the docstring of ``InflightSegments``
states it, segment by segment; the records must encode to the same bytes.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from controller.core.segments import InflightSegments, record_flush
from events.schema import SegmentsRecorded
from events.values import Segment

N = 8


def _by_segment(rec: InflightSegments, ev: SegmentsRecorded) -> None:
    """Each segment on its own: its tokens, its stop, and for a model flush the first and
    last version and the token-weighted version sum."""
    rec.flushes.append(ev)
    rec.attempt_flushes += 1
    for seg in ev.segments:
        rec.recorded[seg.sample] += seg.length
        rec.stopped[seg.sample] = seg.stopped
        if ev.weight_version is not None:
            if rec.first_version[seg.sample] == -1:
                rec.first_version[seg.sample] = ev.weight_version
            rec.last_version[seg.sample] = ev.weight_version
            rec.version_token_sum += ev.weight_version * seg.length
            rec.model_tokens += seg.length


def _flushes(rng: random.Random, count: int) -> list[SegmentsRecorded]:
    recorded, stopped, out = [0] * N, [False] * N, []
    for k in range(count):
        model = rng.random() < 0.6
        live = [i for i in range(N) if not stopped[i]]
        if not live:
            break
        segs = []
        for i in rng.sample(live, rng.randint(1, len(live))):
            length = rng.randint(1, 50)
            stop = rng.random() < 0.1
            segs.append(Segment(sample=i, start=recorded[i], length=length, key=f"k{k}.{i}", turn=k, stopped=stop))
            recorded[i] += length
            stopped[i] = stop
        version = rng.choice([0, 1, 7, 2**70]) if model else None
        out.append(SegmentsRecorded(event_id=f"f{k}", epoch=1, ts=0.0, group_id="g", attempt=1, index=k,
                                    kind="model" if model else "observation", weight_version=version,
                                    segments=segs))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_a_flush_recorded_at_once_is_the_flush_recorded_segment_by_segment(seed: int):
    fast, slow = InflightSegments.empty(N, 1), InflightSegments.empty(N, 1)
    for ev in _flushes(random.Random(seed), 12):
        record_flush(fast, ev)
        _by_segment(slow, ev)
    assert msgspec.json.encode(fast) == msgspec.json.encode(slow)
    assert fast.model_tokens > 0 and fast.version_token_sum > 0  # the model branch ran
