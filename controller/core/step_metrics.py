"""Per-step controller metrics computed from the folded state (pure).

Lag of the groups a step consumed (mean, max, token-weighted), reward statistics of
their samples, and counts of groups evicted / failed since the previous step. Tokens
are model tokens, the ones the loss trains (:func:`model_tokens`): an episode's
observation tokens sit in its rows but are masked, so they weigh no lag and count
apart (``tokens/observation``, only for steps that had any).
Timing figures (idle fractions, time waiting for data) are measured by the shell and
merged in by the loop.
"""

from __future__ import annotations

from controller.core.state import GroupRecord, RunState


def model_tokens(group: GroupRecord) -> int:
    """A committed group's model tokens: its completion lengths less its episodes'
    observation tokens (0 for single-turn groups and for logs that did not record them)."""
    return sum(group.lengths) - group.obs_tokens


def consumed_group_stats(state: RunState, group_ids: list[str]) -> dict[str, float]:
    groups = [state.groups[g] for g in group_ids]
    if not groups:
        return {}
    lags = [g.lag if g.lag is not None else 0 for g in groups]
    tokens = [model_tokens(g) for g in groups]
    observations = sum(g.obs_tokens for g in groups)
    rewards = [r for g in groups for r in g.rewards]
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    total_tokens = sum(tokens)
    weighted = sum(l * t for l, t in zip(lags, tokens)) / total_tokens if total_tokens else 0.0
    crossed = sum(
        1 for g in groups if g.weight_version_end is not None and g.weight_version_end != g.weight_version_start
    )
    stats = {
        "lag/mean": sum(lags) / len(lags),
        "lag/max": float(max(lags)),
        "lag/token_weighted": weighted,
        "reward/mean": mean,
        "reward/std": std,
        "groups/consumed": float(len(groups)),
        "groups/crossed_update": float(crossed),
        "tokens/completion": float(total_tokens),
    }
    if observations:
        stats["tokens/observation"] = float(observations)
    return stats
