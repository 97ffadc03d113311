"""Learning probe: an in-process GRPO loop over episodes (no controller, no log).

    python bench/learn_episodes.py --task calculator --budget-s 600 --out curve.jsonl

Each step samples ``--groups`` groups of ``--n`` episodes with the trainer's current
weights through the episode runner (``workers.envs``), trains one step on them with
the torch trainer and the GRPO loss, and prints the mean return, the exact-answer rate
and how often the first turn was a tool call. It answers "can the tiny model learn
this task from random weights within a time budget" before a full run is spent on it;
the controller's runs reach the same loop through ``Generator.generate_group``.
Single-turn tasks (``reverse``, ``reasoning-gym/...``) run as one-turn episodes.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch

from controller.core.policies import group_advantages
from workers.batch import collate
from workers.envs.base import StepKey
from workers.envs.recorder import InMemoryTurnRecorder
from workers.envs.runner import EpisodeRunner
from workers.envs.sampler import TorchTurnSampler
from workers.envs.task import as_episode_task
from workers.envs.trajectory import describe, per_token_advantages
from workers.loss import LossOptions, StepLoss
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.models.tokenizer import EOS_ID
from workers.tasks import make_task
from workers.tasks.config import with_task_defaults
from workers.trainer.config import BuiltModelFactory, TrainerRuntime, TrainSection
from workers.trainer.torch_backend import TorchTrainer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="calculator")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=JSON",
                   help="task constructor option, e.g. digits=2 (value parsed as JSON)")
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (the loss scales logits by the same)")
    p.add_argument("--entropy-coef", type=float, default=None,
                   help="entropy bonus (default: the task's run default, else 0)")
    p.add_argument("--context-len", type=int, default=None,
                   help="model context (default: the task's run default, else 32)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per model turn (default: the task's run default, else 6)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--alphabet", default=None,
                   help="tokenizer alphabet (default: the task's run default, else the tiny one's)")
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--advantages", choices=("sample", "token"), default="sample",
                   help="GRPO per sample, or reward-to-go per token (needs per-token TrainBatch)")
    p.add_argument("--stop-at", type=float, default=None, metavar="RETURN",
                   help="stop once the mean return of the last 10 steps reaches this")
    p.add_argument("--show", type=int, default=0, help="print an episode every N steps")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per step")
    args = p.parse_args(argv)
    with_run_defaults(args)
    return args


def with_run_defaults(args: argparse.Namespace) -> None:
    """Fill the options left unset from the task's run defaults, as ``rl-controller run``
    does (``workers.tasks.config.with_task_defaults``), else from the run's own."""
    tables = with_task_defaults({"task": {"name": args.task}})
    model, sampling = tables.get("model", {}), tables.get("sampling", {})
    loss = tables.get("train", {}).get("loss", {})
    for attr, value in (("alphabet", model.get("alphabet")),
                        ("context_len", model.get("context_len", ModelSection().context_len)),
                        ("max_new_tokens", sampling.get("max_new_tokens", SamplingSection().max_new_tokens)),
                        ("entropy_coef", loss.get("entropy_coef", LossOptions().entropy_coef))):
        if getattr(args, attr) is None:
            setattr(args, attr, value)


def task_options(pairs: list[str]) -> dict[str, object]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--task-option {pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    extra = {} if args.alphabet is None else {"alphabet": args.alphabet}
    mcfg = ModelSection(context_len=args.context_len, d_model=args.d_model,
                        n_layers=args.layers, **extra)
    _, tokenizer = build_model(mcfg, args.seed)
    trainer = TorchTrainer(
        BuiltModelFactory(mcfg, args.seed),
        TrainSection(lr=args.lr, grad_clip=1.0),
        TrainerRuntime(seed=args.seed, digest_on_finish=False),
    )
    return trainer, tokenizer


def step_stats(trajs, examples, decode) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Tool-call rate, exact-answer rate and turns per episode of one group."""
    n = len(trajs)
    called = sum(1 for t in trajs if t.turns and t.turns[0].info.get("tool"))
    exact = 0
    for t, ex in zip(trajs, examples):
        last = t.turns[-1]
        ids = t.input_ids[last.start:last.end]
        exact += int(ids[-1:] == [EOS_ID] and decode(ids) == ex.answer)
    return {"tool_rate": called / n, "exact": exact / n,
            "turns": sum(len(t.turns) for t in trajs) / n}


def train_batch(groups, per_token: bool):  # type: ignore[no-untyped-def]
    """The step's batch: GRPO advantages per sample, or reward-to-go per token."""
    rows, advs = [], []
    for group in groups:
        rows += [t.row() for t in group]
        if per_token:
            adv, _ = per_token_advantages([t.token_rewards() for t in group],
                                          [t.loss_mask for t in group])
            advs += adv
        else:
            advs += group_advantages([t.reward for t in group])[0]
    if not per_token:
        return collate(rows, advs)
    batch = collate(rows, [0.0] * len(rows))
    padded = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
    for i, a in enumerate(advs):
        padded[i, :len(a)] = torch.tensor(a)
    try:
        return type(batch)(**{**{k: getattr(batch, k) for k in ("input_ids", "attention_mask",
                              "loss_mask", "generator_logprobs")}, "advantages": padded})
    except ValueError as err:
        raise SystemExit(f"--advantages token: this TrainBatch takes one advantage per "
                         f"sample ({err})") from None


def main(argv: list[str]) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    task = as_episode_task(make_task(args.task, **task_options(args.task_option)))
    trainer, tokenizer = build(args)
    prompts = task.examples(args.prompts, args.seed)
    sampling = SamplingSection(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    loss = StepLoss(LossOptions(entropy_coef=args.entropy_coef), sampling)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = args.out.open("a") if args.out else None
    t0, c0 = time.perf_counter(), time.process_time()
    step, recent = 0, collections.deque(maxlen=10)
    while step < args.max_steps and time.perf_counter() - t0 < args.budget_s:
        trainer.model.eval()
        # every group of the step in one runner call: turns batch across groups
        chosen = [prompts[rng.randrange(len(prompts))] for _ in range(args.groups)]
        runner = EpisodeRunner(
            TorchTurnSampler(trainer.model, tokenizer.eos_id, sampling, gen),
            tokenizer, InMemoryTurnRecorder(), args.context_len, args.max_new_tokens,
            task.max_turns, task.name,
        )
        keys = [StepKey("probe", f"{step}-{g}", i, 0) for g in range(args.groups) for i in range(args.n)]
        trajs = runner.run(keys, [task.make_env(ex) for ex in chosen for _ in range(args.n)])
        groups = [trajs[g * args.n:(g + 1) * args.n] for g in range(args.groups)]
        trainer.model.train()
        result = trainer.train(train_batch(groups, args.advantages == "token"), loss, step=step)
        step += 1
        stats = [step_stats(g, [ex] * args.n, tokenizer.decode) for g, ex in zip(groups, chosen)]
        line = {
            "step": step, "time_s": round(time.perf_counter() - t0, 2),
            # this process's CPU seconds: on a shared machine, wall time also counts others
            "cpu_s": round(time.process_time() - c0, 2),
            "reward": sum(t.reward for t in trajs) / len(trajs),
            **{k: sum(s[k] for s in stats) / len(stats) for k in stats[0]},
            "grad_norm": result.grad_norm,
        }
        print(json.dumps(line), flush=True)
        recent.append(line["reward"])
        if args.show and step % args.show == 0:
            for t in trajs[:args.n]:
                print(describe(t, tokenizer.decode), flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
        if args.stop_at is not None and len(recent) == 10 and sum(recent) / 10 >= args.stop_at:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
