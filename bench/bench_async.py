"""Asynchronous vs synchronous training throughput, and the controller's own cost.

Runs the real ``Controller`` (admission, train and watchdog pumps, every decision in
the log) with real workers -- one ``TrainerWorker`` and ``--generators``
``GeneratorWorker``s, the tiny model -- twice per round with the same seed. With
``--workers local`` (default) the workers run on threads of this process over the
in-memory data plane; with ``--workers ray`` they are Ray actors in processes of their
own and rows go through TransferQueue, as in ``rl-controller run``:

  (a) sync   -- ``staleness.window_versions = 0``: on-policy; generation and training
                alternate (the baseline every async system is compared with);
  (b) async  -- ``window_versions = --window`` (default 1): generators work on the next
                step's groups while the trainer trains.

The task is ``bench.latency_task:LatencyTask``: the ``reverse`` task plus a
*simulated* long-tail decode time and a lognormal reward/environment latency per
completion (sleeps, like a remote inference server and a sandbox/judge call). Rounds
alternate the order (sync, async, async, sync, ...) so drift in a shared machine's
load hits both modes alike.

Printed per mode (mean over rounds) and as a ratio:

* groups/s -- groups consumed by finished steps / wall time of ``Controller.run``;
* controller CPU per group -- ``time.thread_time()`` of the event-loop thread (the
  controller: pumps, policies, reducer, log appends incl. encoding and the store
  client, *and* the client side of every worker call: thread-pool hand-off, or Ray's
  submit and result), over the run, / groups consumed. Worker threads are not in it.
  ``bench_controller.py`` separates the controller's own part from the transport;
* trainer waits on the controller -- wall time between a trainer call returning and
  the next one being issued, minus the loop's own measure of waiting for selectable
  groups (``perf/data_wait_s``) and minus weight publishing, as a fraction of wall time.

Also printed: the physical bound of the overlap, from the sync run's own phase times --
(generation + training) / max(generation, training), generation being the sync run's
wait for data and training its trainer calls plus publishing -- and the fraction of it
the async run achieves; and, for attribution, the bound with publishing kept serial to
both phases (the next groups wait for the new weights when the window is small, and the
train pump publishes before it begins the next step).

A third mode, (c) async with ``controller.publish = "behind"`` (each version published
while the next step trains), shows what that overlap buys, in the same rounds. A fourth,
(d) in-flight -- async with partial rollouts (``rollout.partial``: a refit lands between
two tokens, every flush is recorded, a group resumes from its last flush) and a window
on each group's newest token (``staleness.window_basis``; ``docs/segments.md``) --
against (b). With ``--decode-in-steps`` (default) the simulated decode time is spent
inside generation, between the real token steps, so a refit can land in the middle of
a long completion; tokens/s counts the simulated completion lengths consumed.

For the in-flight mode it also prints flushes per group and each flush's pause (the
group's generator idle until its ``SegmentsRecorded`` is in the log), under Ray the
actors' own CPU per group, and the ceiling of any generator-side gain over async:
1 / (1 - the share of async's wall time its trainer waited for data).

Targets: async/sync groups/s >= 1.5x; >= 0.9 of the physical bound; controller CPU
< 1 ms per group; in-flight / async >= 1.3x tokens/s with long-tailed lengths, >= 1.0x
without. Under a tail groups are not alike: async evicts a long group that outlived the
window after generating it in full, so it trains on a subset biased to short completions
and its groups/s counts cheap groups. tokens/s (the figure NeMo-RL reports for its
in-flight updates) counts the work trained; groups/s is printed beside it, with the
tokens of a consumed group and the share of generated tokens evicted. The in-flight
gain needs a run that generation bounds (the trainer waiting for data); at the default
shape the trainer bounds it on 2 shared cores (docs/segments.md). The generation-bound
shapes, tail and no tail:

    python bench/bench_async.py --length-dist pareto --decode-us-per-token 4000 \
        --generators 4 --steps 150 --rounds 3 --no-behind
    python bench/bench_async.py --length-dist pareto --sigma-tokens 0 \
        --decode-us-per-token 4000 --generators 4 --steps 150 --rounds 3 --no-behind

    python bench/bench_async.py                      # defaults: 2 generators, window 1
    python bench/bench_async.py --store redis        # log in a real redis-server
    python bench/bench_async.py --steps 40 --rounds 2 --judge-median-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.async_report import report  # noqa: E402
from bench.async_timing import TimedPublisher, TimedTrainer  # noqa: E402
from controller.config import Config, config_to_dict, load_config  # noqa: E402
from controller.loop import Controller  # noqa: E402
from cli.run_cmd import checkpoint_dir  # noqa: E402
from controller.recovery import reconcile_workers  # noqa: E402
from controller.startup import create_run  # noqa: E402
from controller.wiring import start_workers, worker_spec  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from events.store import EventStore  # noqa: E402

TASK = "bench.latency_task:LatencyTask"


def bench_config(
    args: argparse.Namespace, window: int, publish: str = "in_line", inflight: bool = False
) -> Config:
    partial = [
        "rollout.partial.enabled=true", f"rollout.partial.segment_tokens={args.segment_tokens}",
        "staleness.window_basis=newest_token",
    ] if inflight else []
    return load_config(None, [*partial,
        f"staleness.selection={args.selection}",
        f"controller.publish={publish}",
        f"run.seed={args.seed}",
        f"run.steps={args.steps}",
        f'task.name="{TASK}"',
        "task.num_prompts=4096",
        f"dataplane.kind={'memory' if args.workers == 'local' else 'transferqueue'}",
        "dataplane.spill=false",
        f"ray.num_cpus={args.ray_cpus}",
        f"rollout.num_generators={args.generators}",
        f"rollout.groups_per_call={args.groups_per_call}",
        f"rollout.samples_per_group={args.samples}",
        f"train.groups_per_step={args.groups_per_step}",
        f"train.groups_per_microbatch={args.groups_per_microbatch}",
        f"staleness.window_versions={window}",
        f"checkpoint.every_steps={args.steps + 1}",  # no checkpoints inside the measurement
        "checkpoint.retain_payloads=all",
        f"sampling.max_new_tokens={args.max_new_tokens}",
    ])


def loop_config(cfg: Config) -> Config:
    # the run's config, but no retries and a watchdog that never fires here
    return msgspec.structs.replace(cfg, controller=msgspec.structs.replace(
        cfg.controller, stall_timeout_s=60.0, step_retries=0
    ))


def task_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "median_tokens": args.median_tokens,
        "sigma_tokens": args.sigma_tokens,
        "decode_s_per_token": args.decode_us_per_token * 1e-6,
        "judge_median_s": args.judge_median_ms * 1e-3,
        "judge_sigma": args.judge_sigma,
        "seed": args.seed,
        "decode_in_steps": args.decode_in_steps,
        "length_dist": args.length_dist,
        "alpha": args.alpha,
        "max_tokens": args.max_tokens,
    }


def run_once(
    args: argparse.Namespace, store: EventStore, run_id: str, window: int, tmp: Path,
    publish: str = "in_line", inflight: bool = False,
) -> dict[str, float]:
    cfg = bench_config(args, window, publish, inflight)
    run_dir = tmp / run_id
    spec = dataclasses.replace(worker_spec(cfg, run_id, run_dir), task_options=task_options(args))
    workers = start_workers(cfg, spec, local=args.workers == "local")
    try:
        writer = create_run(
            store, run_id, config=config_to_dict(cfg), seed=cfg.run.seed, code_version="bench",
            window_versions=window, groups_per_step=cfg.train.groups_per_step,
            samples_per_group=cfg.rollout.samples_per_group,
        )
        asyncio.run(reconcile_workers(
            writer, workers, cfg.checkpoint, checkpoint_dir=checkpoint_dir(run_dir)
        ))
        trainer, publisher = TimedTrainer(workers.trainer), TimedPublisher(workers.publisher)
        controller = Controller(
            writer, loop_config(cfg), trainer, workers.generators, publisher, workers.payloads,
            checkpoint_dir=checkpoint_dir(run_dir),
        )
        # The loop's own clock of waiting for selectable groups (``perf/data_wait_s``).
        trainer.probe = lambda: (controller.timers, controller.timers.data_wait)
        append_cpu = [0.0]
        plain_append = writer.append

        def timed_append(*events, **kwargs):
            started = time.thread_time()
            try:
                return plain_append(*events, **kwargs)
            finally:
                append_cpu[0] += time.thread_time() - started

        writer.append = timed_append  # type: ignore[method-assign]
        procs = asyncio.run(worker_processes(workers)) if args.workers == "ray" else {}
        actors0 = {role: process_cpu_s(p) for role, p in procs.items()}
        cpu0, wall0, all0 = time.thread_time(), time.perf_counter(), time.process_time()
        asyncio.run(controller.run())
        wall = time.perf_counter() - wall0
        cpu = time.thread_time() - cpu0
        process_cpu = time.process_time() - all0  # every thread: all the work, in-process
        actors = {role: process_cpu_s(p) - actors0[role] for role, p in procs.items()}
    finally:
        workers.close()
    state = writer.state
    consumed = [g for g in state.groups.values() if g.consumed_step is not None]
    per_group = 1e3 / max(1, len(consumed))
    lags = [g.lag for g in consumed if g.lag is not None]
    simulated, token_lag = _token_figures(args, cfg, consumed)
    evicted, evicted_share = eviction_figures(args, cfg, list(state.groups.values()))
    _, data_wait, controller_gap = trainer.gaps_s(publisher.intervals)
    recorder = controller.admission.segment_rows
    return {
        "window": float(window),
        "groups": float(len(consumed)),
        "wall_s": wall,
        "groups_per_s": len(consumed) / wall,
        "trainer_busy": trainer.busy_s() / wall,
        "data_wait": data_wait / wall,
        "publish": publisher.total_s / wall,
        "ctrl_wait": controller_gap / wall,
        "ctrl_cpu_ms": 1e3 * cpu / max(1, len(consumed)),
        "cpu_per_wall": process_cpu / wall,
        "proc_cpu_ms": 1e3 * process_cpu / max(1, len(consumed)),
        "append_cpu_ms": 1e3 * append_cpu[0] / max(1, len(consumed)),
        "events_per_group": state.position / max(1, len(consumed)),
        "lag_mean": statistics.fmean(lags) if lags else 0.0,
        "lag_max": float(max(lags, default=0)),
        "evicted": float(evicted),
        "evicted_tokens": evicted_share,
        "tokens_per_s": simulated / wall,
        "tokens_per_group": simulated / max(1, len(consumed)),
        "trainer_idle": 1.0 - trainer.busy_s() / wall,
        "token_lag": token_lag,
        # partial rollouts: flushes recorded per consumed group, and how long a flushed
        # group paused (the generator idle) until its flush was in the log
        "flushes": recorder.calls / max(1, len(consumed)),
        "pause_ms": 1e3 * recorder.paused_s / max(1, recorder.calls),
        # Ray: CPU of the actors' processes (in-process, it is all in "proc_cpu_ms")
        "trainer_cpu_ms": per_group * actors.get("trainer", 0.0),
        "gen_cpu_ms": per_group * actors.get("generators", 0.0),
    }


async def worker_processes(workers: Any) -> dict[str, list[Any]]:
    """The Ray actors' processes, by role (CPU times are read before and after a run)."""
    import psutil

    from workers.calls import WorkerCalls

    trainer = await workers.trainer.handle.call(WorkerCalls.pid)
    gens = [await g.handle.call(WorkerCalls.pid) for g in workers.generators]
    return {"trainer": [psutil.Process(trainer)], "generators": [psutil.Process(p) for p in gens]}


