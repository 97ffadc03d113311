"""``rl-controller run``: train, on the embedded default or on a cluster.

    rl-controller run                                  # embedded default, new run
    rl-controller run --steps 100 --set train.lr=1e-3  # overrides, validated by key
    rl-controller run --resume --run-id run-...        # continue after a crash or stop

Order of work: validate everything that can be validated without side effects
(config, capacity, run id vs. the store) before anything is written to the log or any
worker is started; then open the run (new epoch), start workers, reconcile them with
the log, and hand over to the controller loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import structlog

from cli import followup, preflight, ray_cluster, run_open, run_summary
from cli.common import (
    CliError,
    add_store_args,
    check_redis_url,
    open_store,
    require_run,
    writable_dir,
)
from controller.config import Config, config_from_dict, config_to_dict, load_config
from controller.loop import Controller, RunStoppedError, StallError, StepRetriesExhausted
from controller.observe import MetricsSink, Progress, configure_logging
from controller.recovery import PayloadsLostError, RecoveryError, reconcile_workers
from controller.projector import Projector
from controller.startup import RunExistsError, create_run, resume_run
from events import schema as ev
from events.errors import FencedError, StoreUnavailableError
from replay.settings import with_changes
from workers.loss.metrics import mismatch_warning
from workers.tasks.config import task_defaults_in_effect

log = structlog.get_logger("rl_controller.run")

EXAMPLES = """examples:
  rl-controller run                                   embedded default, new run
  rl-controller run --steps 20 --set staleness.window_versions=0
  rl-controller run --config run.toml --run-id exp1
  rl-controller run --resume --run-id exp1 --steps 200
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train (embedded default with no flags)",
        description="Train with the event-sourced controller. With no flags: its own "
        "redis-server, a local Ray, TransferQueue, the tiny model and the default task.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-3 (repeatable)")
    p.add_argument("--steps", type=int, help="train until this trainer_version (run.steps)")
    p.add_argument("--run-id", help="run id (default: run-<UTC time>)")
    p.add_argument("--resume", action="store_true", help="continue an existing run")
    p.add_argument("--rewind-to-checkpoint", action="store_true",
                   help="with --resume: if payloads needed to rebuild the weights are lost, "
                        "continue from the newest usable checkpoint and record a RunRewound "
                        "(the discarded steps are named in the log and by 'audit')")
    p.add_argument("--takeover", action="store_true",
                   help="with --resume: continue a run whose controller is still running on "
                        "this host (that controller is fenced and stops with exit status 3)")
    p.add_argument("--ray-address", help="join an existing Ray cluster")
    p.add_argument("--local-workers", action="store_true",
                   help="run workers in this process (debugging/tests; no Ray actors)")
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a live table")
    add_store_args(p)
    p.set_defaults(func=cmd_run)


def _resolve_config(args: argparse.Namespace) -> Config:
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if args.ray_address:
        overrides.append(f'ray.address="{args.ray_address}"')
    return load_config(args.config, overrides)


_RESUME_KEEPS_CONFIG = (
    "a resumed run keeps the config recorded in its log; only --steps and "
    "--ray-address may change (drop --config/--set)"
)


def _resume_config(logged: dict, args: argparse.Namespace) -> Config:
    if args.config or args.set:
        raise CliError(_RESUME_KEEPS_CONFIG)
    cfg = config_from_dict(logged)
    extra = []
    if args.steps is not None:
        extra.append(f"run.steps={args.steps}")
    if args.ray_address:
        extra.append(f'ray.address="{args.ray_address}"')
    return with_changes(cfg, extra) if extra else cfg


def _check_resume_steps(run_id: str, state, steps: int, *, given: bool) -> None:
    """A target below where the run is cannot be trained to. An unfinished run was
    marked finished by it (the loop saw its target reached) without a word: a typo in
    --steps ended a run meant to go on. Without --steps the target is the logged
    run.steps, which a run taken further by an earlier resume's --steps has passed (that
    --steps is not in the log): a finished one has nothing to do, an unfinished one
    needs --steps, and neither is blamed on a --steps never given."""
    version = state.trainer_version
    if steps >= version or (state.finished and not given):
        return
    if not given:
        raise CliError(f"run {run_id} is at trainer_version {version}, past its logged "
                       f"run.steps {steps} (an earlier resume's --steps is not in the log); "
                       f"pass --steps N >= {version}")
    if state.finished:
        where, fix = "finished at", f"N > {version} to train further"
    else:
        target = config_from_dict(state.config).run.steps
        where, fix = "at", f"N >= {version}" + (
            f", or leave --steps out to go on to its {target}" if target >= version else "")
    raise CliError(f"--steps {steps} is below where run {run_id} is: {where} "
                   f"trainer_version {version}; pass --steps {fix}")


def checkpoint_dir(run_dir: Path) -> str:
    """Where a run's checkpoints go (under its run directory), as an absolute path: the
    path is recorded in ``CheckpointSaved``, and one relative to this command's working
    directory (a relative ``--data-dir``) names nothing to a resume started elsewhere,
    which rejected the checkpoint for good and could not rebuild the weights."""
    return str((run_dir / "checkpoints").absolute())


