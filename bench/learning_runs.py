"""Learning speed of config variants over several seeds: ``rl-controller run`` per (variant, seed).

Each run is the full default command (embedded redis-server, local Ray, TransferQueue,
the tiny model, the ``reverse`` task) in a fresh ``--data-dir``, one after the other,
interleaved by seed (seed 0 of every variant, then seed 1, ...) so that a change in a
shared machine's load hits every variant alike. Per run it prints the wall time of the
command, the CPU seconds of every process of its session (Ray's daemons and actors
included: on a shared machine, CPU seconds are steadier than wall time), and, from the
run's ``metrics.jsonl``, when the moving mean reward (5 steps) first reached 0.5, 0.8 and
0.9 -- seconds since the first step began, and the trainer_version. Then per variant the
mean and spread over seeds, and optionally a plot of every run's curve.

    python bench/learning_runs.py --seeds 0,1,2 \\
        --variant off= \\
        --variant on="--set rollout.partial.enabled=true" --plot curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_startup import _timed  # noqa: E402
from bench.learning_curve import moving_mean  # noqa: E402
from events.embedded import stop_embedded_redis  # noqa: E402

LEVELS = (0.5, 0.8, 0.9)


def reached(metrics: Path) -> dict[str, float]:
    """Seconds and trainer_version at which the moving mean first reached each level."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{metrics}: no metrics rows")
    t0 = rows[0]["time"] - rows[0].get("perf/step_s", 0.0)
    smooth = moving_mean([float(r["reward/mean"]) for r in rows])
    out: dict[str, float] = {"steps": float(len(rows)), "last_reward": smooth[-1],
                             "train_s": rows[-1]["time"] - t0}
    for level in LEVELS:
        hit = next((i for i, r in enumerate(smooth) if r >= level), None)
        out[f"t{level}"] = float("nan") if hit is None else rows[hit]["time"] - t0
        out[f"v{level}"] = float("nan") if hit is None else float(rows[hit]["trainer_version"])
    out["curve"] = [(r["time"] - t0, s) for r, s in zip(rows, smooth)]  # type: ignore[assignment]
    return out


def one(command: str, extra: str, seed: int, data_dir: Path, timeout_s: float) -> dict:
    run_id = f"learn-s{seed}"
    argv = [*shlex.split(command), "run", "--no-progress", "--data-dir", str(data_dir),
            "--run-id", run_id, "--set", f"run.seed={seed}", *shlex.split(extra)]
    try:
        wall, cpu, rc, err = _timed(argv, dict(os.environ), timeout_s)
    finally:
        # ``run`` keeps its embedded redis-server for a later resume or audit; this data
        # dir is about to be deleted, so nothing will come back to it
        stop_embedded_redis(data_dir)
    if rc != 0:
        raise SystemExit(f"run failed (exit {rc}): {' '.join(argv)}\n{err}")
    got = reached(data_dir / "runs" / run_id / "metrics.jsonl")
    got.update(wall_s=wall, cpu_s=sum(v for k, v in cpu.items() if "process" not in k))
    return got


def _fmt(values: list[float]) -> str:
    ok = [v for v in values if v == v]
    if not ok:
        return "never"
    spread = f" ({min(ok):.0f}-{max(ok):.0f})" if len(ok) > 1 else ""
    missed = f" [{len(values) - len(ok)} never]" if len(ok) < len(values) else ""
    return f"{statistics.fmean(ok):.0f}{spread}{missed}"


def plot(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, runs) in enumerate(results.items()):
        for k, r in enumerate(runs):
            t, m = zip(*r["curve"])
            ax.plot(t, m, color=colours[i % len(colours)], lw=1.4, alpha=0.8,
                    label=name if k == 0 else None)
    ax.axhline(0.9, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="wall time since first step (s)", ylabel="moving mean reward (5 steps)",
           ylim=(0, 1.02), title="default run, one line per seed")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=ARGS",
                    help="a name and the extra run arguments (e.g. on=\"--set k=v\"); repeatable")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--command", default=f"{sys.executable} -m cli.main",
                    help="how to start rl-controller (another checkout: env PYTHONPATH=... python -m cli.main)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--plot", help="write every run's curve here (PNG)")
    args = ap.parse_args()
    variants = [v.partition("=")[::2] for v in args.variant]
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory(prefix="learning-runs-") as tmp:
        for seed in seeds:
            for name, extra in variants:
                r = one(args.command, extra, seed, Path(tmp) / f"{name}-{seed}", args.timeout_s)
                results[name].append(r)
                print(f"{name:<10} seed {seed}: 0.9 at {r['t0.9']:.0f}s (v{r['v0.9']:.0f}), "
                      f"{r['steps']:.0f} steps in {r['train_s']:.0f}s of training, command "
                      f"{r['wall_s']:.0f}s wall / {r['cpu_s']:.0f} CPU s", flush=True)
    print(f"\nmeans over seeds {args.seeds} (min-max):")
    print(f"{'variant':<10} {'0.5 at s':>14} {'0.8 at s':>14} {'0.9 at s':>14} {'0.9 at version':>16} "
          f"{'training s':>14} {'wall s':>14} {'CPU s':>14}")
    for name, runs in results.items():
        col = lambda k: _fmt([r[k] for r in runs])  # noqa: E731
        print(f"{name:<10} {col('t0.5'):>14} {col('t0.8'):>14} {col('t0.9'):>14} "
              f"{col('v0.9'):>16} {col('train_s'):>14} {col('wall_s'):>14} {col('cpu_s'):>14}")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
