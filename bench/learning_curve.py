"""Reward-vs-time curve of a run, from its ``metrics.jsonl``.

    python bench/learning_curve.py rlc-data/runs/<run-id>/metrics.jsonl docs/learning_curve.png

Prints the time (from the first step's start) at which the moving mean reward first
reached 0.5, 0.8 and 0.9, and writes the plot.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> tuple[list[float], list[int], list[float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no metrics rows")
    t0 = rows[0]["time"] - rows[0].get("perf/step_s", 0.0)
    return (
        [r["time"] - t0 for r in rows],
        [int(r["trainer_version"]) for r in rows],
        [float(r["reward/mean"]) for r in rows],
    )


def moving_mean(values: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    times, versions, rewards = load(Path(argv[0]))
    smooth = moving_mean(rewards)
    print(f"steps {len(rewards)}, first reward {rewards[0]:.3f}, last {rewards[-1]:.3f}, "
          f"wall {times[-1]:.0f}s")
    for level in (0.5, 0.8, 0.9):
        hit = next((i for i, r in enumerate(smooth) if r >= level), None)
        where = "never" if hit is None else f"{times[hit]:.0f}s (trainer_version {versions[hit]})"
        print(f"  moving mean reward >= {level}: {where}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(times, rewards, lw=0.8, alpha=0.5, label="reward (step mean)")
    ax.plot(times, smooth, lw=2, label="moving mean (5 steps)")
    ax.axhline(0.9, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("wall time since first step (s)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax.set_title("rl-controller run, default config (2 CPU cores)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
