"""Episodes in the reducer: env intents and results, restarts, the commit's checks, and
per-turn advantages -- given events -> then state, or the violation it names."""

from __future__ import annotations

import pytest

from controller.core import decisions
from controller.core.episodes import EpisodeSummary, turn_advantages
from tests.unit.log_builder import LogBuilder, assert_violation
from workers.envs.trajectory import per_token_advantages


def _b() -> LogBuilder:
    return LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()


def _two_turns(b: LogBuilder) -> LogBuilder:
    """Sample 0 plays two turns (3 + 2 model tokens, 4 observation tokens between);
    sample 1 ends after its first turn (5 tokens)."""
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 0.25, False, 4), 1: (1, 0.5, True, 0)})
    b.flush("g1", {0: (3, 4)}, kind="observation", version=None, turn=1)
    b.flush("g1", {0: (7, 2)}, turn=2).request("g1", {0: (2, "c")})
    return b.complete("g1", {0: (2, 0.5, True, 0)})


def _commit(b: LogBuilder, rewards=(0.75, 0.5), lengths=(9, 5)) -> LogBuilder:
    return b.commit("g1", rewards=list(rewards), lengths=list(lengths))


def test_an_episode_group_commits_with_its_turns_rewards_and_starts():
    state = _commit(_two_turns(_b())).fold()
    group = state.groups["g1"]
    assert "g1" not in state.episodes and "g1" not in state.inflight
    assert group.episode == EpisodeSummary(starts=((0, 7), (0,)), rewards=((0.25, 0.5), (0.5,)))


def test_the_state_holds_what_an_episode_recorded_until_the_commit():
    state = _two_turns(_b()).fold()
    rec = state.episodes["g1"]
    assert rec.attempt_events == 4 and rec.env == "calc" and rec.dedupes_by_key
    assert [t.turn for t in rec.samples[0].turns] == [1, 2]
    assert rec.samples[0].ended and rec.samples[1].ended


def _fail_and_readmit(b: LogBuilder) -> LogBuilder:
    return b.fail("g1").admit("g1")


VIOLATIONS = [
    pytest.param(lambda b: b.request("g1", {0: (1, "a")}), "not admitted", id="unknown-group"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (2, "a")}), "the next call of this episode is turn 1", id="turn-skipped"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}, index=3), "env event index 3, expected 0", id="index-gap"),
    pytest.param(lambda b: b.admit("g1").request("g1", {}), "no calls", id="no-calls"),
    pytest.param(lambda b: b.admit("g1").request("g1", {2: (1, "a")}), "outside the group of 2", id="bad-sample"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).request("g1", {0: (1, "a")}),
                 "already requested by attempt 1", id="asked-twice"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).request("g1", {0: (2, "a")}),
                 "turn 1 was requested and has no result yet", id="next-turn-before-result"),
    pytest.param(lambda b: _fail_and_readmit(b.admit("g1").request("g1", {0: (1, "a")}, dedupes=False))
                 .request("g1", {0: (1, "a")}, dedupes=False), "cannot deduplicate", id="reissued-without-dedupe"),
    pytest.param(lambda b: _fail_and_readmit(b.admit("g1").request("g1", {0: (1, "a")}))
                 .request("g1", {0: (1, "other")}), "re-issued with request other", id="replay-differs"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).request("g1", {1: (1, "b")}, env="other"),
                 "env 'other'", id="env-changed"),
    pytest.param(lambda b: b.admit("g1").complete("g1", {0: (1, 1.0, True, 0)}), "no call was requested", id="result-without-intent"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).complete("g1", {1: (1, 1.0, True, 0)}),
                 "a result for a call attempt 1 did not request", id="result-for-another-sample"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).complete("g1", {0: (1, float("nan"), True, 0)}),
                 "not finite", id="nan-reward"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).complete("g1", {0: (1, 1.0, True, 3)}),
                 "3 observation tokens after the episode ended", id="observation-after-end"),
    pytest.param(lambda b: _fail_and_readmit(b.admit("g1").request("g1", {0: (1, "a")}))
                 .complete("g1", {0: (1, 1.0, True, 0)}), "did not request", id="result-of-an-older-attempt"),
    pytest.param(lambda b: _two_turns(b).request("g1", {0: (3, "d")}), "the episode already ended", id="after-the-end"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).complete("g1", {0: (1, 0.0, True, 0)}).commit("g1"),
                 "sample 1: its episode has not ended", id="commit-unended"),
    pytest.param(lambda b: _commit(_two_turns(b), rewards=(0.75, 0.25)), "reward 0.25 committed, its turns' rewards sum to 0.5",
                 id="commit-reward-differs"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}, dedupes=False).fail("g1").restart_episodes("g1", [1]),
                 "samples \\[1\\] have no call without a result", id="restart-nothing-pending"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}, dedupes=False).restart_episodes("g1", [0]),
                 "restart only after attempt 1 failed", id="restart-in-flight"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}, dedupes=False).fail("g1")
                 .restart_episodes("g1", [0]).admit("g1").request("g1", {0: (1, "a")}, dedupes=False),
                 "restart 0 in the key, but the episode is at restart 1", id="old-key-after-restart"),
]