def _code_version() -> str:
    try:
        return f"rl-controller {metadata.version('rl-controller')}"
    except metadata.PackageNotFoundError:
        return "rl-controller (source)"


def cmd_run(args: argparse.Namespace) -> int:
    run_open.mark("cli_ready")
    # Everything that can be checked without the store is checked before it is opened
    # (an embedded server is not even started for a bad command line).
    if args.resume and not args.run_id:
        raise CliError("--resume needs --run-id (see 'rl-controller runs')")
    if args.rewind_to_checkpoint and not args.resume:
        raise CliError("--rewind-to-checkpoint only applies to --resume")
    if args.takeover and not args.resume:
        raise CliError("--takeover only applies to --resume")
    if args.resume and (args.config or args.set):
        raise CliError(_RESUME_KEEPS_CONFIG)
    check_redis_url(args)
    # None, not "": an empty --run-id (an unset shell variable) is refused, not defaulted
    run_id = (args.run_id if args.run_id is not None
              else datetime.now(timezone.utc).strftime("run-%Y%m%d-%H%M%S"))
    preflight.check_new_run_id(run_id)
    writable_dir("--data-dir", args.data_dir)  # runs/RUN_ID goes there, --redis-url or not
    cfg = None if args.resume else _resolve_config(args)
    if cfg is not None:
        # (the buffer's capacity rule was checked by the config's own load)
        preflight.check_config(cfg)
        # Before anything is written: an unreachable or too small cluster must leave no
        # run behind. --local-workers joins ray.address too (the data plane's actors).
        if not args.local_workers:
            ray_cluster.check_local_capacity(cfg)
        ray_cluster.check_address(cfg.ray.address)
    chain_key = run_open.chain_key(args, cfg, run_id)
    with open_store(args, start=True, replication=cfg.store if cfg else None,
                    chain_key=chain_key) as store, contextlib.ExitStack() as serving:
        if args.resume:
            # Read-only first: the recorded config is checked before a new epoch is
            # claimed, and a finished run answers without starting anything.
            require_run(store, run_id)
            state = Projector(store, fork_readers=False).get(run_id).require()
            cfg = _resume_config(state.config, args)
            preflight.check_config(cfg)
            _check_resume_steps(run_id, state, cfg.run.steps, given=args.steps is not None)
            if state.finished and state.trainer_version >= cfg.run.steps:
                return run_summary.nothing_to_do(run_id, state.trainer_version)
            run_open.check_not_held(args, store, run_id)
            run_open.check_run_dir(args, run_id)
            if not args.local_workers:
                ray_cluster.check_local_capacity(cfg)
            ray_cluster.check_address(cfg.ray.address)
            # the run's own [store], from its log, before its first write (the epoch
            # claim): the store was opened before the log could be read
            store.replication = cfg.store
            store.require_replicas(cfg.store.replicas)
            if args.redis_url:
                preflight.check_durability(store, cfg, args.redis_url)
            exporter = serving.enter_context(run_open.metrics_served(cfg))
            run_open.start_ray(args, cfg, run_id)
            run_open.mark("ray_ready")
            writer = resume_run(store, run_id)
        else:
            if store.run_exists(run_id) and store.last_position(run_id) > 0:
                raise CliError(f"run {run_id!r} already exists; pass --resume to continue it, "
                               "or choose another --run-id")
            # before anything is written: appends would wait for replicas that are not there
            store.require_replicas(cfg.store.replicas)
            if args.redis_url:
                preflight.check_durability(store, cfg, args.redis_url)
            exporter = serving.enter_context(run_open.metrics_served(cfg))
            with run_open.removed_unless_created(Path(args.data_dir) / "runs" / run_id):
                run_open.start_ray(args, cfg, run_id)
                run_open.mark("ray_ready")
                try:
                    writer = create_run(
                        store, run_id,
                        config=config_to_dict(cfg), seed=cfg.run.seed,
                        code_version=_code_version(),
                        window_versions=cfg.staleness.window_versions,
                        groups_per_step=cfg.train.groups_per_step,
                        samples_per_group=cfg.rollout.samples_per_group,
                    )
                except RunExistsError as err:
                    raise CliError(str(err)) from None
        try:
            return _train(args, cfg, writer, exporter)
        except KeyboardInterrupt:  # the run is open from here on: say how to go on with it
            raise _interrupted(args, writer.run_id) from None
        finally:
            ray_cluster.disconnect()


