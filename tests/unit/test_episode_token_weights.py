"""A step's token-weighted lag weighs each group by the tokens it trains: model tokens.

An episode's commit counts its env's observation tokens in ``lengths`` (they sit in
the row), but the loss masks them and the trainer's ``num_tokens`` leaves them out.
Weighed by every token, the staleness report, the step's logged metrics and the
what-if's recorded column gave an episode group with long tool results more say in
``lag_token_weighted`` than the tokens it trained on, and ``tokens/completion`` counted
the observations as completions. Hand-built log, exact fractions.
"""

from __future__ import annotations

from controller.core.step_metrics import consumed_group_stats
from replay import whatif
from replay.staleness import Trace, analyze
from tests.unit.log_builder import LogBuilder

# g1's episodes: sample 0 plays two turns (3 + 2 model tokens, 4 observation tokens
# between), sample 1 one turn of 5: 10 model tokens, 4 observation tokens, lag 1.
# g2 is single-turn, 4 + 4 tokens, lag 0; so are the first step's f1 and f2, 3 + 3 each.
G1_MODEL, G1_OBS, G2_TOKENS, F_TOKENS = 10, 4, 8, 12
LAG_MODEL_WEIGHTED = (1 * G1_MODEL + 0 * G2_TOKENS) / (G1_MODEL + G2_TOKENS)
RUN_LAG_MODEL_WEIGHTED = 1 * G1_MODEL / (G1_MODEL + G2_TOKENS + F_TOKENS)


def _log() -> LogBuilder:
    b = LogBuilder(run_id="r1", window=1, groups_per_step=2, samples_per_group=2).start()
    b.admit("f1").admit("f2").admit("g1")  # g1 at version 0 plays while f1 and f2 train
    b.commit("f1", lengths=[3, 3]).commit("f2", lengths=[3, 3])
    b.train_step(["f1", "f2"], microbatch_groups=2).publish()
    b.flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 0.25, False, 4), 1: (1, 0.5, True, 0)})
    b.flush("g1", {0: (3, 4)}, kind="observation", version=None, turn=1)
    b.flush("g1", {0: (7, 2)}, turn=2).request("g1", {0: (2, "c")})
    b.complete("g1", {0: (2, 0.5, True, 0)})
    b.commit("g1", end=0, rewards=[0.75, 0.5], lengths=[9, 5])
    b.admit("g2").commit("g2", lengths=[4, 4])
    return b.train_step(["g1", "g2"], microbatch_groups=2)


def test_the_staleness_report_weighs_lag_by_model_tokens():
    state = _log().fold()
    assert state.groups["g1"].obs_tokens == G1_OBS  # the episode's observations are known
    report = analyze(state, Trace())
    step = report.steps[1]
    assert step.lag_mean == 0.5
    assert step.lag_token_weighted == LAG_MODEL_WEIGHTED  # not 14 / 22: observations left out
    assert report.summary["lag_token_weighted"] == RUN_LAG_MODEL_WEIGHTED


def test_the_steps_logged_metrics_weigh_lag_by_model_tokens_and_count_observations_apart():
    state = _log().fold()
    stats = consumed_group_stats(state, ["g1", "g2"])
    assert stats["lag/token_weighted"] == LAG_MODEL_WEIGHTED
    assert stats["tokens/completion"] == G1_MODEL + G2_TOKENS  # the trainer's num_tokens
    assert stats["tokens/observation"] == G1_OBS
    # a single-turn step has no observation figure (its metrics stay as they were)
    assert "tokens/observation" not in consumed_group_stats(state, ["f1", "f2"])


def test_the_what_ifs_recorded_and_simulated_columns_weigh_by_model_tokens():
    b = _log()
    state = b.fold()
    result = whatif.simulate([(s.position, s.event) for s in b.events], whatif.recorded_settings(state))
    out = whatif.compare(state, result)
    assert out["steps"]["identical"] == 2  # the recorded settings take the same batches
    assert out["recorded"]["lag_token_weighted"] == RUN_LAG_MODEL_WEIGHTED
    assert out["what_if"]["lag_token_weighted"] == RUN_LAG_MODEL_WEIGHTED
