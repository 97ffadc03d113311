"""The read-only tools' plots (matplotlib, Agg backend: no display needed).

:func:`write_plot` draws a staleness report, :func:`write_timing_plot` a timing what-if
(``rl-controller simulate``: progress, lag per step and where the trainer's time went,
recorded and per scenario).

The staleness plot has three panels, each meant to be read at a glance, for a 3-step run
or a 3000-step one:

* lag per step: the window as a shaded band (the allowed region) under the lines, so
  a max lag sitting exactly on the window stays visible; max lag as a step line with
  markers on top, mean lag under it (both a group's *oldest* token's), and the
  token-weighted mean lag -- every token at its own version (``docs/segments.md``) --
  dashed: with partial rollouts a straggler's later tokens are fresher than its first,
  and the title gives the most versions one sample spanned;
* buffer occupancy over time: binned into at most ``OCCUPANCY_BINS`` intervals, the
  mean as a line and the min..max of each bin as a band (a point per event would draw
  a solid block), against the capacity;
* reward vs lag: lags are integers, so every group sits on a few vertical stripes;
  the groups are jittered sideways, and the per-lag mean (with the interquartile
  range and the number of groups) is drawn over them.

:func:`plot_data` builds the series (tests check them); :func:`write_plot` draws them.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from replay.staleness import StalenessReport

#: at most this many time bins in the buffer panel
OCCUPANCY_BINS = 120


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def reward_by_lag(pairs: list[tuple[int, float]]) -> dict[str, list[Any]]:
    """Per lag: the mean reward, its interquartile range and the number of groups."""
    groups: dict[int, list[float]] = defaultdict(list)
    for lag, reward in pairs:
        groups[lag].append(reward)
    lags = sorted(groups)
    out: dict[str, list[Any]] = {"lag": lags, "mean": [], "q25": [], "q75": [], "count": []}
    for lag in lags:
        values = sorted(groups[lag])
        out["mean"].append(mean(values))
        out["q25"].append(_quantile(values, 0.25))
        out["q75"].append(_quantile(values, 0.75))
        out["count"].append(len(values))
    return out


def bin_occupancy(
    t_s: list[float], live: list[int], buffered: list[int], bins: int = OCCUPANCY_BINS
) -> dict[str, list[float]]:
    """Samples grouped into at most ``bins`` equal time intervals (empty ones skipped)."""
    out: dict[str, list[float]] = {k: [] for k in ("t_s", "live_mean", "live_min", "live_max",
                                                    "buffered_mean")}
    if not t_s:
        return out
    t0, t1 = t_s[0], t_s[-1]
    width = (t1 - t0) / bins if t1 > t0 else 1.0
    members: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(t_s):
        members[min(bins - 1, int((t - t0) / width))].append(i)
    for b in sorted(members):
        idx = members[b]
        out["t_s"].append(t0 + (b + 0.5) * width if t1 > t0 else t0)
        out["live_mean"].append(mean(live[i] for i in idx))
        out["live_min"].append(min(live[i] for i in idx))
        out["live_max"].append(max(live[i] for i in idx))
        out["buffered_mean"].append(mean(buffered[i] for i in idx))
    return out


def plot_data(report: StalenessReport) -> dict[str, dict[str, list[Any]]]:
    """The series of each panel: raw (one point per step / sample / group) and summarised."""
    occupancy = {
        "t_s": [p[0] for p in report.occupancy],
        "live": [p[1] for p in report.occupancy],
        "buffered": [p[2] for p in report.occupancy],
    }
    pairs = [(int(p[0]), float(p[1])) for p in report.reward_vs_lag]
    return {
        "lag_per_step": {
            "step": [r.step for r in report.steps],
            "lag_mean": [r.lag_mean for r in report.steps],
            "lag_max": [r.lag_max for r in report.steps],
            "token_lag_mean": [r.token_lag_mean for r in report.steps],
            "max_partial_span": [r.max_partial_span for r in report.steps],
        },
        "occupancy": occupancy,
        "occupancy_binned": bin_occupancy(occupancy["t_s"], occupancy["live"], occupancy["buffered"]),
        "reward_vs_lag": {"lag": [p[0] for p in pairs], "reward_mean": [p[1] for p in pairs]},
        "reward_by_lag": reward_by_lag(pairs),
    }


def _lag_panel(ax: Any, data: dict[str, list[Any]], window: int) -> None:
    steps = data["step"]
    from matplotlib.ticker import MaxNLocator

    ax.axhspan(-0.5, window, color="tab:green", alpha=0.08, zorder=0,
               label=f"within window ({window})")
    ax.axhline(window, color="tab:red", ls="--", lw=1, zorder=1, label=f"window {window}")
    ax.plot(steps, data["lag_mean"], color="tab:blue", lw=1.2, zorder=2,
            label="mean lag (oldest token)")
    ax.plot(steps, data["token_lag_mean"], color="tab:purple", lw=1.2, ls="--", zorder=2,
            label="token-weighted mean lag")
    ax.step(steps, data["lag_max"], where="mid", color="black", lw=1.6, zorder=3,
            marker="o" if len(steps) <= 60 else None, ms=3, label="max lag")
    top = max([window, *data["lag_max"]] or [1])
    ax.set_ylim(-0.3, top + 0.8)
    ax.set_yticks(range(0, top + 1, max(1, (top + 1) // 12)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    span = max(data["max_partial_span"], default=0)
    title = "lag per step" + (f" (a sample spanned up to {span} version{'s' * (span > 1)})" if span else "")
    ax.set(xlabel="step", ylabel="lag (versions)", title=title)
    ax.legend(loc="upper left", fontsize=8, ncol=2)


def _buffer_panel(ax: Any, occ: dict[str, list[float]], capacity: int) -> None:
    t = occ["t_s"]
    ax.fill_between(t, occ["live_min"], occ["live_max"], color="tab:blue", alpha=0.2, lw=0,
                    step="mid", label="live, min..max per bin")
    ax.step(t, occ["live_mean"], where="mid", color="tab:blue", lw=1.2,
            label="live (in flight + buffered + claimed), mean")
    ax.step(t, occ["buffered_mean"], where="mid", color="tab:orange", lw=1.2,
            label="buffered (committed, waiting), mean")
    ax.axhline(capacity, color="tab:red", ls="--", lw=1, label=f"capacity {capacity}")
    ax.set_ylim(0, capacity * 1.25 + 1)
    ax.set(xlabel="seconds since first event", ylabel="groups", title="buffer occupancy")
    ax.legend(loc="upper left", fontsize=7)


def _reward_panel(ax: Any, raw: dict[str, list[Any]], by_lag: dict[str, list[Any]]) -> None:
    import random

    rng = random.Random(0)  # jitter only: the same picture every time
    x = [lag + rng.uniform(-0.18, 0.18) for lag in raw["lag"]]
    ax.scatter(x, raw["reward_mean"], s=5, alpha=0.25, color="tab:gray", label="one group")
    lags, means = by_lag["lag"], by_lag["mean"]
    # The bar is the interquartile range, drawn on its own: a skewed lag (most groups at
    # reward 1.0, a few at 0) has its mean outside it, which an error bar cannot draw.
    ax.vlines(lags, by_lag["q25"], by_lag["q75"], color="tab:red", lw=1, zorder=3)
    for edge in ("q25", "q75"):
        ax.scatter(lags, by_lag[edge], marker="_", s=120, color="tab:red", zorder=3)
    ax.plot(lags, means, color="tab:red", marker="D", ms=6, lw=1, ls=":",
            label="mean per lag (bar: 25-75%)", zorder=3)
    for lag, m, n in zip(lags, means, by_lag["count"]):
        ax.annotate(f"n={n}", (lag, m), textcoords="offset points", xytext=(8, 6), fontsize=8)
    ax.set_xticks(lags or [0])
    ax.set_xlim(min(lags or [0]) - 0.6, max(lags or [0]) + 0.6)
    ax.set(xlabel="lag at consumption (versions)", ylabel="mean reward of the group",
           title="reward vs lag")
    ax.legend(loc="lower left", fontsize=8)


#: characters per line of a scenario's name in the timing what-if's legend
LABEL_WIDTH = 48


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_formats() -> list[str]:
    """The file suffixes a plot can be written as (matplotlib's savefig formats)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def _save(fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    _pyplot().close(fig)
    return out


def write_plot(report: StalenessReport, path: str | Path) -> Path:
    plt = _pyplot()
    data = plot_data(report)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    _lag_panel(ax1, data["lag_per_step"], report.window)
    _buffer_panel(ax2, data["occupancy_binned"], report.capacity)
    _reward_panel(ax3, data["reward_vs_lag"], data["reward_by_lag"])
    fig.suptitle(f"staleness of run {report.run_id}: {len(report.steps)} steps, "
                 f"window {report.window}, capacity {report.capacity}")
    return _save(fig, path)


def timing_figure(result: Any) -> Any:
    """The figure of a timing what-if (``sim.whatif.WhatIfResult``): the recorded run and
    each scenario. Scenario names can be long (``staleness.window_versions=2,
    rollout.num_generators=16``): they appear once, in a legend under the first panel, and
    the trainer-time bars are labelled ``recorded``, ``S1``, ``S2``...; no legend is drawn
    over the data (``write_timing_plot`` saves the figure grown to hold the legends)."""
    plt = _pyplot()
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
    # under the panels, below their x labels
    ax1.legend(loc="upper left", bbox_to_anchor=(0.0, -0.2), fontsize=8, frameon=False,
               ncol=2 if len(series) > 3 else 1)
    ax3.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=4,
               frameon=False)
    return fig


def write_timing_plot(result: Any, path: str | Path) -> Path:
    fig = timing_figure(result)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return out
