"""The eviction figures ``bench/bench_async.py`` prints beside its in-flight target.

"evicted tok" is the share of generated tokens that async threw away: the evicted
groups' simulated tokens over every committed group's -- consumed, evicted, or still in
the buffer when the run stopped -- not over the consumed and evicted alone.
"""

from __future__ import annotations

import sys

import pytest

from bench import bench_async
from bench.latency_task import LatencyTask
from controller.config import load_config
from controller.core.state import GroupRecord, GroupStatus
from workers.tasks import prompt_set


def _group(i: int, status: GroupStatus, committed: bool = True) -> GroupRecord:
    return GroupRecord(group_id=f"g{i}", status=status, attempt=0, prompt_index=i,
                       prompt_ref=f"p{i}", n_samples=2, sample_seed=i, dispatch_weight_version=0,
                       admitted_ts=0.0, admitted_position=i,
                       committed_position=i + 10 if committed else None)


def test_the_evicted_share_is_of_every_committed_groups_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_async.py", "--length-dist", "pareto"])
    args = bench_async.parse_args()
    cfg = load_config(None, [])
    task = LatencyTask(**bench_async.task_options(args))
    prompts = prompt_set(task, cfg.task.num_prompts, cfg.run.seed)
    tokens = [float(task.prompt_tokens(prompts[i]) * 2) for i in range(5)]
    groups = [_group(0, GroupStatus.CONSUMED), _group(1, GroupStatus.RELEASED),
              _group(2, GroupStatus.EVICTED), _group(3, GroupStatus.COMMITTED),  # left in the buffer
              _group(4, GroupStatus.ADMITTED, committed=False)]  # in flight: not generated yet
    evicted, share = bench_async.eviction_figures(args, cfg, groups)
    assert evicted == 1
    assert share == tokens[2] / (tokens[0] + tokens[1] + tokens[2] + tokens[3])
