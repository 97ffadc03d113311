"""Staleness plots (matplotlib, Agg backend: no display needed).

Three panels: lag per step (mean and max), buffer occupancy over time (live and
buffered groups against capacity), and mean reward per group against its lag.
:func:`plot_data` builds the series (tests count its points); :func:`write_plot`
draws them into a PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay.staleness import StalenessReport


def plot_data(report: StalenessReport) -> dict[str, dict[str, list[Any]]]:
    """The series of each panel: one point per finished step / occupancy sample / group."""
    return {
        "lag_per_step": {
            "step": [r.step for r in report.steps],
            "lag_mean": [r.lag_mean for r in report.steps],
            "lag_max": [r.lag_max for r in report.steps],
        },
        "occupancy": {
            "t_s": [p[0] for p in report.occupancy],
            "live": [p[1] for p in report.occupancy],
            "buffered": [p[2] for p in report.occupancy],
        },
        "reward_vs_lag": {
            "lag": [p[0] for p in report.reward_vs_lag],
            "reward_mean": [p[1] for p in report.reward_vs_lag],
        },
    }


def write_plot(report: StalenessReport, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plot_data(report)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    lag = data["lag_per_step"]
    ax1.plot(lag["step"], lag["lag_mean"], label="mean lag", lw=1)
    ax1.plot(lag["step"], lag["lag_max"], label="max lag", lw=0.8, alpha=0.7)
    ax1.axhline(report.window, color="red", ls="--", lw=0.8, label=f"window {report.window}")
    ax1.set(xlabel="step", ylabel="lag (versions)", title="lag per step")
    ax1.legend(loc="upper left", fontsize=8)
    occ = data["occupancy"]
    ax2.plot(occ["t_s"], occ["live"], label="live (in flight + buffered + claimed)", lw=0.8)
    ax2.plot(occ["t_s"], occ["buffered"], label="buffered", lw=0.8)
    ax2.axhline(report.capacity, color="red", ls="--", lw=0.8, label=f"capacity {report.capacity}")
    ax2.set(xlabel="seconds since first event", ylabel="groups", title="buffer occupancy")
    ax2.legend(loc="upper left", fontsize=8)
    rvl = data["reward_vs_lag"]
    ax3.scatter(rvl["lag"], rvl["reward_mean"], s=6, alpha=0.4)
    ax3.set(xlabel="lag at consumption", ylabel="mean reward of the group", title="reward vs lag")
    fig.suptitle(f"staleness of run {report.run_id}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
