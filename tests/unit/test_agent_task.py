"""An agent task: user code written for the OpenAI client plays each episode against
the generator's own model, and the group's rows are the sessions' exact ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.plugin_tasks import ReverseAgent
from workers.dataplane import MemoryDataPlane
from workers.envs.agent import AgentError, AgentTask, run_agent_group
from workers.envs.recorder import InMemoryTurnRecorder
from workers.generator import Generator
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.models.sampling import sequence_logprobs
from workers.tasks import Example, make_task

pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]')")

SAMPLING = SamplingSection(max_new_tokens=6)


@dataclass(frozen=True)
class Watched(ReverseAgent):
    """ReverseAgent that keeps every response its client received, and its rewards."""

    seen: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        create = client.chat.completions.create

        def watched(**kwargs: Any) -> Any:
            reply = create(**kwargs)
            self.seen.append(reply)
            return reply

        client.chat.completions.create = watched
        self.rewards.append(super().run_agent(client, model, example))
        return self.rewards[-1]


def generator(task: Any) -> tuple[Generator, MemoryDataPlane, Any]:
    model, tok = build_model(ModelSection(context_len=64, d_model=32, n_heads=2), 4)
    plane = MemoryDataPlane()
    return Generator(model, tok, task, plane, "run-1"), plane, model


def test_the_rows_are_the_sessions_ids_logprobs_and_the_agents_reward():
    task = Watched()
    assert isinstance(task, AgentTask) and isinstance(make_task(ReverseAgent.name), AgentTask)
    gen, plane, model = generator(task)
    example = task.examples(1, 0)[0]
    result = gen.generate_group("g1", example, 3, SAMPLING, seed=5, attempt=1)
    rows = plane.get("run-1", result.keys)
    assert len(task.seen) == 6  # two completions per episode, the first a tool call
    assert all(r.choices[0].message.tool_calls for r in task.seen[0::2])
    for i, row in enumerate(rows):
        first, last = (task.seen[2 * i + j].choices[0].model_extra for j in (0, 1))
        # the row is the last request's ids plus its reply's, as the session sampled them
        assert row["input_ids"].tolist() == last["prompt_token_ids"] + last["token_ids"]
        model_at = [False] * len(row["input_ids"])
        start = len(first["prompt_token_ids"])
        for s, reply in ((start, first), (len(last["prompt_token_ids"]), last)):
            model_at[s:s + len(reply["token_ids"])] = [True] * len(reply["token_ids"])
        assert row["loss_mask"].tolist() == model_at
        assert int(row["prompt_len"]) == start
        mask = row["loss_mask"]
        ref = sequence_logprobs(model, row["input_ids"])
        torch.testing.assert_close(row["generator_logprobs"][mask], ref[mask], atol=2e-5, rtol=0)
        assert row["token_versions"][mask].tolist() == [0] * int(mask.sum())
        assert set(row["token_versions"][~mask].tolist()) == {-1}
        # the agent's reward sits on the last model token, and nowhere else
        last_model = max(j for j, m in enumerate(model_at) if m)
        assert row["token_rewards"][last_model].item() == pytest.approx(task.rewards[i])
        assert row["token_rewards"].sum().item() == pytest.approx(task.rewards[i])
    assert result.rewards == pytest.approx(task.rewards)


def test_a_rerun_is_served_from_the_record_and_an_agent_that_asks_otherwise_fails():
    task = ReverseAgent()
    gen, plane, _ = generator(task)
    example = task.examples(1, 0)[0]
    recorder = InMemoryTurnRecorder()
    first = run_agent_group(gen, task, "g1", example, 2, SAMPLING, seed=5, recorder=recorder)
    sampled = recorder.calls["model"]
    assert sampled == 4
    # another seed: a sampled rerun would differ; the record serves the same turns
    again = run_agent_group(gen, task, "g1", example, 2, SAMPLING, seed=6, recorder=recorder)
    assert recorder.calls["model"] == sampled
    assert [t.input_ids for t in again] == [t.input_ids for t in first]
    assert [t.logprobs for t in again] == [t.logprobs for t in first]
    other = Example(example.prompt + "a", example.answer)
    with pytest.raises(AgentError, match=r"sample 0: the agent raised BadRequestError.*"
                                         r"different turn than the recorded one"):
        run_agent_group(gen, task, "g1", other, 2, SAMPLING, seed=5, recorder=recorder)


@dataclass(frozen=True)
class Silent(ReverseAgent):
    def run_agent(self, client: Any, model: str, example: Example) -> float:
        return 1.0


@dataclass(frozen=True)
class NoNumber(ReverseAgent):
    def run_agent(self, client: Any, model: str, example: Example) -> float:
        super().run_agent(client, model, example)
        return float("nan")


@pytest.mark.parametrize(("task", "why"), [
    (Silent(), "the agent asked the model nothing"),
    (NoNumber(), "run_agent returned nan; expected a finite number"),
])
def test_an_agent_that_gives_nothing_to_train_on_fails_its_group(task, why):
    gen, plane, _ = generator(task)
    with pytest.raises(AgentError, match=f"group g1 sample 0: {why}"):
        gen.generate_group("g1", task.examples(1, 0)[0], 2, SAMPLING, seed=5)


def test_an_agent_task_passes_the_preflight_with_partial_rollouts_too():
    from cli.preflight import check_config
    from controller.config import load_config

    task = [f'task.name="{ReverseAgent.name}"']
    check_config(load_config(overrides=task))
    # durable since the agent's calls are recorded as an env's are
    check_config(load_config(overrides=[*task, "rollout.partial.enabled=true"]))


@dataclass(frozen=True)
class SaysYes(ReverseAgent):
    name = "tests.unit.test_agent_task:SaysYes"
    dedupes_by_key: Any = "yes"


def test_an_agent_task_declaring_dedupes_by_key_other_than_a_bool_is_refused_in_one_line():
    from cli.common import CliError
    from cli.preflight import check_config
    from controller.config import load_config

    with pytest.raises(CliError, match=r"^config: task.name = .*SaysYes' declares dedupes_by_key "
                                       r"= 'yes'; an agent task declares True or False"):
        check_config(load_config(overrides=[f'task.name="{SaysYes.name}"']))


def held_by(root: Any, kinds: tuple[type, ...]) -> list[Any]:
    """Every object of ``kinds`` reachable from ``root`` by reference (modules, classes
    and functions, which reach everything through their globals, are not followed)."""
    import gc
    import types

    stop = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
    seen, todo, found = {id(root)}, [root], []
    while todo:
        obj = todo.pop()
        if isinstance(obj, kinds):
            found.append(obj)
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, stop):
                seen.add(id(ref))
                todo.append(ref)
    return found


@dataclass(frozen=True)
class StaleClient(ReverseAgent):
    """An agent that keeps its client after the episode and sends one more request
    with it at the start of the next (a cached client, a retry fired too late)."""

    kept: list[Any] = field(default_factory=list)
    late: list[str] = field(default_factory=list)

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        import openai

        if self.kept:
            try:
                self.kept.pop().chat.completions.create(
                    model=model, messages=[{"role": "user", "content": example.prompt}])
            except openai.NotFoundError as err:
                self.late.append(str(err))
        self.kept.append(client)
        return super().run_agent(client, model, example)


def test_the_generators_endpoint_holds_no_episode_it_served():
    """The endpoint lives as long as its generator and serves every episode of every
    group: once an episode has ended it holds nothing of it -- no session, reply,
    recorded turn or trajectory -- and a late request to it is refused by name."""
    from workers.envs.agent import agent_server
    from workers.envs.chat import ChatSession
    from workers.envs.recorder import ModelTurn
    from workers.envs.trajectory import Trajectory

    task = StaleClient()
    gen, _, _ = generator(task)
    example = task.examples(1, 0)[0]
    for g in range(3):
        run_agent_group(gen, task, f"g{g}", example, 2, SAMPLING, seed=g)
    server = agent_server(gen, SAMPLING, task.tool_format)
    assert server.sessions == {}
    assert held_by(server, (ChatSession, ModelTurn, Trajectory)) == []
    # every episode but the first was started with one late request to the one before
    assert len(task.late) == 5
    assert all("session 'g" in m and "is not open" in m for m in task.late), task.late