def _train(args, cfg: Config, writer, exporter) -> int:
    from controller.wiring import start_workers, worker_spec

    run_dir = Path(args.data_dir) / "runs" / writer.run_id
    writer.snapshot_every = cfg.controller.snapshot_every_events
    writer.snapshot_events_per_mib = cfg.controller.snapshot_events_per_mib
    configure_logging(run_dir / "controller.log.jsonl")
    structlog.contextvars.bind_contextvars(run_id=writer.run_id, epoch=writer.epoch)
    progress = Progress(cfg.run.steps, enabled=not args.no_progress)
    sink = MetricsSink(run_dir)
    if exporter is not None:  # serving since before the run was opened
        exporter.on_append([], writer.state)  # a resumed run's figures before its first append
        writer.listeners.append(exporter.on_append)
        progress.console.print(f"metrics at {exporter.url}", markup=False, highlight=False)
    progress.console.print(
        f"run [bold]{writer.run_id}[/] epoch {writer.epoch}: trainer_version "
        f"{writer.state.trainer_version} -> {cfg.run.steps}, log at position {writer.position}"
    )
    taken = task_defaults_in_effect(cfg.task.name, config_to_dict(cfg))
    if taken:  # said, so that a run's settings never surprise (a key you set wins)
        progress.console.print(f"task {cfg.task.name}: its run defaults {', '.join(taken)}",
                               markup=False, highlight=False)
    from controller.wiring import WorkerStartError

    try:
        workers = start_workers(cfg, worker_spec(cfg, writer.run_id, run_dir), local=args.local_workers)
        run_open.mark("workers_ready")
    except WorkerStartError as err:
        raise CliError(str(err)) from None
    try:
        with progress:
            progress.status("reconciling workers with the log")
            asyncio.run(reconcile_workers(
                writer, workers, cfg.checkpoint, checkpoint_dir=checkpoint_dir(run_dir),
                rewind=args.rewind_to_checkpoint,
            ))

            run_open.mark("reconciled")

            def on_step(step: int, version: int, metrics: dict[str, float]) -> None:
                if "first_step" not in run_open.PHASES:
                    run_open.mark("first_step")
                    log.info("startup", **{f"{k}_s": round(v, 2) for k, v in run_open.PHASES.items()})
                sink.write(step, version, metrics)
                progress.step(step, version, metrics, len(writer.state.buffer), len(writer.state.admitted))
                structlog.contextvars.bind_contextvars(step=step, trainer_version=version)
                log.info("step_finished", **metrics)
                alert = mismatch_warning(metrics, cfg.train.loss.mismatch_kl_warn)
                if alert:
                    log.warning("train_inference_mismatch", detail=alert)
                    progress.warn(alert)

            progress.status("training")
            started = time.monotonic()
            controller = Controller(
                writer, cfg, workers.trainer, workers.generators, workers.publisher,
                workers.payloads, checkpoint_dir=checkpoint_dir(run_dir), on_step=on_step,
                restarter=workers, on_failure=progress.failure,
                on_trainer_replaced=progress.notice,
            )
            reason = asyncio.run(controller.run())
            train_s = time.monotonic() - started
            writer.append(writer.make(ev.RunFinished, event_id=ev.run_finished_id(writer.epoch, writer.position), reason=reason))
    except FencedError as err:
        raise CliError(f"stopped: {err}", 3) from None
    except RunStoppedError as err:
        raise CliError(f"stopped: {err}; the log is consistent: fix the cause, then continue "
                       f"with: {_resume_command(args, writer.run_id)}", 4) from None
    except (StallError, StepRetriesExhausted) as err:
        raise CliError(f"stopped: {err}", 4) from None
    except StoreUnavailableError as err:  # past the append budget: an outage, not bad input
        raise CliError(f"stopped: {err}; the log holds every event the store acknowledged: "
                       f"once the store is back, continue with: "
                       f"{_resume_command(args, writer.run_id)}", 4) from None
    except PayloadsLostError as err:  # the command to rewind, with this run's flags
        raise CliError(f"recovery stopped: {err}: {_resume_command(args, writer.run_id)} "
                       "--rewind-to-checkpoint", 5) from None
    except RecoveryError as err:
        raise CliError(f"recovery stopped: {err}", 5) from None
    except KeyboardInterrupt:
        raise _interrupted(args, writer.run_id) from None
    finally:
        sink.close()
        workers.close()
        if writer.fenced is None:  # a fenced controller leaves the store alone
            # a store that is gone must not replace the error that says so (the next
            # controller folds the tail a snapshot would have saved)
            with contextlib.suppress(StoreUnavailableError):
                writer.snapshot()
    run_summary.print_summary(args, progress.console, writer.run_id, writer.state, run_dir,
                              startup_s=run_open.PHASES.get("reconciled"), train_s=train_s)
    return 0


def _interrupted(args: argparse.Namespace, run_id: str) -> CliError:
    return CliError("interrupted; the log is consistent, continue with: "
                    f"{_resume_command(args, run_id)}", 130)


def _resume_command(args: argparse.Namespace, run_id: str) -> str:
    # A resume's --steps is not in the log: without it the command would go back to the
    # logged run.steps, which such a run has passed, and be refused.
    steps = ["--steps", str(args.steps)] if args.steps is not None else []
    return followup.command(args, "run", "--resume", "--run-id", run_id, *steps,
                            *followup.worker_flags(args))


