"""The episode runner: model turns and env steps, alternating, for a group of episodes.

Per group, all episodes advance turn by turn (so a turn's requests are sampled in
one batch where their contexts agree)::

    for each episode: obs = recorder.env_reset(key t0, env.reset)     -> trajectory
    while some episode is active:
        turns = recorder.model_turns(requests of the active ones, sampler.generate)
        append each turn's ids; outcomes = recorder.env_steps(one call per episode)
        each outcome: the turn's reward, and the observation's ids appended -- or the
        episode ends (done, max_turns, or no room left in the context)

Every model turn and env step passes through the :class:`TurnRecorder` (the durable
one records them in the log and serves them on replay); nothing here calls the sampler
or an env directly. A served step is not made again: the env instance is brought to
the state after it by its ``restore_step``, or, for an env that deduplicates by key, by
re-issuing it with its key; either way the step's reward, end and observation ids
must be the recorded ones, or the episode fails (a replay that reached another state). An observation
given as text is encoded once; given as ids, it is appended as is. An env that raises,
or whose observation the tokenizer cannot encode, fails the group with an
:class:`EnvError` naming the environment and the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from workers.envs.base import (
    Action,
    EnvError,
    EnvStep,
    Environment,
    Observation,
    RestoresState,
    StepKey,
)
from workers.envs.recorder import (
    ModelTurn,
    StepCall,
    StepOutcome,
    TurnRecorder,
    TurnRequest,
    digest,
)
from workers.envs.sampler import TurnSampler
from workers.tasks.base import checked_reward
from workers.envs.trajectory import Trajectory
from workers.models.factory import Tokenizer
from workers.tasks.dataset import PromptTooLongError


@dataclass
class EpisodeRunner:
    sampler: TurnSampler
    tokenizer: Tokenizer
    recorder: TurnRecorder
    #: longest sequence the model accepts
    context_len: int
    #: budget of one model turn
    max_new_tokens: int
    max_turns: int
    #: names the environment in errors
    env_name: str = "environment"

    def run(self, keys: Sequence[StepKey], envs: Sequence[Environment]) -> list[Trajectory]:
        """Run one episode per (key, env); ``keys`` are the episodes' turn-0 keys."""
        trajs = [self._start(key, env) for key, env in zip(keys, envs, strict=True)]
        active = list(range(len(trajs)))
        turn = 1
        while active:
            requests = [self._request(trajs[i], turn) for i in active]
            turns = self.recorder.model_turns(requests, self.sampler.generate)
            calls = [
                self._call_of(trajs[i], envs[i], request, model_turn)
                for i, request, model_turn in zip(active, requests, turns)
            ]
            outcomes = self.recorder.env_steps(calls)
            active = [i for i, out in zip(active, outcomes) if self._apply(trajs[i], out)]
            turn += 1
        return trajs

    def _start(self, key: StepKey, env: Environment) -> Trajectory:
        if not env.dedupes_by_key and not isinstance(env, RestoresState):
            raise EnvError(
                f"{self.env_name}: the environment declares dedupes_by_key = False and has no "
                "restore_step, so an episode resumed after a crash could neither re-issue its "
                "calls nor rebuild its state; implement restore_step (docs/agents.md)"
            )
        obs = self.recorder.env_reset(key, lambda: self._call(env.reset, key))
        ids = self._ids(obs, key)
        if len(ids) + 1 > self.context_len or not ids:
            raise PromptTooLongError(
                f"{self.env_name}: first observation of {key} is {len(ids)} tokens; the "
                f"context of {self.context_len} leaves no room for a model turn"
            )
        traj = Trajectory(key)
        traj.append_observation(ids)
        return traj

    def _request(self, traj: Trajectory, turn: int) -> TurnRequest:
        room = self.context_len - len(traj.input_ids)
        return TurnRequest(traj.key.at(turn), tuple(traj.input_ids), min(self.max_new_tokens, room))

    def _call_of(
        self, traj: Trajectory, env: Environment, request: TurnRequest, model_turn: ModelTurn
    ) -> StepCall:
        """Append the turn; the env call that answers it."""
        key = request.key
        traj.append_turn(key.turn, model_turn)
        action = Action(self.tokenizer.decode(list(model_turn.tokens)), model_turn.tokens,
                        model_turn.stopped)
        return StepCall(
            key, action, digest(request.context, model_turn.tokens, model_turn.stopped),
            run=lambda: self._outcome(traj, env, action, key),
            replayed=lambda outcome: self._restore(env, action, outcome, key),
        )

    def _outcome(self, traj: Trajectory, env: Environment, action: Action, key: StepKey) -> StepOutcome:
        """Make the env call; what it means for the episode."""
        result = self._call(env.step, action, key)
        if result.done:
            return StepOutcome(result.reward, True, "done", (), dict(result.info))
        obs_ids = self._ids(result.observation, key)
        # the observation is appended only if a model turn can still follow it
        full = len(traj.input_ids) + len(obs_ids) + 1 > self.context_len
        if key.turn >= self.max_turns or full:
            reason = "max_turns" if key.turn >= self.max_turns else "context"
            return StepOutcome(result.reward, True, reason, (), dict(result.info))
        return StepOutcome(result.reward, False, "", obs_ids, dict(result.info))

    def _apply(self, traj: Trajectory, outcome: StepOutcome) -> bool:
        """The outcome onto the trajectory; True if the episode goes on."""
        traj.close_turn(outcome.reward, outcome.observation, outcome.info)
        if outcome.ended:
            traj.end_reason = outcome.end_reason
        return not outcome.ended

    def _restore(self, env: Environment, action: Action, outcome: StepOutcome, key: StepKey) -> None:
        """A recorded step, served: bring the fresh env instance to the state after it."""
        recorded = EnvStep(Observation(token_ids=outcome.observation), outcome.reward,
                           outcome.end_reason == "done", outcome.info)
        if isinstance(env, RestoresState):
            def restore(a: Action, k: StepKey) -> EnvStep:
                shown = env.restore_step(a, recorded, k)
                return recorded if shown is None else EnvStep(shown, recorded.reward, recorded.done)

            again = self._call(restore, action, key)  # rebuilt in the instance: no effect
        else:
            again = self._call(env.step, action, key)  # deduplicated by key: no second effect
        ids = self._ids(again.observation, key) if outcome.observation else ()
        if (again.reward, again.done, ids) != (outcome.reward, recorded.done, outcome.observation):
            differ = next((i for i, (a, b) in enumerate(zip(ids, outcome.observation)) if a != b),
                          min(len(ids), len(outcome.observation)))
            raise EnvError(
                f"{self.env_name} is not deterministic on replay at {key}: the log recorded "
                f"reward {outcome.reward}, done={recorded.done}, {len(outcome.observation)} "
                f"observation ids; replayed, it returned reward {again.reward}, "
                f"done={again.done}, {len(ids)} ids"
                + (f" (first different id at {differ})" if ids != outcome.observation else "")
            )

    def _ids(self, obs: Observation, key: StepKey) -> tuple[int, ...]:
        if obs.token_ids is not None:
            return obs.token_ids
        assert obs.text is not None
        try:
            return tuple(self.tokenizer.encode(obs.text))
        except ValueError as err:
            raise EnvError(f"{self.env_name}: observation at {key} cannot be encoded: {err}") from None

    def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run an env method; anything it raises becomes an EnvError naming env and step."""
        try:
            result = fn(*args)
        except EnvError:
            raise
        except Exception as err:
            where = args[-1]
            raise EnvError(
                f"{self.env_name} raised at {where}: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(result, (Observation, EnvStep)):
            raise EnvError(
                f"{self.env_name} returned {type(result).__name__} at {args[-1]}; expected "
                "an Observation from reset and an EnvStep from step"
            )
        if isinstance(result, EnvStep):  # a reward of another type would go into the log
            try:
                reward = checked_reward(f"{self.env_name} step() at {args[-1]}", result.reward)
            except (TypeError, ValueError) as err:
                raise EnvError(str(err)) from None
            result = replace(result, reward=reward)
        return result
