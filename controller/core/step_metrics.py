"""Per-step controller metrics computed from the folded state (pure).

Lag of the groups a step consumed (mean, max, token-weighted), reward statistics of
their samples, and counts of groups evicted / failed since the previous step.
Timing figures (idle fractions, time waiting for data) are measured by the shell and
merged in by the loop.
"""

from __future__ import annotations

from controller.core.state import RunState


def consumed_group_stats(state: RunState, group_ids: list[str]) -> dict[str, float]:
    groups = [state.groups[g] for g in group_ids]
    if not groups:
        return {}
    lags = [g.lag if g.lag is not None else 0 for g in groups]
    tokens = [sum(g.lengths) for g in groups]
    rewards = [r for g in groups for r in g.rewards]
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    total_tokens = sum(tokens)
    weighted = sum(l * t for l, t in zip(lags, tokens)) / total_tokens if total_tokens else 0.0
    crossed = sum(
        1 for g in groups if g.weight_version_end is not None and g.weight_version_end != g.weight_version_start
    )
    return {
        "lag/mean": sum(lags) / len(lags),
        "lag/max": float(max(lags)),
        "lag/token_weighted": weighted,
        "reward/mean": mean,
        "reward/std": std,
        "groups/consumed": float(len(groups)),
        "groups/crossed_update": float(crossed),
        "tokens/completion": float(total_tokens),
    }
