"""Plots of a timing what-if (matplotlib, Agg backend), in the staleness tool's style.

Three panels: training progress (trainer_version against time, recorded and each
scenario), mean lag per step, and where the trainer's time went (busy, refit,
checkpoints, idle) per scenario.

Layout: scenario labels can be long (``staleness.window_versions=2, rollout.num_generators=16``),
so they appear once, in a legend under the first two panels, and the bars of the third
are labelled ``recorded``, ``S1``, ``S2``... (the legend says which is which); the
bars' own legend sits under their panel. No legend is drawn over the data.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

#: characters per line of a scenario's name in the legend
LABEL_WIDTH = 48


def build_figure(result: Any) -> Any:
    """The figure (matplotlib ``Figure``), laid out; ``write_plot`` saves it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("recorded", result.recorded)] + [(s.name, s.timeline) for s in result.scenarios]
    short = ["recorded"] + [f"S{i}" for i in range(1, len(series))]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (name, tl) in enumerate(series):
        style = dict(lw=2.0, alpha=0.5) if i == 0 else dict(lw=1.0)
        label = name if i == 0 else f"{short[i]}: {name}"
        ax1.plot([p[0] for p in tl.progress], [p[1] for p in tl.progress],
                 label=textwrap.fill(label, LABEL_WIDTH), **style)
        steps = sorted(tl.step_lags)
        ax2.plot(steps, [tl.step_lags[s][0] for s in steps], **style)
    ax1.set(xlabel="seconds since the first admission", ylabel="trainer_version", title="progress")
    ax2.set(xlabel="step", ylabel="mean lag (versions)", title="lag per step")
    parts = [
        ("busy", [tl.trainer_busy_s for _, tl in series]),
        ("refit", [tl.refit_s for _, tl in series]),
        ("checkpoint", [tl.checkpoint_s for _, tl in series]),
        ("idle", [tl.trainer_idle_s for _, tl in series]),
    ]
    bottom = [0.0] * len(series)
    for label, values in parts:
        ax3.barh(short, values, left=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax3.invert_yaxis()  # recorded on top, the scenarios in the legend's order
    ax3.set(xlabel="seconds", title="trainer time")
    fig.suptitle(f"timing what-if of run {result.run_id} (virtual time)")
    fig.tight_layout()
    # Under the panels, below their x labels: saved with bbox_inches="tight", which
    # grows the image to hold them.
    ax1.legend(loc="upper left", bbox_to_anchor=(0.0, -0.2), fontsize=8, frameon=False,
               ncol=2 if len(series) > 3 else 1)
    ax3.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=4,
               frameon=False)
    return fig


def write_plot(result: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig = build_figure(result)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