def process_cpu_s(procs: list[Any]) -> float:
    """User + system CPU seconds of ``procs`` so far."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def _simulated_tokens(args: argparse.Namespace, cfg: Config, groups: list) -> float:
    """The simulated completion tokens of these groups (a prompt's length draw)."""
    from bench.latency_task import LatencyTask
    from workers.tasks import prompt_set

    task = LatencyTask(**task_options(args))
    prompts = prompt_set(task, cfg.task.num_prompts, cfg.run.seed)
    return float(sum(task.prompt_tokens(prompts[g.prompt_index]) * g.n_samples for g in groups))


def eviction_figures(args: argparse.Namespace, cfg: Config, groups: list) -> tuple[int, float]:
    """(groups evicted, their share of the simulated tokens of every committed group).

    An evicted group was generated in full, then too stale to train on: under a tail,
    the long ones. Generated means committed: consumed, evicted, or still in the buffer
    when the run stopped (the share of the consumed and evicted alone overstated it)."""
    committed = [g for g in groups if g.committed_position is not None]
    evicted = [g for g in committed if g.status.name == "EVICTED"]
    generated = _simulated_tokens(args, cfg, committed)
    return len(evicted), _simulated_tokens(args, cfg, evicted) / max(1.0, generated)


def _token_figures(args: argparse.Namespace, cfg: Config, consumed: list) -> tuple[float, float]:
    """(simulated completion tokens of the consumed groups, token-weighted mean lag of
    their real tokens -- each at its own version)."""
    simulated = _simulated_tokens(args, cfg, consumed)
    lag_sum = tokens = 0
    for g in consumed:
        n = sum(g.lengths)
        lag_sum += (g.lag + g.weight_version_start) * n - g.version_token_sum
        tokens += n
    return float(simulated), lag_sum / max(1, tokens)


def open_store(kind: str, tmp: Path):
    if kind == "memory":
        return MemoryEventStore(), lambda: None
    from events.embedded import ensure_embedded_redis, stop_embedded_redis
    from events.redis_store import RedisEventStore

    server = ensure_embedded_redis(tmp / "redis-data", appendfsync="everysec")
    store = RedisEventStore(server.url)

    def close() -> None:
        store.close()
        stop_embedded_redis(tmp / "redis-data")

    return store, close


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per measured run")
    ap.add_argument("--rounds", type=int, default=2, help="sync+async pairs, order alternating")
    ap.add_argument("--window", type=int, default=1, help="window_versions of the async mode")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--groups-per-call", type=int, default=1, help="groups one generator call carries")
    ap.add_argument("--groups-per-microbatch", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8, help="completions per group")
    ap.add_argument("--max-new-tokens", type=int, default=4,
                    help="tokens the tiny model really decodes (the reverse task needs 4)")
    ap.add_argument("--median-tokens", type=float, default=16.0, help="simulated completion length, median")
    ap.add_argument("--sigma-tokens", type=float, default=1.5,
                    help="lognormal sigma of the length (tail); 0: every length the median")
    ap.add_argument("--length-dist", choices=["lognormal", "pareto"], default="lognormal",
                    help="law of the simulated lengths (bench/latency_task.py)")
    ap.add_argument("--alpha", type=float, default=1.2, help="the Pareto law's shape")
    ap.add_argument("--max-tokens", type=int, default=2048, help="longest simulated completion")
    ap.add_argument("--decode-us-per-token", type=float, default=60.0, help="simulated decode time")
    ap.add_argument("--judge-median-ms", type=float, default=1.0, help="reward call latency, median")
    ap.add_argument("--judge-sigma", type=float, default=0.5)
    ap.add_argument("--store", choices=["memory", "redis"], default="memory",
                    help="where the log lives (redis: an embedded redis-server, appendfsync everysec)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", choices=["local", "ray"], default="local",
                    help="local: worker threads in this process, memory data plane; ray: Ray "
                         "actors in their own processes, TransferQueue data plane")
    ap.add_argument("--ray-cpus", type=int, default=8, help="logical CPUs of the local Ray (ray mode)")
    ap.add_argument("--no-behind", dest="behind", action="store_false",
                    help="skip the third mode: async with controller.publish = behind")
    ap.add_argument("--no-inflight", dest="inflight", action="store_false",
                    help="skip the fourth mode: async with partial rollouts (in-flight refits)")
    ap.add_argument("--segment-tokens", type=int, default=64,
                    help="rollout.partial.segment_tokens of the in-flight mode (the tiny model "
                         "decodes --max-new-tokens real tokens: at 64 a group flushes at refits only)")
    ap.add_argument("--selection", default="ready_first",
                    help="staleness.selection of every mode (ready_first: a straggler past the "
                         "window is evicted, not waited for)")
    ap.add_argument("--no-decode-in-steps", dest="decode_in_steps", action="store_false",
                    help="spend the simulated decode time in the reward call, as before")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp_name:
        tmp = Path(tmp_name)
        store, close = open_store(args.store, tmp)
        try:
            # Warm-up (torch kernels, imports) outside the measurement.
            warm = argparse.Namespace(**{**vars(args), "steps": 2})
            run_once(warm, store, "warmup", args.window, tmp)
            modes = ["sync", "async"] + ["async-behind"] * args.behind + ["inflight"] * args.inflight
            results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
            for i in range(args.rounds):
                order = modes if i % 2 == 0 else modes[::-1]
                for mode in order:
                    window = 0 if mode == "sync" else args.window
                    publish = "behind" if mode == "async-behind" else "in_line"
                    r = run_once(args, store, f"{mode}-{i}", window, tmp, publish, mode == "inflight")
                    results[mode].append(r)
                    print(f"round {i} {mode:<12} window {window}: {r['groups_per_s']:.2f} groups/s, "
                          f"controller CPU {r['ctrl_cpu_ms']:.3f} ms/group", flush=True)
        finally:
            close()
    report(args, results)


if __name__ == "__main__":
    main()
