"""``reducer_groups.check_committed`` raises exactly what applying the commit raises (the
same text), or nothing when applying succeeds, and never changes the state: valid
commits, each kind of bad one (hand-made, as the reducer tables build them), and
commits of generated episode groups, valid and bent."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from controller.core.errors import InvariantViolation
from controller.core.fold import fold
from controller.core.reducer import apply_event
from controller.core.reducer_groups import check_committed
from controller.core.state import RunState, encode_state
from events.schema import GroupCommitted, StoredEvent
from tests.unit.log_builder import LogBuilder
from tests.unit.test_group_marks import _admitted, _versioned
from tests.unit.test_pause_fold import N, _pauses
from tests.unit.test_reducer_episodes import _two_turns
from tests.unit.test_reducer_segments import _at_version


def _text(call: Callable[[], Any]) -> str:
    try:
        call()
    except InvariantViolation as err:
        return str(err)
    return ""


def _check_then_apply(state: RunState, stored: StoredEvent) -> str:
    """The check's text, asserted equal to applying's; the state is unchanged by the check."""
    commit = stored.event
    assert isinstance(commit, GroupCommitted)
    before = encode_state(state)
    checked = _text(lambda: check_committed(state, commit, stored.position))
    assert encode_state(state) == before, "the check changed the state"
    applied = _text(lambda: apply_event(state, commit, stored.position))
    assert checked == applied
    return applied


def _beside(b: LogBuilder) -> LogBuilder:
    """Another group in flight, recorded after g1's records: a check that took g1's out and
    put it back would move it behind this one (the state's bytes would differ)."""
    return b.admit("g9").flush("g9", {0: (0, 1)}).request("g9", {0: (1, "z")})


_PLAYED = dict(rewards=[0.75, 0.5], lengths=[9, 5])

#: (what comes before the commit, the commit's arguments, a part of the violation or "")
CASES = [
    pytest.param(lambda b: b.admit("g1"), {}, "", id="valid"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 4, True)}), {"lengths": [16, 4]}, "", id="valid-segments"),
    pytest.param(_two_turns, _PLAYED, "", id="valid-episodes"),
    pytest.param(lambda b: b, {}, "never admitted", id="unknown-group"),
    pytest.param(lambda b: b.group("g1"), {}, "is committed, not admitted", id="committed-twice"),
    pytest.param(lambda b: b.admit("g1").fail("g1"), {}, "is failed, not admitted", id="failed"),
    pytest.param(lambda b: b.admit("g1"), {"attempt": 2}, "does not match the admitted attempt 1", id="wrong-attempt"),
    pytest.param(lambda b: b.admit("g1"), {"rewards": [1.0]}, "got 2/1/2", id="rewards-count"),
    pytest.param(lambda b: b.admit("g1"), {"payload_keys": ["k"]}, "got 1/2/2", id="keys-count"),
    pytest.param(lambda b: b.admit("g1"), {"lengths": [3]}, "got 2/2/1", id="lengths-count"),
    pytest.param(lambda b: b.admit("g1"), {"n": 0}, "got 0/0/0", id="empty"),
    pytest.param(lambda b: b.admit("g1"), {"start": 1, "end": 0}, "weight_version_end 0 < start 1", id="end-before-start"),
    pytest.param(lambda b: b.admit("g1"), {"lengths": [2**63, 1]}, "a length is not an int64", id="length-not-int64"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 30)}), {}, "16 tokens committed but 30 were recorded", id="fewer-tokens-than-recorded"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {1: (0, 3, True)}), {}, "17 tokens committed but 3 were recorded and it had stopped", id="tokens-after-stop"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}), {"n": 3}, "3 samples committed, 2 recorded", id="samples-vs-recorded"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1").flush("g1", {0: (0, 3)}, version=1), {"start": 2, "end": 2},
                 "recorded versions 1..1 outside the commit's 2..2", id="versions-outside"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1", weight_version=1).flush("g1", {0: (0, 2), 1: (0, 2)}, version=1),
                 {"start": 1, "end": 2, "lengths": [3, 6], "version_runs": [[1, 3], [1, 4, 2, 2]]}, "", id="valid-runs"),
    pytest.param(lambda b: _at_version(b, 3).admit("g1", weight_version=1).flush("g1", {0: (0, 2)}, version=1)
                 .flush("g1", {0: (2, 2)}, version=2).flush("g1", {0: (4, 2)}, version=3),
                 {"start": 1, "end": 3, "lengths": [6, 2], "version_runs": [[1, 4, 3, 2], [3, 2]]},
                 "disagree with its recorded versions 1..3", id="runs-vs-middle-flush"),
    pytest.param(_two_turns, {**_PLAYED, "rewards": [0.75, 0.25]}, "reward 0.25 committed, its turns' rewards sum to 0.5", id="episode-rewards"),
    pytest.param(_two_turns, {"n": 3}, "3 samples committed, 2 have episodes", id="episode-count"),
    pytest.param(lambda b: b.admit("g1").request("g1", {0: (1, "a")}).complete("g1", {0: (1, 0.0, True, 0)}), {},
                 "sample 1: its episode has not ended", id="episode-not-ended"),
    pytest.param(_two_turns, {**_PLAYED, "lengths": [8, 5]}, "9 were recorded", id="episode-tokens"),
]


@pytest.mark.parametrize(("before", "commit", "expected"), CASES)
def test_the_check_raises_what_applying_raises_and_changes_nothing(before, commit, expected):
    b = _beside(before(LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()))
    events = b.commit("g1", **commit).build()
    text = _check_then_apply(fold(events[:-1]), events[-1])
    assert (text == "") == (expected == "") and expected in text, text


@pytest.mark.parametrize("seed", range(4))
def test_generated_episode_groups_commits_valid_and_bent(seed: int):
    rng = random.Random(200 + seed)
    b = _admitted("g1", trainer_version=2)
    for pause in _versioned(rng, _pauses(rng, "g1", turns=rng.randint(1, 5))):
        b.append(pause)
    state = fold(_beside(b).build())
    rewards = [sum(t.result.reward for t in e.turns) for e in state.episodes["g1"].samples]  # type: ignore[union-attr]
    lengths = list(state.inflight["g1"].recorded)
    k = rng.randrange(N)
    bends = {
        "valid": {},
        "reward": {"rewards": [r + (i == k) for i, r in enumerate(rewards)]},
        "short": {"lengths": [n - (i == k) for i, n in enumerate(lengths)]},
        "unflushed tail": {"lengths": [n + (i == k) for i, n in enumerate(lengths)]},  # valid
        "one sample fewer": {"n": N - 1, "rewards": rewards[:-1], "lengths": lengths[:-1]},
        "versions after the tokens'": {"start": 3, "end": 3},
    }
    texts = {}
    for name, bend in bends.items():
        commit = LogBuilder(samples_per_group=N, first_position=state.position + 1)
        commit.attempts["g1"] = 1
        stored = commit.commit("g1", **{"rewards": rewards, "lengths": lengths, "start": 0, "end": 2, **bend}).build()[0]
        texts[name] = _check_then_apply(state.copy(), stored)
    valid = {"valid", "unflushed tail"}
    assert all((texts[name] == "") == (name in valid) for name in bends), texts
