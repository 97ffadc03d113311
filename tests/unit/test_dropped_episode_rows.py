"""Lost segment rows of an episode's sample that made calls: the next attempt resumes.

A sample whose rows are lost (``SegmentsDropped``) samples its tokens again from the
prompt. If it had made calls, their results describe turns it no longer has: before, the
fold kept them, and every later attempt's resume refused the sample ("the result
recorded 4 observation tokens, the rows hold 0") until the group ran out of attempts --
where one lost row should cost one attempt (``docs/segments.md``, recovery rule 6). Now
the fold begins that sample's episode again (new keys), and the resume reads clean.
"""

from __future__ import annotations

import torch

from controller.episodes import episode_resume
from controller.partial import resume_flushes
from tests.unit.log_builder import LogBuilder
from workers.dataplane import MemoryDataPlane
from workers.envs.durable import read_episode_log


def _lost_after_a_turn() -> LogBuilder:
    """Sample 0 plays turn 1 (3 model tokens, a result with 4 observation tokens);
    sample 1 ends after its turn 1 (5 tokens). The attempt fails and sample 0's model
    row is lost."""
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 0.25, False, 4), 1: (1, 0.5, True, 0)})
    b.flush("g1", {0: (3, 4)}, kind="observation", version=None, turn=1)
    return b.fail("g1").drop_segments("g1", ["g1/a1/s0/k0"])


def test_the_next_attempt_of_a_sample_whose_rows_were_lost_resumes_from_the_prompt():
    state = _lost_after_a_turn().fold()
    played = state.episodes["g1"].samples
    assert (played[0].restart, played[0].turns) == (1, [])  # begins again, new keys
    assert played[1].restart == 0 and [t.result.reward for t in played[1].turns] == [0.5]
    flushes = resume_flushes(state.inflight["g1"])
    assert [(s.sample, s.key) for f in flushes for s in f.segments] == [(1, "g1/a1/s1/k0")]
    plane = MemoryDataPlane()
    plane.put("r1", ["g1/a1/s1/k0"], [{"tokens": torch.arange(5), "logprobs": torch.zeros(5)}])
    log = read_episode_log(plane, "r1", flushes, episode_resume(state, "g1"), 2)
    assert log.restarts == [1, 0] and log.recorded == [0, 5]
    assert sorted(log.turns) == [(1, 1)]  # sample 0 has no turn left to replay
