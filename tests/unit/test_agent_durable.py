"""Durable agent episodes: an agent's completions and what it sends back, in the log.

A model turn of an agent episode is one completion; its call is what the agent does
with it (its tools), keyed like an env call and announced in the response's
``step_key``; its result is what the agent sends back with its next request, or the
reward ``run_agent`` returns. The intent is recorded before the agent sees the
completion, the result when the next request comes. A resumed attempt runs the agent
again: recorded completions are served, recorded results checked, the rest sampled.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from events import schema as ev
from tests.plugin_tasks import LedgerAgent, NanOnceAgent
from tests.unit.test_loop_episodes import LosingGenerator, _by_group
from tests.unit.test_loop_inprocess import Harness, make_config
from workers.api import EpisodeFlush, EpisodeResume, RecordedCall
from workers.dataplane import MemoryDataPlane
from workers.envs.agent import AgentError, run_agent_group
from workers.envs.base import StepKey
from workers.envs.durable import DurableTurnRecorder, SegmentWriter, read_episode_log
from workers.envs.ledger import read_ledger
from workers.generator import Generator
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.service import GeneratorWorker
from workers.tasks import Example

pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]')")

SAMPLING = SamplingSection(max_new_tokens=4)
N = 2


@dataclass
class Log:
    """The flushes a group's recorder posted, as the controller would append them."""

    flushes: list[EpisodeFlush] = field(default_factory=list)

    def post(self, flush: EpisodeFlush) -> None:
        self.flushes.append(flush)

    def resume(self, plane: MemoryDataPlane, upto: int | None = None) -> Any:
        """What a resumed attempt reads of the first ``upto`` pauses."""
        kept = self.flushes[:upto]
        results = {(r.sample, r.turn): r for f in kept for r in f.completed}
        calls = [RecordedCall(call=c, result=results.get((c.sample, c.turn)))
                 for f in kept for c in f.requested]
        segments = [s for f in kept for s in f.segments]
        return read_episode_log(plane, "run-1", segments, EpisodeResume(restarts=[0] * N, calls=calls), N)

    def intents(self) -> set[tuple[int, int]]:
        return {(c.sample, c.turn) for f in self.flushes for c in f.requested}


class Watched(LedgerAgent):
    """LedgerAgent that checks, at every reply, that the log already holds its intent."""

    def __init__(self, log: Log, **kw: Any) -> None:
        super().__init__(**kw)
        self.log, self.keys = log, []

    def tool(self, key: str) -> str:
        sample, turn = key.split("/")[-2:]
        assert (int(sample[1:]), int(turn[1:])) in self.log.intents(), f"{key} ran before its intent"
        self.keys.append(key)
        return super().tool(key)


def recorder(gen: Generator, plane: MemoryDataPlane, sink: Log, log: Any = None,
             dedupe: bool = True, attempt: int = 1) -> DurableTurnRecorder:
    log = log if log is not None else sink.resume(plane, 0)
    writer = SegmentWriter(plane, "run-1", "g1", attempt, list(log.recorded))
    return DurableTurnRecorder(log, sink, writer, env="agent", dedupes_by_key=dedupe,
                               eos_id=gen.tokenizer.eos_id)


def generator(task: Any) -> tuple[Generator, MemoryDataPlane]:
    model, tok = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 4)
    plane = MemoryDataPlane()
    return Generator(model, tok, task, plane, "run-1"), plane


def play(task: Any, gen: Generator, rec: DurableTurnRecorder, seed: int = 5) -> list[Any]:
    example = Example(prompt="go3:", answer="")
    trajs = run_agent_group(gen, task, "g1", example, N, SAMPLING, seed, attempt=1, recorder=rec)
    rec.finish()
    return trajs


