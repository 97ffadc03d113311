"""Segment rows in the data plane: keys, rows, version runs, and reading them back.

The layout is ``docs/segments.md``'s: one row per sample per flush, under
``{run}/{group}/a{attempt}/s{sample}/k{index}``, holding that flush's ``tokens`` (int64)
and their behaviour ``logprobs`` (float32); the flush's version is in its event, not
in the row. A resumed group reads its rows back (:func:`load_prefixes`) and checks
them against what the log recorded, so a missing or short row is an error naming its
key, never a silently shorter prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from events.schema import Segment
from workers.api import SegmentFlush
from workers.dataplane.api import DataPlane
from workers.models.decoder import RowPrefix

#: the two fields of a segment row
SEGMENT_FIELDS = ("tokens", "logprobs")


def segment_key(run_id: str, group_id: str, attempt: int, sample: int, index: int) -> str:
    return f"{run_id}/{group_id}/a{attempt}/s{sample}/k{index}"


def version_runs(versions: Sequence[int]) -> list[int]:
    """Run-length encode token versions, flat: ``[v0, n0, v1, n1, ...]``."""
    out: list[int] = []
    for v in versions:
        if out and out[-2] == v:
            out[-1] += 1
        else:
            out += [int(v), 1]
    return out


def expand_runs(runs: Sequence[int]) -> list[int]:
    """The per-token versions that :func:`version_runs` encoded."""
    return [v for v, n in zip(runs[0::2], runs[1::2]) for _ in range(n)]


def segment_rows(
    prefixes: Sequence[RowPrefix], since: Sequence[int], until: Sequence[int] | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    """Rows of the tokens each sample got from ``since[i]`` (to ``until[i]``, else to its
    end; samples with none left out)."""
    rows = {}
    for i, (row, start) in enumerate(zip(prefixes, since)):
        end = len(row.tokens) if until is None else until[i]
        if end > start:
            rows[i] = {
                "tokens": torch.tensor(row.tokens[start:end], dtype=torch.int64),
                "logprobs": torch.tensor(row.logprobs[start:end], dtype=torch.float32),
            }
    return rows


def oldest_run(prefixes: Sequence[RowPrefix], since: Sequence[int]) -> tuple[int, list[int]]:
    """The version of the oldest tokens not yet flushed, and where each sample's run of
    that version ends: what one flush holds (a segment has one version)."""
    version = min(row.versions[start] for row, start in zip(prefixes, since) if len(row.tokens) > start)
    until = []
    for row, start in zip(prefixes, since):
        end, versions = start, row.versions
        while end < len(versions) and versions[end] == version:
            end += 1
        until.append(end)
    return version, until


def load_prefixes(
    plane: DataPlane, partition: str, flushes: Sequence[SegmentFlush], n: int
) -> list[RowPrefix]:
    """Each sample's recorded tokens, from the rows of ``flushes`` (log order)."""
    segs: list[tuple[Segment, int]] = [
        (seg, -1 if f.weight_version is None else f.weight_version)
        for f in flushes for seg in f.segments
    ]
    keys = [seg.key for seg, _ in segs]
    rows = plane.get(partition, keys, list(SEGMENT_FIELDS)) if keys else []
    out = [RowPrefix() for _ in range(n)]
    for (seg, version), row in zip(segs, rows):
        if not 0 <= seg.sample < n:
            raise ValueError(f"segment {seg.key}: sample {seg.sample} outside a group of {n}")
        prefix = out[seg.sample]
        got = int(row["tokens"].shape[0])
        if seg.start != len(prefix.tokens) or got != seg.length or prefix.stopped:
            raise ValueError(
                f"segment {seg.key}: the log recorded {seg.length} tokens at {seg.start}, "
                f"the row has {got} and the sample {len(prefix.tokens)} before it"
                + (" (and it had stopped)" if prefix.stopped else "")
            )
        prefix.tokens += row["tokens"].tolist()
        prefix.logprobs += row["logprobs"].tolist()
        prefix.versions += [version] * got
        prefix.stopped = seg.stopped
    return out
