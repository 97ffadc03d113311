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
import os
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.api import MicrobatchRef, TrainerClient, WeightPublisher  # noqa: E402
from controller.config import Config, config_to_dict, load_config  # noqa: E402
from controller.loop import Controller  # noqa: E402
from cli.run_cmd import checkpoint_dir  # noqa: E402
from controller.recovery import reconcile_workers  # noqa: E402
from controller.startup import create_run  # noqa: E402
from controller.wiring import start_workers, worker_spec  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from events.store import EventStore  # noqa: E402

TASK = "bench.latency_task:LatencyTask"


class TimedTrainer:
    """A ``TrainerClient`` that records when each call was issued and returned.

    ``probe`` reads the loop's data-wait clock (its timers object and seconds waited
    for selectable groups) at both moments, so the data wait inside each gap between
    two calls can be subtracted exactly.
    """

    def __init__(self, inner: TrainerClient) -> None:
        self.inner = inner
        self.probe: Any = lambda: (None, 0.0)
        #: (issued, returned, probe at issue, probe at return)
        self.calls: list[tuple[float, float, Any, Any]] = []

    async def _timed(self, coro: Any) -> Any:
        issued, at_issue = time.perf_counter(), self.probe()
        try:
            return await coro
        finally:
            self.calls.append((issued, time.perf_counter(), at_issue, self.probe()))

    async def begin_train_step(self, step: int) -> None:
        return await self._timed(self.inner.begin_train_step(step))

    async def train_microbatch(self, ref: MicrobatchRef):
        return await self._timed(self.inner.train_microbatch(ref))

    async def finish_train_step(self):
        return await self._timed(self.inner.finish_train_step())

    async def abort_train_step(self) -> None:
        return await self._timed(self.inner.abort_train_step())

    async def version_and_digest(self):
        return await self.inner.version_and_digest()

    async def save_checkpoint(self, directory: str):
        return await self._timed(self.inner.save_checkpoint(directory))

    async def begin_checkpoint(self, directory: str) -> None:
        return await self._timed(self.inner.begin_checkpoint(directory))

    async def checkpoint_outcome(self, directory: str):
        return await self.inner.checkpoint_outcome(directory)

    async def load_checkpoint(self, directory: str, *expected: Any):
        return await self.inner.load_checkpoint(directory, *expected)

    async def reset(self) -> None:
        return await self.inner.reset()

    def busy_s(self) -> float:
        return sum(c[1] - c[0] for c in self.calls)

    def gaps_s(self, publishing: list[tuple[float, float]]) -> tuple[float, float, float]:
        """Between one call returning and the next being issued: (the gaps, the data wait
        in them, the controller's own time in them). A gap's own time is what neither the
        wait for data nor a publish (``publishing``: intervals) covers; the two may run
        at once (a publish behind the next step), so the larger of them is taken off
        (an upper bound of the controller's time)."""
        gaps = waits = own = 0.0
        for cur, nxt in zip(self.calls, self.calls[1:]):
            gap = max(0.0, nxt[0] - cur[1])
            (timers_then, waited_then), (timers_now, waited_now) = cur[3], nxt[2]
            # the loop starts fresh timers at every StepFinished: count from zero then
            wait = waited_now - (waited_then if timers_now is timers_then else 0.0)
            published = sum(
                max(0.0, min(end, nxt[0]) - max(start, cur[1])) for start, end in publishing
            )
            gaps, waits, own = gaps + gap, waits + wait, own + max(0.0, gap - max(wait, published))
        return gaps, waits, own


class TimedPublisher:
    """A ``WeightPublisher`` that adds up the time spent publishing."""

    def __init__(self, inner: WeightPublisher) -> None:
        self.inner = inner
        self.intervals: list[tuple[float, float]] = []

    @property
    def total_s(self) -> float:
        return sum(end - start for start, end in self.intervals)

    async def publish(self, version: int, *only: Any) -> list[str]:
        started = time.perf_counter()
        try:
            return await self.inner.publish(version, *only)
        finally:
            self.intervals.append((started, time.perf_counter()))


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
    # generated in full, then too stale to train on: under a tail, the long ones
    evicted = [g for g in state.groups.values() if g.status.name == "EVICTED"]
    wasted = _simulated_tokens(args, cfg, evicted)
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
        "evicted": float(len(evicted)),
        "evicted_tokens": wasted / max(1.0, simulated + wasted),
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


if __name__ == "__main__":
    main()