def test_every_intent_is_logged_before_the_agent_sees_its_turn_and_carries_its_step_key(tmp_path):
    sink = Log()
    task = Watched(sink, path=str(tmp_path / "ledger.txt"), turns=3)
    gen, plane = generator(task)
    trajs = play(task, gen, recorder(gen, plane, sink))
    assert task.keys == [f"run-1/g1/s{s}/t{t}" for s in range(N) for t in (1, 2, 3)]
    # every turn: one intent, then one result (the observation the agent sent, or the end)
    results = [(r.sample, r.turn, r.ended) for f in sink.flushes for r in f.completed]
    assert results == [(s, t, t == 3) for s in range(N) for t in (1, 2, 3)]
    assert [sum(r.reward for f in sink.flushes for r in f.completed if r.sample == s)
            for s in range(N)] == [t.reward for t in trajs]
    # deduplicating: a turn's result rides with the next intent, the last one alone
    assert [bool(f.requested) for f in sink.flushes] == [True] * (3 * N) + [False]


def test_a_recorded_agent_episode_is_served_back_and_a_crash_resumes_where_it_stopped(tmp_path):
    dedupe = True  # its tool answers a key it ran from its ledger: a replay may run it
    sink = Log()
    task = LedgerAgent(path=str(tmp_path / "ledger.txt"), turns=3, dedupe=dedupe)
    gen, plane = generator(task)
    first = play(task, gen, recorder(gen, plane, sink, dedupe=dedupe))
    # all of it recorded: another seed samples nothing and posts nothing
    again_sink = Log()
    rec = recorder(gen, plane, again_sink, sink.resume(plane), dedupe=dedupe, attempt=2)
    again = play(task, gen, rec, seed=6)
    assert rec.counts["generated"] == 0 and rec.counts["served"] == 3 * N
    assert again_sink.flushes == []
    assert [(t.input_ids, t.logprobs, t.reward) for t in again] == [
        (t.input_ids, t.logprobs, t.reward) for t in first]
    # a crash after 3 pauses: what they recorded is served, the rest sampled again
    resumed_sink = Log()
    rec = recorder(gen, plane, resumed_sink, sink.resume(plane, 3), dedupe=dedupe, attempt=2)
    resumed = play(task, gen, rec, seed=5)
    recorded = {(s.sample, s.turn) for f in sink.flushes[:3] for fl in f.segments
                if fl.kind == "model" for s in fl.segments}
    sampled = {(s.sample, s.turn) for f in resumed_sink.flushes for fl in f.segments
               if fl.kind == "model" for s in fl.segments}
    assert recorded and not recorded & sampled and rec.counts["served"] == len(recorded)
    assert len(recorded | sampled) == 3 * N and len(resumed) == N
    # run again, each key was answered from the tool's own record
    keys = [k for k, _ in read_ledger(tmp_path / "ledger.txt")]
    assert len(keys) == len(set(keys)) == 3 * N


def test_an_agent_that_sends_back_other_messages_than_the_log_holds_fails_naming_the_turn(tmp_path):
    sink = Log()
    task = LedgerAgent(path=str(tmp_path / "ledger.txt"), turns=3)
    gen, plane = generator(task)
    play(task, gen, recorder(gen, plane, sink))
    # another ledger, one line longer: every tool result differs from the recorded one
    other = tmp_path / "other.txt"
    other.write_text("x\t0\n")
    moved = LedgerAgent(path=str(other), turns=3)
    rec = recorder(gen, plane, Log(), sink.resume(plane), attempt=2)
    with pytest.raises(AgentError, match=r"sample 0: .*turn run-1/g1/s0/t1: the replayed agent "
                                         r"answered it otherwise than the recorded result"):
        play(moved, gen, rec)


AGENT = ("rollout.partial.enabled=true", "model.context_len=32", "sampling.max_new_tokens=4",
         "run.steps=1", f'task.name="{LedgerAgent.name}"')


def _agent_run(tmp_path: Path, dedupe: bool) -> Harness:
    options = f'task.options={{path="{tmp_path / "ledger.txt"}", turns=2, dedupe={str(dedupe).lower()}}}'
    # g000001 is forgotten once the log holds its turn-1 intent: the completion never
    # reached the agent, whose tool did not run
    h = Harness(make_config(*AGENT, options), tmp_path, generator=LosingGenerator,
                lose=frozenset({"g000001"}))
    assert h.run() == "completed"
    h.check_log()
    return h


