"""Checks a run's input before anything is written or started.

``rl-controller run`` calls these before the first append to the log and before Ray
or any worker starts, so a mistake costs one line and a non-zero exit, never a
half-created run or a traceback from inside a Ray actor half a minute later:

* the run id (the store's rules, and it names a directory under ``runs/``);
* the task (a built-in name, a family member such as ``reasoning-gym/<dataset>``, or a
  ``module:Class`` plugin, built with ``task.options``; episode tasks need the torch
  generator);
* the model (``model.kind = "hf"``: what the workers will load from the directory --
  config, weights, a tokenizer that encodes the run's first prompt; see
  ``workers.models.hf_check``);
* the prompts (every line of ``task.dataset``, or the generated set), each encoded
  with the model's tokenizer and checked to fit its context with
  ``sampling.max_new_tokens``; for an episode task, also its environment's first
  observation (what the model reads first; a TextArena game's prompt is a label),
  and a reasoning-gym task's answers (what the model must write to score).

Every failure is a :class:`cli.common.CliError` naming the key or file.
Only pure-python pieces of ``workers`` are imported here (no Ray; torch only through
``transformers`` when the model is an HF directory).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from cli.common import CliError
from controller.config import Config
from events.store import ServerEventStore, check_run_id


def check_new_run_id(run_id: str) -> None:
    """The store's rules, plus: usable as one directory name under ``runs/``."""
    try:
        check_run_id(run_id)
    except ValueError as err:
        raise CliError(f"--run-id: {err}") from None
    if "/" in run_id or "\\" in run_id or run_id in (".", "..") or run_id.startswith("-"):
        raise CliError(
            f"--run-id {run_id!r}: it names a directory under runs/, so no '/', '\\', "
            "leading '-', '.' or '..'"
        )


def check_config(cfg: Config) -> None:
    """Task, model and prompts of a validated config (see the module docstring)."""
    task = _check_task(cfg)
    probe = _check_prompts(cfg, task)[0].prompt
    encode, context_len = _check_model(cfg, probe)
    examples = _check_prompts(cfg, task, encode=encode, context_len=context_len)
    _check_first_observation(cfg, task, examples[0], encode, context_len)
    _check_answers(cfg, task, examples, encode)


def _check_answers(cfg: Config, task, examples, encode) -> None:
    """A reasoning-gym answer the tokenizer cannot write (its tags included) is one the
    model can never give: every reward would be partial at best, and nothing says why."""
    from workers.envs.reasoning_gym import ReasoningGymTask

    if not isinstance(task, ReasoningGymTask):
        return
    for example in examples:
        answer = (f"<answer>{example.answer}</answer>" if task.answer_format == "tag"
                  else example.answer)
        try:
            encode(answer)
        except ValueError as err:
            raise CliError(
                f"config: task {cfg.task.name!r} (answer_format {task.answer_format!r}): the "
                f"model cannot write its answers (model.alphabet?): {err}") from None


def _check_first_observation(cfg: Config, task, example, encode, context_len: int) -> None:
    """An episode task's prompt can be a mere label (a TextArena game's is its seed):
    what the model reads first is the environment's first observation, so that is what
    must encode and fit, or every group fails at its first step once the run is up."""
    from workers.envs.base import StepKey
    from workers.envs.task import EpisodeTask

    if not isinstance(task, EpisodeTask):
        return
    try:
        first = task.make_env(example).reset(StepKey("preflight", "preflight", 0, 0))
    except Exception as err:  # the run would fail the same way at every group
        raise CliError(f"config: task {cfg.task.name!r}: its environment cannot start: "
                       f"{type(err).__name__}: {err}") from None
    if first.text is None:
        return  # ids: the environment speaks the model's tokenizer
    try:
        ids = encode(first.text)
    except ValueError as err:
        raise CliError(f"config: task {cfg.task.name!r}: its first observation cannot be "
                       f"encoded (model.alphabet?): {err}") from None
    if len(ids) + 1 > context_len:
        raise CliError(f"config: task {cfg.task.name!r}: its first observation is {len(ids)} "
                       f"tokens; the model's context of {context_len} leaves no room for a turn")


