"""verl's fully-async staleness ablation, reproduced in virtual time.

verl (fully_async_policy, "128-card Stale Ablation Experiment"): Qwen2.5-Math-7B, DAPO,
64 rollout + 64 training GPUs (H20), 512 prompts x 16 responses per parameter sync
(ppo_mini_batch_size 32 x ``require_batches`` 4 x ``trigger_parameter_sync_step`` 4),
partial rollout on. Per staleness_threshold they publish the mean seconds per step (a
parameter sync), of which the trainer waited for generation ("gen") and trained
("update_actor"), and the total time of 400 steps (:data:`PUBLISHED`).

Here: the real controller on the virtual clock (``sim``). Every setting below is verl's
(their ``shell/dapo_7b_math_fsdp2_64_64.sh`` and ``fully_async_rollouter.py``):

* one version = one step of 512 groups trained in 4 microbatches of 128 (the trainer
  fetches require_batches x ppo_mini_batch_size samples at a time);
* run-ahead: ``staleness.budget_basis = "per_version"`` with a budget of
  ``int(128 x (1 + threshold) x 4)`` groups (their ``max_required_samples``; their
  ``staleness_samples`` counter restarts at each sync with the samples the trainer has
  not fetched; docs/scale.md), window 0 at threshold 0 and 1 above it;
* concurrency: at most 16 groups per rollout server (``max_concurrent_samples = 16 x
  servers``), 64 GPUs / tensor-parallel 4 = 16 servers: 256 generators of one group;
* partial rollout: a group in flight at a sync goes on with the new weights and is kept;
* timers (``fully_async_trainer.py``, the metrics aggregator): a published step spans
  the fetches, processing and updates of a version, not its sync -- so the trainer is
  busy step - gen per version (over the 4 microbatches) and the refit takes the rest of
  a version's wall time, total / 400 - step (sync and validation, 1.6-9.9 s);
* decode speed follows the load (``sim.decode``, ``--decode``): a rollout server's step
  time versus the sequences it runs at once is a published vLLM-class measurement
  (NVIDIA NIM, Llama-3.1-8B on H100: docs/scale.md); sequences spread evenly over the
  16 servers, and a group's drawn time is its time on a full server (16 groups x 16
  sequences), so when the budget leaves slots idle the groups still running go faster;
* the last column, slots busy: generation seconds over generators x wall time.

What verl does not publish is a group's generation time: lognormal, sigma assumed
(``--sigma``), cut at ``--cap-s`` (their 28K-token max_response_length bounds the
tail), median calibrated so that the simulated threshold-0.5 row matches its published
time (the default; ``--median-s`` skips it); the cap's default puts threshold 0 on its
published time (``--calibrate-cap`` finds it again) -- then 0.1 and 0.3 are predictions.

    python bench/verl_ablation.py                       # calibrate on 0.5, predict
    python bench/verl_ablation.py --median-s 60.5 --steps 30 --both
    python bench/verl_ablation.py --calibrate-cap --steps 30      # both constants
    python bench/verl_ablation.py --decode none --median-s 80.9 --steps 30   # before
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.config import ConfigError, load_config  # noqa: E402
from controller.core.policies import SELECTION_POLICIES  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from events.schema import GroupCommitted, RolloutAdmitted  # noqa: E402
from sim.decode import NIM_LLAMA31_8B_H100, NIM_LLAMA31_8B_H100_V13, DecodeCurve  # noqa: E402
from sim.harness import SimSpec, simulate  # noqa: E402
from sim.timeline import timeline_of  # noqa: E402
from sim.timings import Lognormal, SyntheticTimings  # noqa: E402

#: partial rollouts as verl runs them: an in-flight group resumes on the new weights at a
#: parameter sync and is kept (the window bounds its newest token); it flushes at each
#: sync (and every segment_tokens, past any length here: the syncs are what matter)
_PARTIAL = ("rollout.partial.enabled=true", "rollout.partial.segment_tokens=1000000",
            "staleness.window_basis=newest_token")

#: ppo_mini_batch_size 32 x require_batches 4 (one trainer fetch, our microbatch) x
#: trigger_parameter_sync_step 4 (fetches per sync, our step)
REQUIRED_SAMPLES = 32 * 4
SYNC_STEPS = 4
GROUPS_PER_STEP = REQUIRED_SAMPLES * SYNC_STEPS
MICROBATCHES = SYNC_STEPS
#: rollout servers: 64 GPUs at tensor-parallel 4; each runs at most 16 groups at once
SERVERS = 64 // 4
CONCURRENT = 16 * SERVERS


#: decode step time versus sequences per server (``sim.decode``): a published curve, or
#: none (a group takes its drawn time whatever else runs)
DECODE_CURVES = {"nim-llama31-8b-h100": NIM_LLAMA31_8B_H100,
                 "nim-llama31-8b-h100-v1.3": NIM_LLAMA31_8B_H100_V13, "none": None}
SAMPLES = 16
#: the longest generation of a group when --cap-s is not given: where threshold 0's
#: simulated time meets its published one at the median calibrated on 0.5
#: (``--calibrate-cap``; docs/scale.md)
DEFAULT_CAP_S = {"nim-llama31-8b-h100": 314.0, "nim-llama31-8b-h100-v1.3": 525.0, "none": 100.0}


def decode_curve(args: argparse.Namespace) -> DecodeCurve | None:
    """The bench's decode model: sequences spread over the rollout servers, drawn times
    holding on a full server (``--concurrent`` groups of 16 sequences over them all)."""
    points = DECODE_CURVES[args.decode]
    if points is None:
        return None
    return DecodeCurve(points=points, servers=SERVERS,
                       reference_sequences=max(1, args.concurrent * SAMPLES // SERVERS))


def budget(threshold: float) -> int:
    """verl's ``max_required_samples``, computed as they do (int() of the product)."""
    return int(REQUIRED_SAMPLES * (threshold + 1) * SYNC_STEPS)


