"""Durable episodes on the generator: groups that pause at every record point.

With ``rollout.partial`` on, a generator whose task is an episode task or an agent task
(``workers.envs.agent``: the agent's code plays the episodes through the generator's
endpoint, and its requests block at the pauses) runs each group's episodes in a thread
of their own, through the durable recorder
(``workers.envs.durable``). A generator call runs its groups in order until one of them
reaches a pause -- the recorder hands over an ``EpisodeFlush`` (model turns and the
intent of the calls that answer them, the calls' results and observations, or, for an
env that deduplicates, the last turn's results with the next turn's intent) and blocks
-- and returns it (``status = "flushed"``). The controller appends it and calls again
with the same group and ``flushes`` = the events it has recorded for that attempt; that
call lets the paused thread go on to its next pause. A finished group writes its final
rows as before (``"done"``); groups after a paused one are not started (``"pending"``).

So, as with partial rollouts (``workers.generator.inflight``), at most one pause per
group is ever not in the log. A request for a group this worker does not hold at that
point -- it was replaced, or the attempt moved on -- is refused; the controller fails the
attempt and re-admits the group with what the log holds (``resume`` and ``episode``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.api import EpisodeFlush, GenerationOutcome, GenerationRequest, error_line
from workers.envs.agent import AgentTask, dedupes_by_key
from workers.envs.durable import DurableTurnRecorder, SegmentWriter, read_episode_log, token_ledger
from workers.envs.group import generate_episode_group
from workers.envs.task import EpisodeTask
from workers.errors import GroupError
from workers.generator.generator import row_key
from workers.generator.inflight import InflightStateLost
from workers.models.config import SamplingSection
from workers.tasks.base import Example


class _Abandoned(Exception):
    """The worker dropped the group while its thread waited at a pause."""

    def __init__(self) -> None:
        super().__init__("the generator dropped this group's attempt (it failed, or the "
                         "controller moved on): nothing waits for its pauses")


class _Channel:
    """Hands one group's pauses from its episode thread to the generator calls."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: EpisodeFlush | None = None
        self._posted = self._acked = 0
        self._closed = False
        self._end: tuple[str, Any] | None = None

    def post(self, flush: EpisodeFlush) -> None:
        """(episode thread) Hand over a pause; return once the controller recorded it."""
        with self._cond:
            if self._closed:
                raise _Abandoned()
            self._pending = flush
            self._posted += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._acked >= self._posted or self._closed)
            if self._closed:
                raise _Abandoned()

    def end(self, kind: str, value: Any) -> None:
        """(episode thread) The group finished ("done", its result) or failed ("error")."""
        with self._cond:
            self._end = (kind, value)
            self._cond.notify_all()

    def next(self) -> tuple[str, Any]:
        """(call thread) Wait for the next pause ("flushed", flush) or the end."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is not None or self._end is not None)
            if self._pending is not None:
                return "flushed", self._pending
            assert self._end is not None
            return self._end

    def ack(self) -> None:
        """(call thread) The pause is in the log: the thread goes on."""
        with self._cond:
            self._pending = None
            self._acked = self._posted
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass
class _Held:
    attempt: int
    channel: _Channel
    thread: threading.Thread
    #: this attempt's events the controller has recorded; those of the pause it holds
    recorded: int = 0
    pending: int = 0


#: how long a new attempt waits for an abandoned thread of its group to stop
ABANDON_JOIN_S = 60.0


class EpisodeGroups:
    """The generator side of durable episodes (see the module docstring)."""

    def __init__(self, generator: Any) -> None:
        task = generator.task
        assert isinstance(task, (EpisodeTask, AgentTask))
        self.gen, self.task = generator, task
        self.held: dict[str, _Held] = {}

    def advance(
        self, reqs: Sequence[GenerationRequest], examples: Sequence[Example], sampling: SamplingSection
    ) -> list[GenerationOutcome]:
        """Run ``reqs`` in order until one pauses or all are done; one outcome each."""
        wanted = {r.group_id for r in reqs}
        for gid in [g for g in self.held if g not in wanted]:
            self.held.pop(gid).channel.close()  # the controller moved on (failed, fenced)
        outs: list[GenerationOutcome] = []
        for req, example in zip(reqs, examples):
            if any(o.status == "flushed" for o in outs):
                outs.append(_outcome(status="pending"))
                continue
            outs.append(self._advance(req, example, sampling))
        return outs

    def _advance(self, req: GenerationRequest, example: Example, sampling: SamplingSection) -> GenerationOutcome:
        held = self._hold(req, example, sampling)
        kind, value = held.channel.next()
        if kind == "flushed":
            held.pending = value.events
            return _outcome(status="flushed", episode=value)
        # closed: a request its agent gave up on may still wait at a pause (or reach
        # one), and no call will ever ack it
        self.held.pop(req.group_id).channel.close()
        if kind == "error":
            if isinstance(value, GroupError):  # its env's or agent's: this group alone fails
                return GenerationOutcome.failed(error_line(value))
            raise value
        return GenerationOutcome(
            payload_keys=list(value["keys"]), rewards=list(value["rewards"]),
            lengths=list(value["completion_lens"]),
            weight_version_start=value["weight_version_start"],
            weight_version_end=value["weight_version_end"], version_runs=value["version_runs"],
        )

    def _hold(self, req: GenerationRequest, example: Example, sampling: SamplingSection) -> _Held:
        held = self.held.get(req.group_id)
        if held is not None and held.attempt == req.attempt:
            if not held.pending or req.flushes != held.recorded + held.pending:
                raise InflightStateLost(
                    f"group {req.group_id} attempt {req.attempt}: the log has {req.flushes} of "
                    f"its events, this worker paused after {held.recorded + held.pending}; "
                    "re-admit it to resume from the log"
                )
            held.recorded, held.pending = held.recorded + held.pending, 0
            held.channel.ack()
            return held
        if held is not None:  # an older attempt: its thread stops at its next pause
            self.held.pop(req.group_id).channel.close()
            held.thread.join(ABANDON_JOIN_S)
        if req.flushes > 0:
            raise InflightStateLost(
                f"group {req.group_id} attempt {req.attempt}: this worker does not hold it "
                f"after {req.flushes} recorded events (replaced?); re-admit it to resume"
            )
        channel = _Channel()
        thread = threading.Thread(
            target=self._play, args=(req, example, sampling, channel), daemon=True,
            name=f"episodes-{req.group_id}-a{req.attempt}",
        )
        held = self.held[req.group_id] = _Held(req.attempt, channel, thread)
        thread.start()
        return held

    def _play(self, req: GenerationRequest, example: Example, sampling: SamplingSection,
              channel: _Channel) -> None:
        """The group's thread: its episodes, from what the log holds, to the final rows."""
        gen, n = self.gen, req.n_samples
        try:
            log = read_episode_log(gen.dataplane, gen.run_id, req.resume, req.episode, n)
            writer = SegmentWriter(gen.dataplane, gen.run_id, req.group_id, req.attempt,
                                   list(log.recorded))
            recorder = DurableTurnRecorder(
                log, channel, writer, env=self.task.name,
                dedupes_by_key=self._dedupes(example), agent=isinstance(self.task, AgentTask),
                eos_id=gen.tokenizer.eos_id, on_generated=token_ledger(req.group_id, req.attempt),
            )
            keys = [row_key(gen.run_id, req.group_id, req.attempt, i) for i in range(n)]
            done = generate_episode_group(gen, keys, req.group_id, example, n, sampling,
                                          req.seed, req.attempt, recorder, log.restarts)
            recorder.finish()  # the last results, if they were held, before the commit
            channel.end("done", done)
        except _Abandoned:
            pass
        except BaseException as err:  # the call thread raises it: the attempt fails
            channel.end("error", err)


    def _dedupes(self, example: Example) -> bool:
        if isinstance(self.task, AgentTask):  # its own tools: declared on the task
            return dedupes_by_key(self.task)
        return bool(self.task.make_env(example).dedupes_by_key)


def _outcome(status: str, episode: EpisodeFlush | None = None) -> GenerationOutcome:
    return GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                             weight_version_end=0, status=status, episode=episode)  # type: ignore[arg-type]
