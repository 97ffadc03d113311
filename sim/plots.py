"""Plots of a timing what-if (matplotlib, Agg backend), in the staleness tool's style.

Three panels: training progress (trainer_version against time, recorded and each
scenario), mean lag per step, and where the trainer's time went (busy, refit,
checkpoints, idle) per scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plot(result: Any, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("recorded", result.recorded)] + [(s.name, s.timeline) for s in result.scenarios]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (name, tl) in enumerate(series):
        style = dict(lw=2.0, alpha=0.5) if i == 0 else dict(lw=1.0)
        ax1.plot([p[0] for p in tl.progress], [p[1] for p in tl.progress], label=name, **style)
        steps = sorted(tl.step_lags)
        ax2.plot(steps, [tl.step_lags[s][0] for s in steps], label=name, **style)
    ax1.set(xlabel="seconds since the first admission", ylabel="trainer_version", title="progress")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.set(xlabel="step", ylabel="mean lag (versions)", title="lag per step")
    names = [n for n, _ in series]
    parts = [
        ("busy", [tl.trainer_busy_s for _, tl in series]),
        ("refit", [tl.refit_s for _, tl in series]),
        ("checkpoint", [tl.checkpoint_s for _, tl in series]),
        ("idle", [tl.trainer_idle_s for _, tl in series]),
    ]
    bottom = [0.0] * len(series)
    for label, values in parts:
        ax3.barh(names, values, left=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax3.set(xlabel="seconds", title="trainer time")
    ax3.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"timing what-if of run {result.run_id} (virtual time)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