def test_a_deduplicating_agents_lost_turn_is_asked_again_under_its_key(tmp_path):
    h = _agent_run(tmp_path, dedupe=True)
    mine = _by_group(h.events(), "g000001")
    assert not [e for e in mine if isinstance(e, ev.EpisodesRestarted)]
    first = [e for e in mine if getattr(e, "attempt", 0) == 1]
    second = [e for e in mine if getattr(e, "attempt", 0) == 2]
    turn1 = {(s.sample, s.turn) for e in first if isinstance(e, ev.SegmentsRecorded) for s in e.segments}
    again = {(s.sample, s.turn) for e in second if isinstance(e, ev.SegmentsRecorded)
             and e.kind == "model" for s in e.segments}
    assert turn1 and not turn1 & again, "a recorded completion was sampled again"
    (asked,) = [e for e in first if isinstance(e, ev.EnvStepsRequested)]
    reissued = [e for e in second if isinstance(e, ev.EnvStepsRequested)][0]
    assert reissued.calls == asked.calls  # the same key and request
    (commit,) = [e for e in mine if isinstance(e, ev.GroupCommitted)]
    assert commit.attempt == 2
    keys = [k for k, _ in read_ledger(tmp_path / "ledger.txt")]
    assert len(keys) == len(set(keys)) and "loop-test/g000001/s0/t1" in keys


def test_a_non_deduplicating_agents_intent_without_result_restarts_its_episode(tmp_path):
    h = _agent_run(tmp_path, dedupe=False)
    mine = _by_group(h.events(), "g000001")
    (restart,) = [e for e in mine if isinstance(e, ev.EpisodesRestarted)]
    assert restart.samples == [0] and "cannot deduplicate" in restart.reason
    (commit,) = [e for e in mine if isinstance(e, ev.GroupCommitted)]
    assert commit.attempt == 2
    keys = [k for k, _ in read_ledger(tmp_path / "ledger.txt") if "/g000001/" in k]
    # the lost turn's call never ran under its key; the episode ran again under new ones
    assert "loop-test/g000001/s0/t1" not in keys and "loop-test/g000001/s0.r1/t1" in keys
    assert len(keys) == len(set(keys))


class LosingLater(LosingGenerator):
    """Forgets the group once sample 0's first result is in the log as well."""

    after = 4


def test_a_non_deduplicating_agents_episode_with_recorded_results_restarts_too(tmp_path):
    """A resumed agent runs its code from the start, tools included: for one that cannot
    deduplicate, an episode whose calls all have results starts over too (new keys),
    or its recorded turns' tools would run again under their keys."""
    options = f'task.options={{path="{tmp_path / "ledger.txt"}", turns=2, dedupe=false}}'
    h = Harness(make_config(*AGENT, options), tmp_path, generator=LosingLater,
                lose=frozenset({"g000001"}))
    assert h.run() == "completed"
    h.check_log()
    mine = _by_group(h.events(), "g000001")
    first = [e for e in mine if isinstance(e, ev.EnvStepsCompleted) and e.attempt == 1]
    assert first, "the group was lost before a result was recorded: not the case under test"
    (restart,) = [e for e in mine if isinstance(e, ev.EpisodesRestarted)]
    assert restart.samples == [0] and "runs its calls again on a resume" in restart.reason
    keys = [k for k, _ in read_ledger(tmp_path / "ledger.txt") if "/g000001/" in k]
    assert len(keys) == len(set(keys)), f"a tool ran twice under one key: {keys}"
    assert "loop-test/g000001/s0.r1/t1" in keys


