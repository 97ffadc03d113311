"""Agent tasks: episodes driven by the user's own OpenAI-client code.

An :class:`AgentTask` is a ``Task`` (its prompts are drawn as any task's) with one more
method, ``run_agent(client, model, example) -> reward``. For each sample of a group the
generator opens a session on an ``OpenAIServer`` over its own model (loopback, started
once per generator), hands the agent an ``openai.OpenAI`` client bound to that session,
and trains on the session's trajectory: the ids as sampled, the loss mask on the
model's tokens only, the behaviour logprobs and per-token weight versions -- the same
row the episode runner builds. The returned reward lands on the last model turn.

The shape follows the peers' rollout functions (verifiers' ``rollout(client, model,
prompt, answer)``, verl's agent loop): the agent owns the conversation and the tool
calls; the server owns the tokens. Samples run one after another on one seeded sampler,
so a group is a function of its seed and the agent's calls.

Every completion goes through the turn recorder, and so does what the agent does with
it: a model turn's **call** is the completion as the agent received it (its tool calls
or text), keyed (run, group, sample, turn) like an env call; its **result** is what the
agent sends back with its next request (the new messages, the turn's observation), or,
after the last turn, the reward ``run_agent`` returns. The intent is recorded before
the completion is returned; the result when the next request, or the reward, comes
(``workers.envs.chat.serve_turn``). Each completion carries its key (``step_key``,
``run/group/s<sample>/t<turn>``) for the agent's tools to deduplicate their effects by.

In memory (``rollout.partial`` off) the record lives as long as the group's attempt on
this generator. With partial rollouts the recorder is the durable one
(``workers.envs.durable``, through ``workers.generator.episodes``) and an episode
survives a crash of any process: a resumed attempt runs ``run_agent`` again from the
start; recorded completions are served from the log, recorded results are checked
against what the agent sends now (otherwise HTTP 400 naming the turn, which fails the
episode), and the first unrecorded request is sampled. ``dedupes_by_key`` means what an
environment's does: ``True``, the agent's tools run a key's side effects at most once,
so a turn whose result was lost is answered again under its key (and a turn's result
rides with the next turn's intent, one pause per turn); ``False`` (the default), the
controller restarts, with new keys, every interrupted episode of the agent that has a
recorded call (its replay would run those calls' tools again; ``EnvStepsRequested.agent``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from workers.envs.base import StepKey
from workers.envs.recorder import InMemoryTurnRecorder, ReplayMismatchError, StepOutcome, TurnRecorder
from workers.envs.sampler import HoldingWeights, generator_sampler
from workers.envs.tools import ToolCallFormat
from workers.envs.trajectory import Trajectory
from workers.errors import GroupError
from workers.models.config import SamplingSection
from workers.tasks.base import Example, Task

#: the ``model`` name the endpoint answers to (any name is served; this one is documented)
MODEL_NAME = "policy"


class AgentError(GroupError, RuntimeError):
    """The agent code failed an episode (the message names the task, group and sample)."""


@runtime_checkable
class AgentTask(Task, Protocol):
    """A task whose every sample is an episode of the user's OpenAI-client agent."""

    #: tools the model may call (their calls come back as ``tool_calls``); None: text only
    tool_format: ToolCallFormat | None
    # ``dedupes_by_key: bool`` may be declared too (False when absent; not a member
    # here, so agent tasks written without it stay agent tasks): :class:`DedupingAgent`

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        """Play one episode of ``example`` through ``client`` (an ``openai.OpenAI`` bound
        to one session); return its reward (a finite number, [0, 1] by convention)."""
        ...


_servers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def agent_server(gen: Any, sampling: SamplingSection, tools: ToolCallFormat | None) -> Any:
    """The generator's endpoint, started on first use and kept for the generator's life."""
    from workers.generator.openai_server import OpenAIServer

    server = _servers.get(gen)
    if server is None:
        server = _servers[gen] = OpenAIServer.for_generator(
            gen, sampling, tools, open_on_request=False).start()
        weakref.finalize(gen, server.close)
    return server


@runtime_checkable
class DedupingAgent(Protocol):
    """An agent task that declares whether its tools deduplicate by ``step_key``."""

    dedupes_by_key: bool


def dedupes_by_key(task: AgentTask) -> bool:
    """Whether the task's tools declared they deduplicate by ``step_key``."""
    return isinstance(task, DedupingAgent) and task.dedupes_by_key is True


def run_agent_group(
    gen: Any,
    task: AgentTask,
    group_id: str,
    prompt: Example,
    n: int,
    sampling: SamplingSection,
    seed: int,
    attempt: int = 0,
    recorder: TurnRecorder | None = None,
    restarts: Sequence[int] | None = None,
) -> list[Trajectory]:
    """The group's ``n`` episodes, one session each, in sample order (``restarts``: per
    sample, times its episode was started over, part of its keys)."""
    import openai  # the envs extra; imported by the runs that use an agent task

    server = agent_server(gen, sampling, task.tool_format)
    # a fresh sampler per group: the group is a function of its seed, whichever
    # groups this generator served before (and whichever others wait at a pause)
    sampler = HoldingWeights(generator_sampler(gen, sampling, seed), gen.weights)
    recorder = recorder if recorder is not None else InMemoryTurnRecorder()
    again = restarts or [0] * n
    trajs = []
    for i in range(n):
        session = f"{group_id}/a{attempt}/s{i}"
        server.open_session(session, StepKey(gen.run_id, group_id, i, 0, again[i]),
                            recorder=recorder, sampler=sampler)
        where = f"agent task {task.name!r}, group {group_id} sample {i}"
        try:
            client = openai.OpenAI(base_url=server.session_url(session), api_key="unused",
                                   max_retries=0)
            reward = task.run_agent(client, MODEL_NAME, prompt)
        except Exception as err:
            raise AgentError(f"{where}: the agent raised {type(err).__name__}: {err}") from err
        finally:
            traj = server.end_session(session)
        traj = _closed(traj, reward, where)
        last = traj.turns[-1]
        try:  # the last turn's result: the episode's end and its reward
            recorder.env_completed([(traj.key.at(last.turn), StepOutcome(last.reward, True, "done", ()))])
        except ReplayMismatchError as err:
            raise AgentError(f"{where}: {err}") from None
        trajs.append(traj)
    return trajs


def _closed(traj: Trajectory, reward: object, where: str) -> Trajectory:
    """The agent's reward on the episode's last model turn."""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise AgentError(f"{where}: run_agent returned {reward!r}; expected a finite number")
    if not traj.turns:
        raise AgentError(f"{where}: the agent asked the model nothing (no completion to train on)")
    traj.close_turn(float(reward), (), {})
    traj.end_reason = "done"
    return traj