#: threshold -> (step s, gen s, update_actor s, total for 400 steps in s), as published
PUBLISHED = {
    0.0: (231.34, 128.47, 98.77, 25 * 3600 + 53 * 60),
    0.1: (171.30, 58.17, 109.12, 19 * 3600 + 59 * 60),
    0.3: (146.11, 38.88, 103.22, 17 * 3600 + 20 * 60),
    0.5: (150.63, 33.14, 113.16, 17 * 3600 + 22 * 60),
}


def run_row(threshold: float, median_s: float, args: argparse.Namespace) -> dict[str, float]:
    step_s, gen_s, _, total_s = PUBLISHED[threshold]
    window = 0 if threshold == 0 else 1
    cap = budget(threshold)
    per_version = args.basis == "per_version"
    cfg = load_config(None, [
        f"run.steps={args.steps}",
        f"rollout.num_generators={min(args.concurrent, cap)}",
        "rollout.groups_per_call=1",
        f"rollout.samples_per_group={SAMPLES}",
        f"train.groups_per_step={GROUPS_PER_STEP}",
        f"train.groups_per_microbatch={GROUPS_PER_STEP // MICROBATCHES}",
        f"staleness.window_versions={window}",
        f"staleness.selection={args.selection}",
        f"staleness.budget_basis={args.basis}",
        *([f"staleness.buffer_groups={cap}"] if per_version else ()),
        f"checkpoint.every_steps={args.steps + 1}",
        "checkpoint.retain_payloads=all",
        "task.num_prompts=1000000",
        *(_PARTIAL if args.partial else ()),
    ])
    timings = SyntheticTimings(
        generation=Lognormal(median_s, args.sigma, cap_s=args.cap_s),
        train_per_sequence_s=0.0,
        # their step timer spans fetch + processing + update; what is not the fetch
        # (gen) is the trainer's work. The sync runs after it, outside the timer: a
        # version's wall time (total / 400) less its step is the sync (and validation).
        microbatch_fixed_s=(step_s - gen_s) / MICROBATCHES,
        publish=max(0.0, total_s / 400 - step_s),
        seed=args.seed,
    )
    store = MemoryEventStore()
    real0 = time.perf_counter()
    # the live basis refuses a buffer under 2 x 512 at window 1: set past the validation
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="verl",
                            capacity=None if per_version else cap, decode=decode_curve(args)))
    tl, _ = timeline_of(store, "verl")
    generating = _generating_s(store)
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
        # share of the generators' time spent generating: what a budget leaves idle
        "slots_busy": generating / (cfg.rollout.num_generators * tl.wall_s),
        "real_s": time.perf_counter() - real0,
    }


def _generating_s(store: MemoryEventStore) -> float:
    """Seconds of generation summed over groups (admission to commit)."""
    admitted: dict[str, float] = {}
    total = 0.0
    for stored in store.read("verl"):
        event = stored.event
        if isinstance(event, RolloutAdmitted):
            admitted[event.group_id] = event.ts
        elif isinstance(event, GroupCommitted):
            total += event.ts - admitted.pop(event.group_id)
    return total


def _bisect(row: Callable[[float], float], target: float, lo: float, hi: float, rounds: int,
            name: str) -> float:
    """The value in [lo, hi] (geometric bisection) at which ``row`` (increasing) meets
    ``target`` seconds per step."""
    for _ in range(rounds):
        mid = (lo * hi) ** 0.5
        got = row(mid)
        print(f"  calibrating: {name} {mid:7.1f}s -> {got:7.1f}s per step (target {target:.1f})",
              flush=True)
        if got > target:
            hi = mid
        else:
            lo = mid
    return (lo * hi) ** 0.5


def calibrate(args: argparse.Namespace) -> float:
    """Median generation time at which the threshold-0.5 row matches its published time."""
    return _bisect(lambda median: run_row(0.5, median, args)["step_s"], PUBLISHED[0.5][3] / 400,
                   10.0, 2000.0, args.calibration_rounds, "median")