def _check_task(cfg: Config):
    from workers.tasks import UnknownTaskError, make_task

    try:
        task = make_task(cfg.task.name, **cfg.task.options)
    except UnknownTaskError as err:
        raise CliError(f"config: task.name: {err}") from None
    except Exception as err:  # a plugin whose constructor fails
        raise CliError(
            f"config: task.name = {cfg.task.name!r} cannot be built: {type(err).__name__}: {err}"
        ) from None
    from workers.envs.task import EpisodeTask

    if isinstance(task, EpisodeTask) and cfg.rollout.backend == "vllm":
        raise CliError(
            f"config: task.name = {cfg.task.name!r} runs multi-turn episodes, which the vLLM "
            "generator does not run yet; use rollout.backend = \"torch\""
        )
    from workers.envs.agent import AgentTask

    if isinstance(task, AgentTask) and cfg.rollout.backend == "vllm":
        raise CliError(
            f"config: task.name = {cfg.task.name!r} is an agent task, whose endpoint the "
            "vLLM generator does not serve yet; use rollout.backend = \"torch\"")
    declared = getattr(task, "dedupes_by_key", False) if isinstance(task, AgentTask) else False
    if not isinstance(declared, bool):  # read as a bool: a typo must not mean False silently
        raise CliError(
            f"config: task.name = {cfg.task.name!r} declares dedupes_by_key = {declared!r}; "
            "an agent task declares True or False (docs/agents.md)")
    return task


def _check_model(cfg: Config, probe_prompt: str) -> tuple[Callable[[str], list[int]], int]:
    """The tokenizer's ``encode`` and the context length the workers will have."""
    if cfg.model.kind == "tiny":  # the tokenizer is known without loading a model
        from workers.models.tokenizer import CharTokenizer

        tokenizer = CharTokenizer(cfg.model.alphabet) if cfg.model.alphabet else CharTokenizer()
        return tokenizer.encode, cfg.model.context_len
    path = Path(cfg.model.path).expanduser()
    where = f"config: model.path = {cfg.model.path!r}"
    if not path.is_dir():
        raise CliError(
            f"{where} is not a directory (model.kind = \"hf\" loads a local save_pretrained "
            "directory; nothing is downloaded)"
        )
    from workers.models.hf_check import HFDirError, check_hf_dir

    try:
        found = check_hf_dir(path, probe_prompt)
    except HFDirError as err:
        raise CliError(f"{where}: {err}") from None
    return found.tokenizer.encode, found.context_len


def _check_prompts(cfg: Config, task, *, encode=None, context_len=None) -> list:
    """The run's prompts (every line of ``task.dataset``, or the generated set), and with
    ``encode`` each checked to fit the model's context."""
    from workers.tasks import DatasetError, PromptTooLongError, prompt_set

    dataset = cfg.task.dataset or None
    if dataset is not None and not Path(dataset).is_file():
        raise CliError(f"config: task.dataset = {dataset!r} is not a file")
    try:
        return prompt_set(
            task, cfg.task.num_prompts, cfg.run.seed, dataset,
            encode=encode, context_len=context_len,
            max_new_tokens=cfg.sampling.max_new_tokens,
        )
    except (DatasetError, PromptTooLongError) as err:
        if dataset:
            raise CliError(f"config: task.dataset: {err}") from None
        context = ("model.context_len" if cfg.model.kind == "tiny"
                   else "the context in model.path's config.json")
        raise CliError(
            f"config: task {cfg.task.name!r} with {context} = {context_len} and "
            f"sampling.max_new_tokens = {cfg.sampling.max_new_tokens}: {err}"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"config: task.dataset = {dataset!r} cannot be read: {err}") from None
    except Exception as err:  # a plugin task whose examples() fails
        raise CliError(
            f"config: task.name = {cfg.task.name!r}: its examples cannot be made: "
            f"{type(err).__name__}: {err}"
        ) from None


def check_durability(store: ServerEventStore, cfg: Config, url: str) -> None:
    """Warn once (or refuse, with ``store.require_fsync_always``) when an external
    Redis would not keep every acknowledged event through a crash of the server."""
    from events.redis_store import redact_url

    store.require_writable()  # a read-only user fails here, not after Ray has started
    got = store.durability()
    where = f"Redis at {redact_url(url)}"
    if got is None:
        msg = (f"{where} does not allow CONFIG GET, so its durability is unknown; it "
               "must run with appendonly yes and appendfsync always to lose nothing in a crash")
    else:
        appendonly, fsync = got
        if appendonly == "yes" and fsync == "always":
            return
        if appendonly != "yes":
            lost = "every event since its last RDB snapshot"
        elif fsync == "everysec":
            lost = "about the last second of acknowledged events"
        else:
            lost = "acknowledged events the OS had not yet flushed (up to ~30 s)"
        msg = (f"{where} runs with appendonly {appendonly}, appendfsync {fsync}: a crash "
               f"of that server or its machine can lose {lost} (a crash of this "
               "controller loses nothing)")
    if cfg.store.require_fsync_always:
        raise CliError(f"{msg}; store.require_fsync_always = true refuses it")
    print(f"rl-controller: warning: {msg}; set store.require_fsync_always = true to refuse "
          "such a server", file=sys.stderr)