class HeldLog(Log):
    """A log whose appends wait until the test lets them go (a pause the controller is
    slow to take), telling the test when one is waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting, self.go = threading.Event(), threading.Event()

    def post(self, flush: EpisodeFlush) -> None:
        super().post(flush)
        self.waiting.set()
        self.go.wait()


def test_a_session_ended_while_its_request_waits_at_a_pause_keeps_nothing_of_it(tmp_path):
    """The agent gave up on a request that waits for the log (its client timed out) and
    its session was ended: the request, once the pause is taken, is refused by name and
    the server holds nothing of the ended session (no reply kept for a retry)."""
    from workers.envs.chat import ChatSession
    from workers.envs.recorder import ModelTurn
    from workers.envs.sampler import HoldingWeights, generator_sampler
    from workers.envs.trajectory import Trajectory
    from workers.generator.openai_server import OpenAIServer
    from tests.unit.test_agent_task import held_by

    sink = HeldLog()
    task = LedgerAgent(path=str(tmp_path / "ledger.txt"), turns=3, dedupe=False)
    gen, plane = generator(task)
    server = OpenAIServer.for_generator(gen, SAMPLING, task.tool_format, open_on_request=False)
    sampler = HoldingWeights(generator_sampler(gen, SAMPLING, 5), gen.weights)
    server.open_session("g1/a1/s0", StepKey("run-1", "g1", 0, 0),
                        recorder=recorder(gen, plane, sink, dedupe=False), sampler=sampler)
    answer: list[tuple[int, dict[str, Any]]] = []
    request = threading.Thread(target=lambda: answer.append(server.handle(
        "/sessions/g1%2Fa1%2Fs0/v1/chat/completions",
        {"messages": [{"role": "user", "content": "go3:"}]})))
    request.start()
    sink.waiting.wait()  # the completion's intent waits for the log
    server.end_session("g1/a1/s0")
    sink.go.set()
    request.join()
    ((status, body),) = answer
    assert status == 404 and "'g1/a1/s0' ended while its request waited" in body["error"]["message"]
    assert server.sessions == {} and server._replies == {}
    assert held_by(server, (ChatSession, ModelTurn, Trajectory)) == []


class GivesUp(LedgerAgent):
    """Sends its second request and stops waiting for it while it waits at a pause (a
    client timeout), failing the episode."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.give_up, self.late = threading.Event(), concurrent.futures.Future()

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": example.prompt}]
        message = client.chat.completions.create(model=model, messages=messages).choices[0].message
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        self.late = concurrent.futures.ThreadPoolExecutor(1).submit(
            client.chat.completions.create, model=model, messages=messages)
        self.give_up.wait()
        raise TimeoutError("the agent stopped waiting")


def test_a_group_that_failed_while_a_request_waits_at_a_pause_lets_the_request_go(tmp_path):
    """The agent's request waits at a pause (its previous turn's result) and the agent,
    tired of waiting, fails the group. The generator returns the group as failed; the request,
    let go on once the pause is recorded, must not wait for a log nobody appends to."""
    from workers.api import GenerationRequest
    from workers.generator.episodes import EpisodeGroups

    task = GivesUp(path=str(tmp_path / "ledger.txt"), turns=3, dedupe=False)
    gen, _ = generator(task)
    groups, example = EpisodeGroups(gen), Example(prompt="go3:", answer="")
    recorded = 0
    for _ in range(2):  # the first completion's intent; the result the second request brings
        (out,) = groups.advance([GenerationRequest(group_id="g1", attempt=1, prompt_index=0,
                                                   n_samples=1, seed=5, flushes=recorded)],
                                [example], SAMPLING)
        assert out.status == "flushed"
        recorded += out.episode.events
    assert out.episode.completed and not out.episode.requested
    task.give_up.set()
    groups.held["g1"].thread.join()
    # the group's own failure: returned as its outcome, the call's other groups go on
    (out,) = groups.advance([GenerationRequest(group_id="g1", attempt=1, prompt_index=0, n_samples=1,
                                               seed=5, flushes=recorded)], [example], SAMPLING)
    assert out.status == "failed"
    assert out.reason.startswith("AgentError: ")
    assert out.reason.endswith("the agent raised TimeoutError: the agent stopped waiting")
    # the request went on to its next pause, which is nobody's now: it is refused
    late = task.late.exception(timeout=60)
    assert getattr(late, "status_code", None) == 500, late
    assert "the generator dropped this group's attempt" in str(late)


