"""The episode runner: exact ids, loss mask on model tokens, rewards per turn, the
recorder's replay, and errors that name the environment and the step."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn

from workers.envs.base import Action, EnvError, EnvStep, Observation, StepKey
from workers.envs.calculator import CalculatorEnv
from workers.envs.recorder import (
    InMemoryTurnRecorder,
    ReplayMismatchError,
    StepCall,
    StepOutcome,
    TurnRequest,
)
from workers.envs.runner import EpisodeRunner
from workers.envs.sampler import TorchTurnSampler
from workers.envs.trajectory import per_token_advantages
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.models.sampling import sequence_logprobs
from workers.models.tokenizer import EOS_ID, CharTokenizer
from workers.tasks import Example, make_task

TOK = CharTokenizer()
KEYS = [StepKey("run", "g0", i, 0) for i in range(4)]


class OracleLM(nn.Module):
    """Predicts ``sequence[t + 1]`` at position t: plays one planned episode exactly."""

    def __init__(self, sequence: list[int], vocab: int) -> None:
        super().__init__()
        self.sequence, self.vocab = sequence, vocab
        self.dummy = nn.Parameter(torch.zeros(()))
        self.context_len = 64

    def forward(self, input_ids, past=None, return_cache=False):  # type: ignore[no-untyped-def]
        b, t = input_ids.shape
        start = 0 if past is None else past
        logits = torch.zeros(b, t, self.vocab)
        for i in range(t):
            nxt = start + i + 1
            if nxt < len(self.sequence):
                logits[:, i, self.sequence[nxt]] = 50.0
        return (logits, start + t) if return_cache else logits


def planned(*parts: str) -> list[int]:
    """Ids of prompt, turn, observation, turn, ...: model turns (odd parts) end in EOS."""
    ids: list[int] = []
    for i, part in enumerate(parts):
        ids += TOK.encode(part) + ([EOS_ID] if i % 2 else [])
    return ids


def runner(model: nn.Module, recorder=None, *, max_turns=2, context_len=32, seed=0):  # type: ignore[no-untyped-def]
    sampler = TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=8),
                               torch.Generator().manual_seed(seed))
    return EpisodeRunner(sampler, TOK, recorder or InMemoryTurnRecorder(), context_len, 8,
                         max_turns, "calculator")


def calc_env(prompt: str = "47*38=", answer: str = "1786") -> CalculatorEnv:
    return CalculatorEnv(Example(prompt, answer), use_tool=True, call_weight=0.2)


def test_a_tool_episode_appends_exact_ids_and_masks_only_model_tokens():
    sequence = planned("47*38=", "47*38", ">1786", "1786")
    (traj,) = runner(OracleLM(sequence, TOK.vocab_size)).run(KEYS[:1], [calc_env()])
    assert traj.input_ids == sequence
    prompt, call, obs, answer = 6, 6, 5, 5  # model turns include their EOS
    assert traj.loss_mask == [False] * prompt + [True] * call + [False] * obs + [True] * answer
    assert [t.reward for t in traj.turns] == [pytest.approx(0.2), pytest.approx(0.8)]
    assert traj.reward == pytest.approx(1.0) and traj.end_reason == "done"
    rewards = traj.token_rewards()
    assert rewards[prompt + call - 1] == pytest.approx(0.2) and rewards[-1] == pytest.approx(0.8)
    assert sum(rewards) == pytest.approx(1.0)
    assert traj.turns[0].info == {"tool": "calculator"}


def test_generator_logprobs_are_the_trainers_on_every_model_token():
    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 1)
    trajs = runner(model).run(KEYS, [calc_env() for _ in KEYS])
    for traj in trajs:
        ids = torch.tensor(traj.input_ids)
        ref = sequence_logprobs(model, ids)
        got = torch.tensor(traj.logprobs)
        mask = torch.tensor(traj.loss_mask)
        assert mask.sum() == sum(t.end - t.start for t in traj.turns)
        torch.testing.assert_close(got[mask], ref[mask], atol=2e-5, rtol=0)
        assert (got[~mask] == 0).all()


def test_observation_token_ids_are_appended_as_given():
    class IdsEnv:
        dedupes_by_key = True

        def reset(self, key):  # type: ignore[no-untyped-def]
            return Observation(token_ids=(5, 6, 7))

        def step(self, action, key):  # type: ignore[no-untyped-def]
            # ids no text encodes to: a PAD, then an EOS inside the observation
            return EnvStep(Observation(token_ids=(0, 1, 9)), 0.5, key.turn >= 2)

    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    (traj,) = runner(model).run(KEYS[:1], [IdsEnv()])
    first = traj.turns[0]
    assert traj.input_ids[:3] == [5, 6, 7]
    assert traj.input_ids[first.obs_start:first.obs_end] == [0, 1, 9]
    assert traj.reward == pytest.approx(1.0)


def test_replay_through_the_recorder_makes_no_call_and_gives_the_same_trajectory():
    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 2)
    recorder = InMemoryTurnRecorder()
    first = runner(model, recorder, seed=0).run(KEYS, [calc_env() for _ in KEYS])
    calls = dict(recorder.calls)
    assert calls["model"] == sum(len(t.turns) for t in first) and calls["reset"] == 4
    # another sampler seed: had anything been regenerated, the ids would differ
    again = runner(model, recorder, seed=99).run(KEYS, [calc_env() for _ in KEYS])
    # no model turn or step made again; each fresh env instance was reset (that is not a call)
    assert recorder.calls == dict(calls, reset=8)
    assert [t.input_ids for t in again] == [t.input_ids for t in first]
    assert [t.reward for t in again] == [t.reward for t in first]


def test_a_replayed_request_that_differs_from_the_record_is_refused():
    recorder = InMemoryTurnRecorder()
    key = KEYS[0].at(1)
    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    sampler = TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=4), torch.Generator())
    recorder.model_turns([TurnRequest(key, (5, 6), 4)], sampler.generate)
    with pytest.raises(ReplayMismatchError, match="run/g0/s0/t1"):
        recorder.model_turns([TurnRequest(key, (5, 7), 4)], sampler.generate)
    outcome = StepOutcome(1.0, True, "done", ())
    call = StepCall(key, Action("12", (3, 4), True), "req-a", run=lambda: outcome)
    assert recorder.env_steps([call]) == [outcome]
    with pytest.raises(ReplayMismatchError, match="different request"):
        recorder.env_steps([replace(call, request="req-b")])


def test_an_env_that_raises_fails_the_group_naming_env_and_step():
    class Broken:
        dedupes_by_key = True

        def reset(self, key):  # type: ignore[no-untyped-def]
            return Observation(text="12*3=")

        def step(self, action, key):  # type: ignore[no-untyped-def]
            raise ConnectionError("tool server unreachable")

    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    with pytest.raises(EnvError, match=r"calculator raised at run/g0/s0/t1: ConnectionError"):
        runner(model).run(KEYS[:1], [Broken()])


def test_an_observation_the_tokenizer_cannot_encode_is_named():
    class Shouting:
        dedupes_by_key = True

        def reset(self, key):  # type: ignore[no-untyped-def]
            return Observation(text="HELLO")

        def step(self, action, key):  # type: ignore[no-untyped-def]
            raise AssertionError("never reached")

    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    with pytest.raises(EnvError, match=r"observation at run/g0/s0/t0 cannot be encoded.*'H'"):
        runner(model).run(KEYS[:1], [Shouting()])


def test_an_episode_stops_when_the_next_observation_would_fill_the_context():
    sequence = planned("47*38=", "47*38", ">1786", "1786")
    (traj,) = runner(OracleLM(sequence, TOK.vocab_size), context_len=16).run(KEYS[:1], [calc_env()])
    assert traj.end_reason == "context" and len(traj.turns) == 1
    assert traj.input_ids == sequence[:12]


def test_per_token_advantages_are_reward_to_go_against_the_group_mean():
    # two samples, two turns each; rewards sit on each turn's last token
    rewards = [[0, 0.2, 0, 0.8], [0, 0.2, 0, 0.0]]
    masks = [[False, True, False, True]] * 2
    adv, zero = per_token_advantages(rewards, masks)
    mean, std = 0.6, 0.4
    assert not zero
    assert adv[0] == pytest.approx([0, (1.0 - mean) / std, 0, (0.8 - mean) / std], abs=1e-5)
    assert adv[1] == pytest.approx([0, (0.2 - mean) / std, 0, (0.0 - mean) / std], abs=1e-5)


def test_single_turn_per_token_advantages_equal_the_per_sample_ones():
    from controller.core.policies import group_advantages

    returns = [0.1, 0.5, 0.9, 0.3]
    rewards = [[0.0, 0.0, r] for r in returns]
    masks = [[False, True, True]] * 4
    adv, _ = per_token_advantages(rewards, masks)
    expected, _ = group_advantages(returns)
    for row, a in zip(adv, expected):
        assert row == [0.0, a, a]


def test_equal_returns_give_exactly_zero_advantages():
    adv, zero = per_token_advantages([[0.0, 0.5]] * 3, [[False, True]] * 3)
    assert zero and adv == [[0.0, 0.0]] * 3


def test_calculator_tasks_register_and_answer_in_the_right_number_of_turns():
    tool, plain = make_task("calculator"), make_task("calculator-notool")
    assert (tool.max_turns, plain.max_turns) == (2, 1)
    examples = tool.examples(4096, seed=0)
    assert examples == plain.examples(4096, seed=0)  # the same questions, with or without
    assert {e.prompt[1] for e in examples} == {"+", "-", "*"}
    for e in examples:
        assert e.answer == str(eval(e.prompt.rstrip("="))) and len(e.answer) == 2
        assert e.prompt[0].isdigit() and e.prompt[2].isdigit() and len(e.prompt) == 4
    # every one-digit question with a two-character result: 58 products of 10 or more
    # (81 less the 23 under 10), 45 sums of 10 or more and 36 differences below 0
    distinct = {e.prompt: e for e in examples}.values()
    assert sorted(Counter(e.prompt[1] for e in distinct).items()) == [("*", 58), ("+", 45), ("-", 36)]
    ex = examples[0]
    assert plain.reward(ex, ex.answer, True) == pytest.approx(1.0)
    # with the tool, a first-turn answer is no call: it earns nothing for the answer
    assert tool.reward(ex, ex.answer, True) < 0.2
    wide = make_task("calculator", digits=2, result_len=0).examples(200, seed=0)
    assert {len(e.answer) for e in wide} >= {3, 4} and all(len(e.prompt) == 6 for e in wide)


def test_a_calculator_result_length_that_cannot_occur_is_refused_by_name():
    with pytest.raises(ValueError, match=r"result_len = 2 is impossible with digits = 2 and "
                                         r"ops '\*' \(results have \[3, 4\] characters\)"):
        make_task("calculator", digits=2, ops="*")


def test_a_calculator_turn_with_tokens_that_are_not_text_earns_nothing():
    env = calc_env("7*8=", "56")
    env.reset(KEYS[0])
    call = env.step(Action("7*8", tuple(TOK.encode("7*8")) + (EOS_ID,), True), KEYS[0].at(1))
    assert call.observation.text == ">56" and call.reward == pytest.approx(0.2)
    # "56" then padding: decoding drops the padding, so the text alone looks right
    padded = tuple(TOK.encode("56")) + (TOK.pad_id, TOK.pad_id)
    assert TOK.decode(list(padded)) == "56"
    step = env.step(Action("56", padded, False), KEYS[0].at(2))
    assert step.done and step.reward == 0.0
    assert step.info["error"] == "the turn holds 2 token(s) that are not text"
    clean = calc_env("7*8=", "56")
    clean.reset(KEYS[0])
    clean.step(Action("7*8", tuple(TOK.encode("7*8")) + (EOS_ID,), True), KEYS[0].at(1))
    answer = clean.step(Action("56", tuple(TOK.encode("56")) + (EOS_ID,), True), KEYS[0].at(2))
    assert answer.reward == pytest.approx(0.8)


def test_calculator_call_that_does_not_parse_ends_the_episode_naming_why():
    env = calc_env()
    env.reset(KEYS[0])
    step = env.step(Action("47*", (), True), KEYS[0].at(1))
    assert step.done and step.observation.text == ""
    assert "calculator call '47*' does not parse" in step.info["error"]
    assert 0 < step.reward < 0.2  # partial credit: two characters of the call in place


def test_calculator_answer_after_a_call_that_computed_something_else_earns_nothing():
    env = calc_env()
    env.reset(KEYS[0])
    wrong = env.step(Action("47*39", (), True), KEYS[0].at(1))
    assert wrong.observation.text == ">1833" and not wrong.done
    final = env.step(Action("1833", (), True), KEYS[0].at(2))
    assert final.done and final.reward == 0.0
    assert final.info["error"] == "answered without the right result to read"


def test_sample_takes_one_prompt_per_row_when_they_share_a_length():
    from workers.models.decoder import sample

    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 6)
    rows = [TOK.encode("12+3="), TOK.encode("45*6="), TOK.encode("78-9=")]
    cfg = SamplingSection(max_new_tokens=5)
    out = sample(model, rows, 3, cfg, torch.Generator().manual_seed(0), EOS_ID)
    for prompt, c in zip(rows, out):
        ids = torch.tensor(prompt + c.tokens)
        ref = sequence_logprobs(model, ids)[len(prompt):]
        torch.testing.assert_close(c.logprobs, ref, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="prompts of equal length"):
        sample(model, [TOK.encode("1="), TOK.encode("12=")], 2, cfg, torch.Generator(), EOS_ID)


def test_a_bare_calculator_call_evaluates_the_question_as_asked():
    task = make_task("calculator", call="bare")
    ex = Example("59-15=", "44")
    env = task.make_env(ex)
    env.reset(KEYS[0])
    call = env.step(Action("c", (), True), KEYS[0].at(1))
    assert call.observation.text == ">44" and call.reward == pytest.approx(0.2)
    assert env.step(Action("44", (), True), KEYS[0].at(2)).reward == pytest.approx(0.8)
    with pytest.raises(ValueError, match="call must be 'expression' or 'bare'"):
        make_task("calculator", call="json")


class _Counting:
    """A two-turn env that counts the steps it really makes; ``restores`` adds restore_step."""

    def __init__(self, dedupes: bool = True, drift: float = 0.0) -> None:
        self.dedupes_by_key = dedupes
        self.drift = drift
        self.made: list[StepKey] = []

    def reset(self, key):  # type: ignore[no-untyped-def]
        return Observation(text="12*3=")

    def step(self, action, key):  # type: ignore[no-untyped-def]
        self.made.append(key)
        return EnvStep(Observation(text=">36"), 0.5 + self.drift, key.turn >= 2)


class _Restoring(_Counting):
    def __init__(self, dedupes: bool = False) -> None:
        super().__init__(dedupes)
        self.restored: list[StepKey] = []

    def restore_step(self, action, recorded, key):  # type: ignore[no-untyped-def]
        self.restored.append(key)


def _replay_twice(first_env, second_env):  # type: ignore[no-untyped-def]
    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    recorder = InMemoryTurnRecorder()
    first = runner(model, recorder).run(KEYS[:1], [first_env])
    return first, runner(model, recorder, seed=5).run(KEYS[:1], [second_env])


def test_a_served_step_is_restored_not_made_again_by_an_env_with_restore_step():
    first, again = _replay_twice(_Restoring(), fresh := _Restoring())
    assert fresh.made == [] and fresh.restored == [KEYS[0].at(1), KEYS[0].at(2)]
    assert again[0].input_ids == first[0].input_ids


def test_a_deduping_env_without_restore_step_is_re_issued_its_keys_and_checked():
    _, again = _replay_twice(_Counting(), fresh := _Counting())
    assert fresh.made == [KEYS[0].at(1), KEYS[0].at(2)]  # same keys: deduplicated by the env
    with pytest.raises(EnvError, match=r"not deterministic on replay at run/g0/s0/t1.*reward 0.5"):
        _replay_twice(_Counting(), _Counting(drift=0.25))


def test_an_env_that_can_neither_dedupe_nor_restore_is_refused_naming_why():
    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    with pytest.raises(EnvError, match="dedupes_by_key = False and has no restore_step"):
        runner(model).run(KEYS[:1], [_Counting(dedupes=False)])
