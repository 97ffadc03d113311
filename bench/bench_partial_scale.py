"""In-flight weight updates at cluster scale, in virtual time: where they win and what they cost.

For each fleet size the real ``Controller`` runs on the virtual clock (``sim``) in four
modes, same seeded group times, same run shape (``bench_scale.shape``: 64-512 groups per
step in 4 microbatches, 16 samples, one group per call, ``ready_first``):

  sync        window 0: generation and training alternate;
  async       window 1, partial rollouts off, the torch sampler: a refit lands between
              two tokens (never waits for a generation), and the window bounds each
              group's *oldest* token: a straggler that outlived it is evicted;
  async-call  the same, but a refit lands only between calls: our vLLM backend with
              ``rollout.vllm.chunk_tokens = 0``, and async RL without in-flight updates
              -- the publish (which the trainer awaits) waits for the longest generation
              in flight;
  in-flight   window 1 with partial rollouts (``rollout.partial``): a refit lands between
              two tokens, every flush is recorded, and the window bounds each group's
              *newest* token (a straggler whose tail kept up is trained, not evicted).

Lengths are long-tailed: a group's generation time is drawn from ``--dist`` (lognormal
sigma ``--sigma``, or Pareto shape ``--alpha``, capped at ``--cap`` x the median) and its
completions' length follows it (``--tokens`` at the median), so tokens/s counts the work
trained. The trainer takes ``--trainer-ratio`` x the fleet's mean time to generate a
step. Printed per mode: groups/s and tokens/s (free virtual time: the controller costs
nothing), trainer idle, evicted groups, events per group, lag of each group's oldest
token (mean/max) and every token's own lag (mean); then the in-flight / async and
in-flight / async-call ratios; then, charged (real redis-server, ``appendfsync always``,
the loop's real time added to the virtual clock), the controller's CPU per group of
async and in-flight.

    python bench/bench_partial_scale.py                          # 64, 256, 1024 generators
    python bench/bench_partial_scale.py --dist pareto --alpha 1.2 --generators 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_scale import MICROBATCHES_PER_STEP, SAMPLES, shape  # noqa: E402
from controller.config import Config, load_config  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from sim.harness import SimSpec, simulate  # noqa: E402
from sim.timeline import timeline_of  # noqa: E402
from sim.timings import Lognormal, Pareto, SyntheticTimings  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

#: mode -> (window, extra --set items)
MODES: dict[str, tuple[int, tuple[str, ...]]] = {
    "sync": (0, ()),
    "async": (1, ()),
    "async-call": (1, ("rollout.backend=vllm", "model.kind=hf", "model.path=unused")),
    "in-flight": (1, ("rollout.partial.enabled=true", "staleness.window_basis=newest_token")),
}


def config_for(args: argparse.Namespace, generators: int, mode: str) -> Config:
    window, extra = MODES[mode]
    gps = shape(generators)
    return load_config(None, [
        f"run.steps={max(8, args.groups // gps)}",
        f"rollout.num_generators={generators}",
        f"rollout.samples_per_group={SAMPLES}",
        "rollout.groups_per_call=1",
        f"rollout.partial.segment_tokens={args.segment_tokens}",
        f"train.groups_per_step={gps}",
        f"train.groups_per_microbatch={gps // MICROBATCHES_PER_STEP}",
        f"staleness.window_versions={window}",
        f"staleness.selection={args.selection}",
        "checkpoint.every_steps=100000", "task.num_prompts=1000000", *extra,
    ])


def timings_for(args: argparse.Namespace, cfg: Config) -> SyntheticTimings:
    cap = args.cap * args.median_s if args.cap else None
    gen: Lognormal | Pareto = (Pareto(args.median_s, args.alpha, cap_s=cap) if args.dist == "pareto"
                               else Lognormal(args.median_s, args.sigma, cap_s=cap))
    step_s = args.trainer_ratio * cfg.train.groups_per_step * gen.mean_s / cfg.rollout.num_generators
    refit_s = 0.05 * step_s
    return SyntheticTimings(
        generation=gen, train_per_sequence_s=0.0,
        microbatch_fixed_s=(step_s - refit_s) / MICROBATCHES_PER_STEP, publish=refit_s,
        seed=args.seed, tokens_per_sample=args.tokens, lengths_follow_time=True,
    )


def measure(args: argparse.Namespace, generators: int, mode: str) -> dict[str, float]:
    cfg = config_for(args, generators, mode)
    store = MemoryEventStore()
    out = simulate(store, SimSpec(config=cfg, timings=timings_for(args, cfg), run_id=mode))
    tl, _ = timeline_of(store, mode)
    consumed = [g for g in out.writer.state.groups.values() if g.consumed_step is not None]
    lags = [g.lag for g in consumed if g.lag is not None]
    tokens = sum(sum(g.lengths) for g in consumed)
    # sum over tokens of (T - v_t), T = the claiming step's base version (docs/segments.md)
    token_lag = sum((g.lag + g.weight_version_start) * sum(g.lengths) - g.version_token_sum
                    for g in consumed if g.lag is not None)
    return {
        "groups_s": tl.groups_consumed / tl.wall_s, "tokens_s": tokens / tl.wall_s,
        "idle": tl.trainer_idle_s / tl.wall_s, "refit": tl.refit_s / tl.wall_s,
        "evicted": float(tl.evicted), "events": out.events / max(1, tl.groups_consumed),
        "lag_mean": sum(lags) / max(1, len(lags)), "lag_max": float(max(lags, default=0)),
        "token_lag": token_lag / max(1, tokens),
    }


def charged_cpu_ms(args: argparse.Namespace, server: RedisServer, generators: int, mode: str) -> float:
    """Controller CPU per group with the log on redis-server, its real time charged."""
    cfg = config_for(args, generators, mode)
    store = RedisEventStore(server.url)
    run_id = f"{mode}-g{generators}"
    try:
        out = simulate(store, SimSpec(config=cfg, timings=timings_for(args, cfg), run_id=run_id,
                                      charge_real_time=True))
        groups = sum(1 for g in out.writer.state.groups.values() if g.consumed_step is not None)
    finally:
        store.close()
    return 1e3 * out.controller_cpu_s / max(1, groups)


COLUMNS = [("groups/s", "groups_s", "{:9.2f}"), ("tokens/s", "tokens_s", "{:10,.0f}"),
           ("trainer idle", "idle", "{:12.1%}"), ("refit", "refit", "{:6.1%}"),
           ("evicted", "evicted", "{:7.0f}"), ("events/group", "events", "{:12.2f}"),
           ("lag mean/max", None, ""), ("token lag", "token_lag", "{:9.2f}")]


def print_point(generators: int, rows: dict[str, dict[str, float]]) -> None:
    header = f"{'mode':<11}" + " ".join(f"{name:>{max(len(name), 9)}}" for name, _, _ in COLUMNS)
    print(f"\n{generators} generators, {shape(generators)} groups/step")
    print(header)
    print("-" * len(header))
    for mode, r in rows.items():
        cells = []
        for name, key, fmt in COLUMNS:
            text = f"{r['lag_mean']:.2f}/{r['lag_max']:.0f}" if key is None else fmt.format(r[key])
            cells.append(f"{text:>{max(len(name), 9)}}")
        print(f"{mode:<11}" + " ".join(cells))
    f, a, c = rows["in-flight"], rows["async"], rows["async-call"]
    print(f"in-flight / async: {f['groups_s'] / a['groups_s']:.2f}x groups/s, "
          f"{f['tokens_s'] / a['tokens_s']:.2f}x tokens/s;  in-flight / async-call: "
          f"{f['groups_s'] / c['groups_s']:.2f}x groups/s, {f['tokens_s'] / c['tokens_s']:.2f}x tokens/s",
          flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generators", default="64,256,1024")
    ap.add_argument("--groups", type=int, default=4096, help="groups trained per run (about)")
    ap.add_argument("--dist", choices=["lognormal", "pareto"], default="lognormal")
    ap.add_argument("--median-s", type=float, default=20.0, help="median generation time of a group")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto shape")
    ap.add_argument("--cap", type=float, default=20.0,
                    help="longest generation, x the median (a max_response_length); 0: none")
    ap.add_argument("--tokens", type=int, default=256, help="completion length at the median")
    ap.add_argument("--segment-tokens", type=int, default=256, help="rollout.partial.segment_tokens")
    ap.add_argument("--trainer-ratio", type=float, default=0.8,
                    help="trainer time per step / the fleet's mean time to generate a step")
    ap.add_argument("--selection", default="ready_first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-charged", dest="charged", action="store_false",
                    help="skip the charged runs on redis-server (controller CPU)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    law = (f"pareto(alpha {args.alpha:g})" if args.dist == "pareto" else f"lognormal(sigma {args.sigma:g})")
    print(f"generation time {law}, median {args.median_s:g}s, capped at {args.cap:g}x; lengths follow "
          f"it ({args.tokens} tokens at the median); trainer {args.trainer_ratio:g}x the fleet's step "
          f"time; {args.selection}; segment_tokens {args.segment_tokens}; free virtual time")
    cpu: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-partial-") as tmp, \
            RedisServer(Path(tmp), appendfsync="always") as server:
        for n in [int(x) for x in args.generators.split(",")]:
            print_point(n, {mode: measure(args, n, mode) for mode in MODES})
            if args.charged:
                cpu[n] = {mode: charged_cpu_ms(args, server, n, mode) for mode in ("async", "in-flight")}
    if cpu:
        print("\ncontroller CPU ms per group, charged on redis-server (appendfsync always); "
              "target <= 1 ms")
        for n, by in cpu.items():
            print(f"  {n:>5} generators: async {by['async']:.3f}, in-flight {by['in-flight']:.3f}")


if __name__ == "__main__":
    main()