def test_a_reply_to_a_client_that_left_while_its_request_waited_prints_no_traceback(tmp_path, capsys):
    """An agent's client that timed out at a pause has closed its connection when the
    reply comes: nobody is left to answer, which is no fault to print (the run's output
    got a raw BrokenPipeError traceback from the HTTP server)."""
    import json
    import socket
    import struct

    from workers.envs.sampler import HoldingWeights, generator_sampler
    from workers.generator.openai_server import OpenAIServer

    sink = HeldLog()
    task = LedgerAgent(path=str(tmp_path / "ledger.txt"), turns=3, dedupe=False)
    gen, plane = generator(task)
    server = OpenAIServer.for_generator(gen, SAMPLING, task.tool_format, open_on_request=False).start()
    sampler = HoldingWeights(generator_sampler(gen, SAMPLING, 5), gen.weights)
    server.open_session("s0", StepKey("run-1", "g1", 0, 0),
                        recorder=recorder(gen, plane, sink, dedupe=False), sampler=sampler)
    body = json.dumps({"messages": [{"role": "user", "content": "go3:"}]}).encode()
    host, port = server._http.server_address[:2]
    client = socket.create_connection((host, port))
    client.sendall(b"POST /sessions/s0/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    sink.waiting.wait()  # the completion's intent waits for the log; the client gives up
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset
    client.close()
    sink.go.set()
    server.close()  # waits for the request's thread
    assert "Traceback" not in capsys.readouterr().err


class FailsSecond:
    """A sampler whose second call fails (a model fault mid-request), then samples."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.calls = sampler, 0

    def generate(self, requests: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("device lost")
        return self.sampler.generate(requests)


def test_a_request_retried_after_a_server_fault_records_its_turns_result_once(tmp_path):
    """The second request brings turn 1's result, which is recorded, then the sampler
    fails (500). The corrected resend brings the same result: it is the recorded one,
    not a second result of turn 1 (which the log refuses, failing the group)."""
    import openai

    from workers.envs.sampler import HoldingWeights, generator_sampler
    from workers.generator.openai_server import OpenAIServer

    sink = Log()
    task = LedgerAgent(path=str(tmp_path / "ledger.txt"), turns=3, dedupe=False)
    gen, plane = generator(task)
    server = OpenAIServer.for_generator(gen, SAMPLING, task.tool_format, open_on_request=False).start()
    sampler = FailsSecond(HoldingWeights(generator_sampler(gen, SAMPLING, 5), gen.weights))
    server.open_session("s0", StepKey("run-1", "g1", 0, 0),
                        recorder=recorder(gen, plane, sink, dedupe=False), sampler=sampler)
    client = openai.OpenAI(base_url=server.session_url("s0"), api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "go3:"}]
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "1"}]
    with pytest.raises(openai.InternalServerError, match="device lost"):
        client.chat.completions.create(model="policy", messages=messages)
    client.chat.completions.create(model="policy", messages=messages)
    server.close()
    results = [(r.sample, r.turn) for f in sink.flushes for r in f.completed]
    assert results == [(0, 1)]


class NanOnceGenerator(GeneratorWorker):
    """Gives its ``NanOnceAgent`` the prompt of group ``bad`` of the first call."""

    bad = 0

    def generate_groups(self, reqs):
        task = self.generator.task
        if not task.nan_prompt:
            task.nan_prompt = self.prompts[self.bad].prompt
            assert self.prompts[1 - self.bad].prompt != task.nan_prompt
        return super().generate_groups(reqs)


@pytest.mark.parametrize("partial", ["false", "true"])
def test_an_agents_bad_reward_fails_its_group_alone(tmp_path, partial):
    # g000000 and g000001 ride in one call; g000000's agent returns nan once. With
    # durable episodes g000001 pauses in the call g000000 failed in
    options = f'task.options={{path="{tmp_path / "ledger.txt"}", turns=2}}'
    h = Harness(make_config(*AGENT, options, f'task.name="{NanOnceAgent.name}"',
                            f"rollout.partial.enabled={partial}", "rollout.groups_per_call=2",
                            "rollout.num_generators=1", "rollout.max_attempts=2"),
                tmp_path, generator=NanOnceGenerator)
    assert h.run() == "completed"
    h.check_log()
    [failed] = h.events(ev.GroupFailed)
    assert (failed.group_id, failed.attempt) == ("g000000", 1)
    assert failed.reason.startswith(
        f"generator-0: AgentError: agent task '{NanOnceAgent.name}', group g000000 sample ")
    assert failed.reason.endswith(": run_agent returned nan; expected a finite number")
    committed = {(e.group_id, e.attempt) for e in h.events(ev.GroupCommitted)}
    assert ("g000001", 1) in committed and ("g000000", 2) in committed