def calibrate_cap(args: argparse.Namespace) -> tuple[float, float]:
    """The cap at which threshold 0 matches its published time, the median recalibrated
    on 0.5 at each cap tried (the two unpublished constants, fixed by the two end rows)."""
    def row0(cap: float) -> float:
        at_cap = argparse.Namespace(**{**vars(args), "cap_s": cap})
        return run_row(0.0, calibrate(at_cap), at_cap)["step_s"]

    cap = _bisect(row0, PUBLISHED[0.0][3] / 400, 50.0, 1000.0, args.calibration_rounds, "cap")
    args.cap_s = cap
    return cap, calibrate(args)


def hms(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h}h{rem // 60:02d}m"


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid" message
    return parse


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=_positive(int), default=100,
                    help="simulated steps (wall times scale to 400)")
    ap.add_argument("--sigma", type=_positive(float), default=0.7,
                    help="lognormal sigma of a group's generation")
    ap.add_argument("--concurrent", type=_positive(int), default=CONCURRENT,
                    help="groups generated at once (verl: 16 per rollout server, 16 servers)")
    ap.add_argument("--basis", choices=("per_version", "live"), default="per_version",
                    help="what the budget counts: verl's per-version samples, or live groups "
                         "(the mapping before staleness.budget_basis existed)")
    ap.add_argument("--cap-s", type=_positive(float),
                    help="longest generation of a group (their 28K-token max_response_length "
                         "cuts the tail); default: where threshold 0's simulated time meets "
                         "its published one at the calibrated median (DEFAULT_CAP_S, "
                         "docs/scale.md)")
    ap.add_argument("--calibrate-cap", action="store_true",
                    help="find the cap on threshold 0 as well (the median recalibrated on 0.5 "
                         "at each cap tried)")
    ap.add_argument("--decode", choices=tuple(DECODE_CURVES), default="nim-llama31-8b-h100",
                    help="decode speed versus sequences per rollout server (sim.decode): a "
                         "published curve, or none (a group's time ignores its server's load)")
    ap.add_argument("--median-s", type=_positive(float), help="skip calibration: this median generation time")
    ap.add_argument("--calibration-rounds", type=_positive(int), default=7)
    ap.add_argument("--selection", default="ready_first", choices=SELECTION_POLICIES,
                    help="ready_first is their streaming order (whatever finished first)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partial", action=argparse.BooleanOptionalAction, default=True,
                    help="model verl's partial rollout (rollout.partial, newest-token window); "
                         "their ablation ran with it on")
    ap.add_argument("--both", action="store_true",
                    help="print the rows without and with partial rollouts, side by side")
    args = ap.parse_args(argv)
    if args.calibrate_cap and (args.cap_s is not None or args.median_s is not None):
        ap.error("--calibrate-cap finds both the cap and the median: drop --cap-s / --median-s, "
                 "or drop --calibrate-cap to use them")
    if args.cap_s is None:
        args.cap_s = DEFAULT_CAP_S[args.decode]
    try:
        _table(args)
    except ConfigError as err:  # e.g. --selection: the config's own message names the key
        ap.error(str(err))


def _table(args: argparse.Namespace) -> None:
    if args.calibrate_cap:
        _, median = calibrate_cap(args)
    else:
        median = calibrate(args) if args.median_s is None else args.median_s
    print(f"\nverl fully-async staleness ablation (128 GPUs: 64 rollout + 64 train), in virtual "
          f"time; {args.concurrent} groups at once, {args.basis} budget, decode {args.decode}, generation lognormal(median {median:.1f}s, "
          f"sigma {args.sigma}, capped at {args.cap_s:g}s), {args.steps} steps simulated, totals "
          f"scaled to 400 steps")
    header = (f"{'threshold':>9} {'partial':>7} {'ours: window, capacity':>22} | {'published step':>14} "
              f"{'gen':>6} {'update':>6} {'400 steps':>9} | {'simulated step':>14} {'gen wait':>8} "
              f"{'400 steps':>9} {'ratio':>6} {'lag mean/max':>12} {'evicted':>7} {'events/grp':>10} "
              f"{'slots busy':>10}")
    print(header)
    print("-" * len(header))
    modes = (False, True) if args.both else (args.partial,)
    for threshold, (step_s, gen_s, update_s, total_s) in PUBLISHED.items():
        for partial in modes:
            r = run_row(threshold, median, argparse.Namespace(**{**vars(args), "partial": partial}))
            window = 0 if threshold == 0 else 1
            cap = budget(threshold)
            print(f"{threshold:>9} {'on' if partial else 'off':>7} {f'w={window}, {cap}':>22} | "
                  f"{step_s:>14.1f} {gen_s:>6.1f} {update_s:>6.1f} {hms(total_s):>9} | "
                  f"{r['step_s']:>14.1f} {r['gen_wait_s']:>8.1f} {hms(400 * r['step_s']):>9} "
                  f"{400 * r['step_s'] / total_s:>6.2f} {r['lag_mean']:>7.2f}/{r['lag_max']:<4} "
                  f"{r['evicted']:>7} {r['events_per_group']:>10.1f} {r['slots_busy']:>10.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