@pytest.mark.parametrize(("build", "message"), VIOLATIONS)
def test_violation_names_the_call_and_leaves_state_intact(build, message):
    assert_violation(build(_b()).build(), message)


def test_a_deduping_env_s_call_without_result_is_reissued_by_the_next_attempt():
    b = _b().admit("g1").flush("g1", {0: (0, 3), 1: (0, 2)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}).fail("g1").admit("g1")
    assert decisions.episodes_restarted(b.fold(), "g1", decisions.Stamp(1, 1.0, 1)) is None
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 1.0, True, 0), 1: (1, 0.0, True, 0)})
    state = _commit(b, rewards=(1.0, 0.0), lengths=(3, 2)).fold()
    assert state.groups["g1"].episode == EpisodeSummary(starts=((0,), (0,)), rewards=((1.0,), (0.0,)))


def test_a_non_deduping_env_s_unanswered_episode_restarts_with_new_keys_from_the_prompt():
    b = _b().admit("g1").flush("g1", {0: (0, 3), 1: (0, 2)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}, dedupes=False)
    b.complete("g1", {1: (1, 0.5, False, 2)}, restart=0)
    b.flush("g1", {1: (2, 2)}, kind="observation", version=None, turn=1)
    b.fail("g1")
    stamp = decisions.Stamp(1, 1.0, b.last_position + 1)
    decision = decisions.episodes_restarted(b.fold(), "g1", stamp)
    assert decision is not None and decision.samples == [0]  # sample 1's call has its result
    assert decision.event_id == "group:g1:restarted:a1" and "cannot deduplicate" in decision.reason
    b.append(decision)
    b.admit("g1")
    state = b.fold()
    assert state.episodes["g1"].samples[0].restart == 1 and not state.episodes["g1"].samples[0].turns
    assert state.inflight["g1"].recorded == [0, 4]  # sample 0's tokens dropped, 1's kept
    # sample 0 starts over from token 0 under restart 1; sample 1 goes on where it was
    b.flush("g1", {0: (0, 2)}, turn=1, index=0).request("g1", {0: (1, "z")}, dedupes=False, restart=1)
    b.complete("g1", {0: (1, 1.0, True, 0)}, restart=1)
    b.flush("g1", {1: (4, 1)}, turn=2).request("g1", {1: (2, "c")}, dedupes=False)
    b.complete("g1", {1: (2, 0.25, True, 0)})
    state = _commit(b, rewards=(1.0, 0.75), lengths=(2, 5)).fold()
    assert state.groups["g1"].episode == EpisodeSummary(starts=((0,), (0, 4)), rewards=((1.0,), (0.5, 0.25)))


def test_turn_advantages_are_the_trajectory_s_per_token_advantages_exactly():
    # three samples, turns of several lengths, observations between them
    spans = [[(0, 3, 0.1), (5, 2, 0.7)], [(0, 4, 0.0)], [(0, 1, 0.3), (3, 2, 0.0), (7, 1, 0.45)]]
    completion = [9, 4, 8]
    summary = EpisodeSummary(starts=[[s for s, _, _ in t] for t in spans],
                             rewards=[[r for _, _, r in t] for t in spans])
    runs, zero = turn_advantages(summary)
    token_rewards, masks = [], []
    for turns, n in zip(spans, completion):
        rewards, mask = [0.0] * n, [False] * n
        for start, length, reward in turns:
            rewards[start + length - 1] += reward
            mask[start:start + length] = [True] * length
        token_rewards.append(rewards)
        masks.append(mask)
    want, want_zero = per_token_advantages(token_rewards, masks)
    assert zero == want_zero is False
    for run, adv, mask in zip(runs, want, masks):
        starts, values = run[0::2], run[1::2]
        for t, on in enumerate(mask):
            if on:
                j = max(k for k, s in enumerate(starts) if s <= t)
                assert values[j] == adv[t]  # bit for bit


def test_equal_returns_give_exactly_zero_turn_advantages():
    runs, zero = turn_advantages(EpisodeSummary(starts=[[0, 4], [0]], rewards=[[0.5, 0.5], [1.0]]))
    assert zero and runs == [[0.0, 0.0, 4.0, 0.0], [0.0, 0.0]]
