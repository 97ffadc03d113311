"""An episode's token trajectory, its data-plane row, and per-token advantages.

Token in, token out: the trajectory is the concatenation of the exact ids that went
into the model and came out of it -- the first observation's ids, each model turn's
sampled ids (EOS included), each later observation's ids -- and nothing is ever
decoded and re-encoded. The loss mask is True on model tokens only; the generator
logprobs sit on the same positions (``workers.batch`` alignment convention).

Per-turn rewards land on the last token of their model turn (``token_rewards``): the
loss side turns them into per-token advantages with :func:`per_token_advantages`
(reward-to-go against the group's mean return), which for a single-turn sample is
exactly today's per-sample GRPO advantage on every completion token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.envs.base import StepKey
from workers.envs.recorder import ModelTurn


@dataclass(frozen=True)
class TurnSpan:
    """Where one model turn and the observation after it sit in the trajectory."""

    turn: int
    #: model tokens are input_ids[start:end]
    start: int
    end: int
    reward: float
    version_start: int
    version_end: int
    #: the observation that followed the turn (empty when the episode ended)
    obs_start: int
    obs_end: int
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode, as the trainer will see it."""

    key: StepKey
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: the weight version of each model token, -1 on observation tokens
    versions: list[int] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    prompt_len: int = 0
    #: why the episode ended: "done" (the env said so), "max_turns", "context"
    end_reason: str = ""

    def append_observation(self, ids: Sequence[int]) -> None:
        if not self.input_ids:
            self.prompt_len = len(ids)
        self.input_ids.extend(ids)
        self.loss_mask.extend([False] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def append_turn(self, turn_no: int, turn: ModelTurn) -> None:
        if len(turn.logprobs) != len(turn.tokens):
            raise ValueError(f"turn {turn_no}: {len(turn.tokens)} tokens, {len(turn.logprobs)} logprobs")
        start = len(self.input_ids)
        self.input_ids.extend(turn.tokens)
        self.loss_mask.extend([True] * len(turn.tokens))
        self.logprobs.extend(turn.logprobs)
        self.versions.extend(turn.token_versions())
        end = len(self.input_ids)
        self.turns.append(
            TurnSpan(turn_no, start, end, 0.0, turn.version_start, turn.version_end, end, end)
        )

    def close_turn(self, reward: float, obs_ids: Sequence[int], info: Mapping[str, Any]) -> None:
        """The env's step after the last turn: its reward, and the observation appended."""
        last = self.turns[-1]
        obs_start = len(self.input_ids)
        self.input_ids.extend(obs_ids)
        self.loss_mask.extend([False] * len(obs_ids))
        self.logprobs.extend([0.0] * len(obs_ids))
        self.versions.extend([-1] * len(obs_ids))
        self.turns[-1] = TurnSpan(
            last.turn, last.start, last.end, float(reward), last.version_start,
            last.version_end, obs_start, len(self.input_ids), dict(info),
        )

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its turns' rewards."""
        return sum(t.reward for t in self.turns)

    @property
    def completion_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def token_rewards(self) -> list[float]:
        out = [0.0] * len(self.input_ids)
        for t in self.turns:
            out[t.end - 1] += t.reward
        return out

    def row(self) -> dict[str, Any]:
        """The data-plane row (``workers.batch.ROW_FIELDS`` plus ``token_rewards``)."""
        import torch

        return {
            "input_ids": torch.tensor(self.input_ids, dtype=torch.int64),
            "loss_mask": torch.tensor(self.loss_mask, dtype=torch.bool),
            "generator_logprobs": torch.tensor(self.logprobs, dtype=torch.float32),
            "token_versions": torch.tensor(self.versions, dtype=torch.int64),
            "reward": torch.tensor(self.reward, dtype=torch.float32),
            "prompt_len": torch.tensor(self.prompt_len, dtype=torch.int64),
            "completion_len": torch.tensor(self.completion_len, dtype=torch.int64),
            "token_rewards": torch.tensor(self.token_rewards(), dtype=torch.float32),
        }


def per_token_advantages(
    token_rewards: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[bool]],
    eps: float = 1e-6,
) -> tuple[list[list[float]], bool]:
    """Per-token GRPO advantages of one group; returns (advantages, zero_variance).

    A token's advantage is its reward-to-go (the rewards at or after it in its own
    episode) minus the group's mean return, over the group's return std; 0 off the
    loss mask. All returns equal: every advantage is exactly 0 (as ``group_advantages``).
    """
    returns = [sum(r) for r in token_rewards]
    n = len(returns)
    if n == 0:
        raise ValueError("a group needs at least one sample")
    mean = sum(returns) / n
    std = (sum((g - mean) ** 2 for g in returns) / n) ** 0.5
    if std < eps:
        return [[0.0] * len(r) for r in token_rewards], True
    out = []
    for rewards, mask in zip(token_rewards, loss_masks):
        if len(rewards) != len(mask):
            raise ValueError(f"token_rewards has {len(rewards)} entries, loss_mask {len(mask)}")
        adv = [0.0] * len(rewards)
        to_go = 0.0
        for t in range(len(rewards) - 1, -1, -1):
            to_go += rewards[t]
            if mask[t]:
                adv[t] = (to_go - mean) / (std + eps)
        out.append(adv)
    return out, False


def describe(traj: Trajectory, decode: Any) -> str:
    """One line per turn: the model's text, its reward, the observation after it."""
    lines = [f"{traj.key} prompt {decode(traj.input_ids[:traj.prompt_len])!r}"]
    for t in traj.turns:
        said = decode(traj.input_ids[t.start:t.end])
        seen = decode(traj.input_ids[t.obs_start:t.obs_end])
        lines.append(f"  turn {t.turn} v{t.version_start}: {said!r} reward {t.reward:.3f}"
                     + (f" -> {seen!r}" if seen else "") + (f" {dict(t.info)}" if t.info else ""))
    return "\n".join(lines)
