"""What ``bench_async.py`` prints after its rounds: every mode's mean over rounds as a
table, and the ratios against the targets (async / sync, the physical bound, in-flight /
async in tokens/s and groups/s)."""

from __future__ import annotations

import argparse
import os
import statistics


COLUMNS = [
    ("groups/s", "groups_per_s", "{:8.2f}"),
    ("wall s", "wall_s", "{:7.2f}"),
    ("trainer busy", "trainer_busy", "{:11.1%}"),
    ("data wait", "data_wait", "{:9.1%}"),
    ("publish", "publish", "{:7.1%}"),
    ("waits on ctrl", "ctrl_wait", "{:12.2%}"),
    ("ctrl CPU ms/group", "ctrl_cpu_ms", "{:16.3f}"),
    ("(log appends)", "append_cpu_ms", "{:13.3f}"),
    ("all CPU ms/group", "proc_cpu_ms", "{:16.2f}"),
    ("lag mean/max", "lag", "{:>12}"),
    ("token lag mean", "token_lag", "{:14.2f}"),
    ("tokens/s", "tokens_per_s", "{:8.0f}"),
    ("trainer idle", "trainer_idle", "{:12.1%}"),
    ("evicted", "evicted", "{:7.0f}"),
    ("evicted tok", "evicted_tokens", "{:11.1%}"),
    ("tok/group", "tokens_per_group", "{:9.0f}"),
    ("flushes/group", "flushes", "{:13.2f}"),
    ("pause ms/flush", "pause_ms", "{:14.2f}"),
]
#: Ray only: the actors' own CPU (their processes, not this one)
RAY_COLUMNS = [
    ("trainer CPU ms/group", "trainer_cpu_ms", "{:20.2f}"),
    ("generators CPU ms/group", "gen_cpu_ms", "{:23.2f}"),
]


def length_law(args: argparse.Namespace) -> str:
    cap = f", capped at {args.max_tokens}"
    if args.sigma_tokens == 0:
        return f"{args.median_tokens:g} tok each (no tail)"
    if args.length_dist == "pareto":
        return f"pareto(median {args.median_tokens:g} tok, alpha {args.alpha:g}{cap})"
    return f"lognormal(median {args.median_tokens:g} tok, sigma {args.sigma_tokens:g}{cap})"


def print_table(rows: dict[str, dict[str, float]], ray: bool = False) -> None:
    columns = COLUMNS + RAY_COLUMNS * ray
    header = f"{'mode':<14}" + "  ".join(f"{name:>{len(name)}}" for name, _, _ in columns)
    print(header)
    print("-" * len(header))
    for mode, r in rows.items():
        cells = []
        for name, key, fmt in columns:
            if key == "lag":
                text = f"{r['lag_mean']:.2f}/{r['lag_max']:.0f}"
                cells.append(f"{text:>{len(name)}}")
            else:
                cells.append(f"{fmt.format(r[key]):>{len(name)}}")
        print(f"{mode:<14}" + "  ".join(cells))


