"""verl's fully-async staleness ablation, reproduced in virtual time.

verl (recipe fully_async_policy, "128-card Stale Ablation Experiment"): Qwen2.5-Math-7B,
DAPO, 64 rollout + 64 training GPUs (H20), 512 prompts x 16 responses per parameter
sync, ``require_batches`` 4, ``trigger_parameter_sync_step`` 4, partial rollout on. Per
staleness_threshold they publish the mean seconds per step (a parameter sync), of which
the trainer waited for generation ("gen") and trained ("update_actor"), and the total
time of 400 steps (:data:`PUBLISHED`).

Here: the real controller on the virtual clock (``sim``), 64 rollout GPUs with
``--slots`` concurrent groups each (64 x slots simulated generators of one group), one version per 512 groups trained in 4
microbatches of 128 (their require_batches x mini-batch), each row's published
update_actor per step and its remainder (step - gen - update: parameter sync) as the
refit time. The one thing verl does not publish is the generation time of a group; it
is a lognormal cut at ``--cap-s`` (their 28K-token max_response_length bounds the tail;
200 s = threshold 0's step less one microbatch and the sync), whose sigma is assumed
(``--sigma``) and whose median is calibrated so
that the simulated threshold-0.5 row matches the published one (``--calibrate``),
then every other row is a prediction.

Mapping (their threshold -> our settings): their rollouter may run
``(1 + threshold) x 512`` prompts ahead of a parameter sync; ours admits while the live
groups stay under the gate's capacity and the lag bound holds. So threshold 0 ->
``window_versions = 0`` (capacity 512: generate one version's groups, then wait), and
threshold s > 0 -> ``window_versions = 1`` with a live-group capacity of
``(1 + s) x 512`` (a buffer the config validation refuses today -- it asks for
``2 x 512`` at window 1 -- so the simulation sets the gate's capacity directly).

    python bench/verl_ablation.py                   # calibrate on 0.5, predict, 100 steps
    python bench/verl_ablation.py --steps 400 --median-s 150
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.config import load_config  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from sim.harness import SimSpec, simulate  # noqa: E402
from sim.timeline import timeline_of  # noqa: E402
from sim.timings import Lognormal, SyntheticTimings  # noqa: E402

#: partial rollouts as verl runs them: an in-flight group resumes on the new weights at a
#: parameter sync and is kept (the window bounds its newest token); it flushes at each
#: sync (and every segment_tokens, past any length here: the syncs are what matter)
_PARTIAL = ("rollout.partial.enabled=true", "rollout.partial.segment_tokens=1000000",
            "staleness.window_basis=newest_token")

GROUPS_PER_STEP = 512
MICROBATCHES = 4
GENERATORS = 64

#: threshold -> (step s, gen s, update_actor s, total for 400 steps in s), as published
PUBLISHED = {
    0.0: (231.34, 128.47, 98.77, 25 * 3600 + 53 * 60),
    0.1: (171.30, 58.17, 109.12, 19 * 3600 + 59 * 60),
    0.3: (146.11, 38.88, 103.22, 17 * 3600 + 20 * 60),
    0.5: (150.63, 33.14, 113.16, 17 * 3600 + 22 * 60),
}


def run_row(threshold: float, median_s: float, args: argparse.Namespace) -> dict[str, float]:
    step_s, gen_s, update_s, _ = PUBLISHED[threshold]
    window = 0 if threshold == 0 else 1
    cfg = load_config(None, [
        f"run.steps={args.steps}",
        f"rollout.num_generators={GENERATORS * args.slots}",
        "rollout.groups_per_call=1",
        "rollout.samples_per_group=16",
        f"train.groups_per_step={GROUPS_PER_STEP}",
        f"train.groups_per_microbatch={GROUPS_PER_STEP // MICROBATCHES}",
        f"staleness.window_versions={window}",
        f"staleness.selection={args.selection}",
        f"checkpoint.every_steps={args.steps + 1}",
        "checkpoint.retain_payloads=all",
        "task.num_prompts=1000000",
        *(_PARTIAL if args.partial else ()),
    ])
    timings = SyntheticTimings(
        generation=Lognormal(median_s, args.sigma, cap_s=args.cap_s),
        train_per_sequence_s=0.0,
        microbatch_fixed_s=update_s / MICROBATCHES,
        publish=max(0.0, step_s - gen_s - update_s),
        seed=args.seed,
    )
    store = MemoryEventStore()
    real0 = time.perf_counter()
    simulate(store, SimSpec(
        config=cfg, timings=timings, run_id="verl",
        capacity=int(round((1 + threshold) * GROUPS_PER_STEP)),
    ))
    tl, _ = timeline_of(store, "verl")
    s = tl.summary()
    steps = max(1, tl.steps)
    return {
        "step_s": tl.wall_s / steps,
        "gen_wait_s": tl.trainer_idle_s / steps,
        "update_s": tl.trainer_busy_s / steps,
        "lag_mean": s["lag_mean"],
        "lag_max": s["lag_max"],
        "evicted": s["evicted"],
        "events_per_group": len(store.read("verl")) / max(1, tl.groups_consumed),
        "real_s": time.perf_counter() - real0,
    }


def calibrate(args: argparse.Namespace) -> float:
    """Median generation time at which the threshold-0.5 row matches its published step."""
    target = PUBLISHED[0.5][0]
    lo, hi = 10.0, 2000.0
    for _ in range(args.calibration_rounds):
        mid = (lo * hi) ** 0.5
        got = run_row(0.5, mid, args)["step_s"]
        print(f"  calibrating: median {mid:7.1f}s -> {got:7.1f}s per step (target {target})",
              flush=True)
        if got > target:
            hi = mid
        else:
            lo = mid
    return (lo * hi) ** 0.5


def hms(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h}h{rem // 60:02d}m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="simulated steps (wall times scale to 400)")
    ap.add_argument("--sigma", type=float, default=0.7, help="lognormal sigma of a group's generation")
    ap.add_argument("--slots", type=int, default=8, help="concurrent groups per rollout GPU")
    ap.add_argument("--cap-s", type=float, default=200.0,
                    help="longest generation of a group (their max_response_length of 28K tokens "
                         "cuts the tail); default: threshold 0's step - a microbatch - the sync")
    ap.add_argument("--median-s", type=float, help="skip calibration: this median generation time")
    ap.add_argument("--calibration-rounds", type=int, default=7)
    ap.add_argument("--selection", default="ready_first",
                    help="ready_first is their streaming order (whatever finished first)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partial", action="store_true",
                    help="model verl's partial rollout (rollout.partial, newest-token window)")
    ap.add_argument("--both", action="store_true",
                    help="print the rows without and with partial rollouts, side by side")
    args = ap.parse_args()
    median = args.median_s or calibrate(args)
    print(f"\nverl fully-async staleness ablation (128 GPUs: 64 rollout + 64 train), in virtual "
          f"time; 64 GPUs x {args.slots} slots (generators), generation lognormal(median {median:.1f}s, "
          f"sigma {args.sigma}, capped at {args.cap_s:g}s), {args.steps} steps simulated, totals "
          f"scaled to 400 steps")
    header = (f"{'threshold':>9} {'partial':>7} {'ours: window, capacity':>22} | {'published step':>14} "
              f"{'gen':>6} {'update':>6} {'400 steps':>9} | {'simulated step':>14} {'gen wait':>8} "
              f"{'400 steps':>9} {'ratio':>6} {'lag mean/max':>12} {'evicted':>7} {'events/grp':>10}")
    print(header)
    print("-" * len(header))
    modes = (False, True) if args.both else (args.partial,)
    for threshold, (step_s, gen_s, update_s, total_s) in PUBLISHED.items():
        for partial in modes:
            r = run_row(threshold, median, argparse.Namespace(**{**vars(args), "partial": partial}))
            window = 0 if threshold == 0 else 1
            cap = int(round((1 + threshold) * GROUPS_PER_STEP))
            print(f"{threshold:>9} {'on' if partial else 'off':>7} {f'w={window}, {cap}':>22} | "
                  f"{step_s:>14.1f} {gen_s:>6.1f} {update_s:>6.1f} {hms(total_s):>9} | "
                  f"{r['step_s']:>14.1f} {r['gen_wait_s']:>8.1f} {hms(400 * r['step_s']):>9} "
                  f"{400 * r['step_s'] / total_s:>6.2f} {r['lag_mean']:>7.2f}/{r['lag_max']:<4} "
                  f"{r['evicted']:>7} {r['events_per_group']:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
