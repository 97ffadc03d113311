"""The episode runner: model turns and env steps, alternating, for a group of episodes.

Per group, all episodes advance turn by turn (so a turn's requests are sampled in
one batch where their contexts agree)::

    for each episode: obs = recorder.env_reset(key t0, env.reset)     -> trajectory
    while some episode is active:
        turns = recorder.model_turns(requests of the active ones, sampler.generate)
        for each: append the turn's ids; step = recorder.env_step(key, action, env.step)
                  the reward goes to the turn; done / max_turns / full context ends it,
                  else the observation's ids are appended

Every model turn and env step passes through the :class:`TurnRecorder` (the durable
implementation records and replays them); nothing here calls the sampler or an env
directly. An observation given as text is encoded once; given as ids, it is appended
as is. An env that raises, or whose observation the tokenizer cannot encode, fails the
group with an :class:`EnvError` naming the environment and the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.envs.base import Action, EnvError, EnvStep, Environment, Observation, StepKey
from workers.envs.recorder import ModelTurn, TurnRecorder, TurnRequest
from workers.envs.sampler import TurnSampler
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
            active = [
                i for i, model_turn in zip(active, turns)
                if self._advance(trajs[i], envs[i], turn, model_turn)
            ]
            turn += 1
        return trajs

    def _start(self, key: StepKey, env: Environment) -> Trajectory:
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

    def _advance(self, traj: Trajectory, env: Environment, turn: int, model_turn: ModelTurn) -> bool:
        """Append the turn and the env's answer; True if the episode goes on."""
        traj.append_turn(turn, model_turn)
        key = traj.key.at(turn)
        action = Action(self.tokenizer.decode(list(model_turn.tokens)), model_turn.tokens,
                        model_turn.stopped)
        result = self.recorder.env_step(key, action, lambda: self._call(env.step, action, key))
        if result.done:
            traj.close_turn(result.reward, (), result.info)
            traj.end_reason = "done"
            return False
        obs_ids = self._ids(result.observation, key)
        # the observation is appended only if a model turn can still follow it
        full = len(traj.input_ids) + len(obs_ids) + 1 > self.context_len
        if turn >= self.max_turns or full:
            traj.close_turn(result.reward, (), result.info)
            traj.end_reason = "max_turns" if turn >= self.max_turns else "context"
            return False
        traj.close_turn(result.reward, obs_ids, result.info)
        return True

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
        return result