def mean_rows(results: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.fmean(r[key] for r in results) for key in results[0]}


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    """The table of every mode's mean over rounds, and the ratios against the targets."""
    rows = {
        "sync (w=0)": mean_rows(results["sync"]),
        f"async (w={args.window})": mean_rows(results["async"]),
    }
    if args.behind:
        rows["async, behind"] = mean_rows(results["async-behind"])
    if args.inflight:
        rows["in-flight"] = mean_rows(results["inflight"])
    print()
    where = "in-process" if args.workers == "local" else "Ray-actor"
    print(f"{args.generators} {where} generators ({args.groups_per_call} group(s)/call), "
          f"{args.groups_per_step} groups/step x "
          f"{args.samples} samples, {args.steps} steps, {args.rounds} round(s), log in {args.store}; "
          f"simulated latency: length {length_law(args)} x {args.decode_us_per_token:g} us/tok "
          f"+ judge lognormal(median "
          f"{args.judge_median_ms:g} ms, sigma {args.judge_sigma:g}) per completion")
    print_table(rows, ray=args.workers == "ray")
    print("lag: of each consumed group's oldest token (its max is the largest lag of any token "
          "trained); token lag mean: every token at its own version (docs/segments.md)")
    sync, asyn = rows["sync (w=0)"], rows[f"async (w={args.window})"]
    ratio = asyn["groups_per_s"] / sync["groups_per_s"]
    per_round = [a["groups_per_s"] / s["groups_per_s"] for s, a in zip(results["sync"], results["async"])]
    print(f"\nasync / sync groups/s: {ratio:.2f}x  (per round: "
          f"{', '.join(f'{r:.2f}x' for r in per_round)}; target >= 1.5x)")
    # The physical bound: with generation and training fully overlapped, a sync step's
    # generation + training phases would take max(generation, training).
    gen_phase = sync["data_wait"]
    train_phase = sync["trainer_busy"] + sync["publish"]
    bound = (gen_phase + train_phase) / max(gen_phase, train_phase, 1e-9)
    print(f"physical bound from the sync run's phases (generation {gen_phase:.0%}, training "
          f"{train_phase:.0%} of its wall time): (gen + train) / max(gen, train) = {bound:.2f}x; "
          f"async achieves {ratio / bound:.0%} of it (target >= 90%)")
    # Attribution: with the publish in line (the train pump publishing before it begins
    # the next step), publishing is serial with both phases when the window is small
    # (the next groups wait for the new weights). The bound with that serial part, and
    # what publishing behind the next step achieved in the same rounds:
    serial = (gen_phase + train_phase) / max(
        max(gen_phase, sync["trainer_busy"]) + sync["publish"], 1e-9
    )
    print(f"  with publishing ({sync['publish']:.0%} of the sync run) serial to both phases: "
          f"bound {serial:.2f}x")
    if args.behind:
        behind = rows["async, behind"]["groups_per_s"] / sync["groups_per_s"]
        print(f"  controller.publish=behind {behind:.2f}x ({behind / bound:.0%} of the bound) vs "
              f"in_line {ratio:.2f}x ({ratio / bound:.0%}); behind / in line = "
              f"{behind / ratio:.2f}x")
    # The CPU bound (in-process, where this process's CPU time is all the work): the
    # sync run's CPU seconds spread over every core are the least wall time any schedule
    # of the same work can take, and the overlap bound cannot beat it.
    if args.workers == "local":
        cores = os.cpu_count() or 1
        cpu_bound = cores / max(sync["cpu_per_wall"], 1e-9)
        both = min(bound, cpu_bound)
        print(f"  CPU bound: the sync run used {sync['cpu_per_wall']:.2f} of {cores} cores, so no "
              f"schedule of its work beats {cpu_bound:.2f}x; min(overlap, CPU) = {both:.2f}x, "
              f"async achieves {ratio / both:.0%} of it")
    # The bounds assume each phase keeps its sync duration when overlapped; on shared
    # cores (and one GIL, in-process) overlapped phases slow each other down.
    slow_train = (asyn["trainer_busy"] * asyn["wall_s"]) / max(sync["trainer_busy"] * sync["wall_s"], 1e-9)
    slow_pub = (asyn["publish"] * asyn["wall_s"]) / max(sync["publish"] * sync["wall_s"], 1e-9)
    print(f"  trainer time async/sync {slow_train:.2f}x, publish time {slow_pub:.2f}x "
          "(> 1: the overlapped phases compete for the same cores)")
    if args.inflight:
        fl = rows["in-flight"]
        pairs = list(zip(results["async"], results["inflight"]))

        def rounds(key: str) -> str:
            return ", ".join(f"{f[key] / a[key]:.2f}x" for a, f in pairs)

        # Under a tail, groups are not alike: a long group that outlives the window is
        # evicted by async after it was generated in full, so async trains on a subset
        # biased to short completions and its groups/s counts the cheap ones. tokens/s
        # (the figure NeMo-RL's in-flight updates report) counts the work trained.
        print(f"in-flight / async tokens/s: {fl['tokens_per_s'] / asyn['tokens_per_s']:.2f}x "
              f"(per round: {rounds('tokens_per_s')}; target >= 1.3x with long-tailed lengths, "
              f">= 1.0x without)")
        print(f"  groups/s {fl['groups_per_s'] / asyn['groups_per_s']:.2f}x (per round: "
              f"{rounds('groups_per_s')}); a consumed group is {fl['tokens_per_group']:.0f} "
              f"simulated tokens in-flight, {asyn['tokens_per_group']:.0f} async, which evicted "
              f"{asyn['evicted']:.0f} generated groups ({asyn['evicted_tokens']:.0%} of its "
              f"tokens) per run against {fl['evicted']:.0f}")
        # What in-flight refits can win in groups/s with the torch sampler (whose refit
        # already lands between tokens): the time async's trainer waited for data, and
        # the generation its evictions threw away -- not the trainer's own time.
        ceiling = 1.0 / max(1e-9, 1.0 - asyn["data_wait"])
        print(f"  async's trainer waited for data {asyn['data_wait']:.1%} of its wall time: "
              f"groups/s ceiling for any generator speed-up {ceiling:.2f}x (trainer busy "
              f"{asyn['trainer_busy']:.0%}, publishing {asyn['publish']:.0%})")
    worst_cpu = max(r["ctrl_cpu_ms"] for rs in results.values() for r in rs)
    print(f"controller CPU per group, worst run: {worst_cpu:.3f} ms (target < 1 ms)")
