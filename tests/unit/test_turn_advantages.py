"""Per-turn rewards -> per-token advantages, the way the controller sends them: the
summary the reducer keeps, ``turn_advantages`` (pure core), the trainer's ``collate``.
On every model token the [B, T] advantages equal the trajectory's own
``per_token_advantages`` (float32 of the same float64 value)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from controller.core.episodes import EpisodeSummary, turn_advantages
from controller.core.policies import group_advantages
from workers.batch import collate
from workers.envs.base import StepKey
from workers.envs.recorder import ModelTurn
from workers.envs.trajectory import Trajectory, per_token_advantages


def _trajectory(sample: int, prompt: int, turns: list[tuple[int, float, int]]) -> Trajectory:
    """``turns``: (model tokens, reward, observation tokens after it)."""
    traj = Trajectory(StepKey("r", "g", sample, 0))
    traj.append_observation(list(range(1, prompt + 1)))
    for n, (length, reward, obs) in enumerate(turns, start=1):
        traj.append_turn(n, ModelTurn(tuple([7] * length), tuple([-0.5] * length), True, 0, 0))
        traj.close_turn(reward, [3] * obs, {})
    return traj


TRAJS = [
    _trajectory(0, 4, [(3, 0.1, 2), (2, 0.7, 0)]),
    _trajectory(1, 6, [(5, 0.0, 0)]),
    _trajectory(2, 3, [(1, 0.3, 4), (2, 0.0, 1), (1, 0.45, 0)]),
]


def _summary(trajs: list[Trajectory]) -> EpisodeSummary:
    return EpisodeSummary(starts=[[t.start - tr.prompt_len for t in tr.turns] for tr in trajs],
                          rewards=[[t.reward for t in tr.turns] for tr in trajs])


def test_the_trainer_s_advantages_are_the_trajectory_s_per_token_advantages():
    runs, _ = turn_advantages(_summary(TRAJS))
    per_sample, _ = group_advantages([t.reward for t in TRAJS])
    batch = collate([t.row() for t in TRAJS], per_sample, turn_advantages=runs)
    want, _ = per_token_advantages([t.token_rewards() for t in TRAJS], [t.loss_mask for t in TRAJS])
    assert batch.advantages.shape == batch.input_ids.shape
    for i, traj in enumerate(TRAJS):
        mask = torch.tensor(traj.loss_mask)
        got = batch.advantages[i, : len(traj.loss_mask)][mask]
        assert torch.equal(got, torch.tensor(want[i], dtype=torch.float32)[mask])


def test_single_turn_runs_give_the_per_sample_advantages_on_every_model_token():
    trajs = [_trajectory(i, 3 + i, [(2 + i, r, 0)]) for i, r in enumerate([0.0, 1.0, 0.5])]
    runs, _ = turn_advantages(_summary(trajs))
    per_sample, _ = group_advantages([t.reward for t in trajs])
    tokenwise = collate([t.row() for t in trajs], per_sample, turn_advantages=runs)
    plain = collate([t.row() for t in trajs], per_sample)
    mask = plain.loss_mask
    assert torch.equal(tokenwise.advantages[mask], plain.token_advantages()[mask])


def test_a_row_without_turns_keeps_its_per_sample_advantage():
    batch = collate([t.row() for t in TRAJS[:2]], [0.25, -0.5], turn_advantages=[[0.0, 1.5], []])
    assert batch.advantages[1].eq(-0.5).all()
    p = TRAJS[0].prompt_len
    assert batch.advantages[0, p:].eq(1.5).all() and batch.advantages[0, :p].eq(0.0).all()


_GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "turn_advantages_golden.json"


def _bits(runs: list[list[float]]) -> list[list[str]]:
    return [[x.hex() for x in run] for run in runs]


def test_turn_advantages_are_bit_identical_to_the_recorded_ones():
    # computed by the code before the fold's fifth pass (``docs/episode-cost.md``; the last
    # two: returns that overflow, whose NaN spread gives zeros and no zero variance): the
    # runs are sent to the trainer, so a cheaper computation must not move one bit
    cases = json.loads(_GOLDEN.read_text())["cases"]
    assert len(cases) == 62 and any(c["zero_variance"] for c in cases)
    for case in cases:
        summary = EpisodeSummary(starts=case["starts"],
                                 rewards=[[float.fromhex(x) for x in r] for r in case["rewards"]])
        runs, zero = turn_advantages(summary)
        assert (_bits(runs), zero) == (case["runs"], case["zero_variance"])


def test_turn_advantages_are_the_trajectory_s_in_float64_bits():
    rng = random.Random(3)
    for _ in range(200):
        rewards = [[rng.choice([0.0, 0.1, 1 / 3, -0.25, rng.uniform(-2, 2)]) for _ in range(rng.randint(1, 10))]
                   for _ in range(rng.choice([1, 2, 5, 16]))]
        starts = [list(range(0, 7 * len(r), 7)) for r in rewards]
        runs, zero = turn_advantages(EpisodeSummary(starts=starts, rewards=rewards))
        # one token per turn: its reward-to-go is the turn's
        want, want_zero = per_token_advantages(rewards, [[True] * len(r) for r in rewards])
        assert zero == want_zero
        assert _bits([run[1::2] for run in runs]) == _bits(want)
        assert [run[0::2] for run in runs] == [[float(s) for s in st] for st in starts]
