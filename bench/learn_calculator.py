"""The calculator learning proof: the same tiny model from the same random weights,
trained on the same questions with the tool and without it, side by side in one run.

    python bench/learn_calculator.py --budget-s 600 --out-dir curves/

Each variant runs ``bench/learn_episodes.py`` (an in-process GRPO loop) for the same
wall-clock budget on the same threads, one after the other, then one table compares
them: when the moving mean return first reached each level, the best moving mean and
the last. A variant whose mean return reaches ``--stop-at`` stops there (the tool
variant, in a minute or two on an idle machine); the other runs its whole budget.
Extra arguments after ``--`` go to both runs (``-- --seed 1 --lr 1e-3``).
Wall seconds count other jobs on a shared machine too; ``cpu_s`` is this process's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learn_episodes  # noqa: E402  (a sibling script, not a package)
from learning_curve import moving_mean  # noqa: E402

VARIANTS = ("calculator", "calculator-notool")
LEVELS = (0.5, 0.8, 0.9)


def summary(rows: list[dict], window: int) -> dict[str, object]:
    """When the moving mean first reached each level (step, wall s, cpu s), best, last."""
    mean = moving_mean([r["reward"] for r in rows], window)
    out: dict[str, object] = {"steps": len(rows), "best": max(mean), "last": mean[-1]}
    for level in LEVELS:
        i = next((i for i, m in enumerate(mean) if m >= level), None)
        out[level] = None if i is None else (rows[i]["step"], rows[i]["time_s"], rows[i]["cpu_s"])
    return out


def table(results: dict[str, dict[str, object]], window: int) -> str:
    head = f"| moving mean ({window} steps) | " + " | ".join(results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for level in LEVELS:
        cells = []
        for s in results.values():
            hit = s[level]
            cells.append("not reached" if hit is None else
                         f"step {hit[0]}, {hit[1]:.0f} s wall, {hit[2]:.0f} s cpu")
        lines.append(f"| reaches {level} | " + " | ".join(cells) + " |")
    for key in ("best", "last"):
        lines.append(f"| {key} | " + " | ".join(f"{s[key]:.3f}" for s in results.values()) + " |")
    lines.append("| steps run | " + " | ".join(str(s["steps"]) for s in results.values()) + " |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], window: int, path: Path) -> None:
    """Moving mean return against training steps, one line per curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        ax.plot([r["step"] for r in rows], moving_mean([r["reward"] for r in rows], window),
                lw=1.5, label=label)
    ax.axhline(0.8, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("training step (16 groups x 16 episodes)")
    ax.set_ylabel(f"mean return ({window}-step moving mean)")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, rest = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=600.0, help="wall seconds per variant")
    p.add_argument("--stop-at", type=float, default=0.95,
                   help="a variant stops early once its 10-step mean return reaches this")
    p.add_argument("--window", type=int, default=10, help="steps in the moving mean")
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    p.add_argument("--curves", type=Path, nargs="+", default=None, metavar="JSONL",
                   help="no runs: summarise (and plot) curves written before by --out")
    args = p.parse_args(ours)
    paths = args.curves or [args.out_dir / f"{task}.jsonl" for task in VARIANTS]
    if not args.curves:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for task, out in zip(VARIANTS, paths):
            out.unlink(missing_ok=True)
            learn_episodes.main(["--task", task, "--budget-s", str(args.budget_s),
                                 "--stop-at", str(args.stop_at), "--out", str(out), *rest])
    curves = {path.stem: [json.loads(line) for line in path.open()] for path in paths}
    empty = [name for name, rows in curves.items() if not rows]
    if empty:
        raise SystemExit(f"{', '.join(empty)}: no step finished (raise --budget-s)")
    print(table({name: summary(rows, args.window) for name, rows in curves.items()}, args.window))
    if args.plot:
        plot(curves, args.window, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
