"""Adapters for real packages: reasoning-gym datasets and TextArena games.

Both packages are the real ones (the ``envs`` extra); nothing is downloaded: reasoning-gym
generates and scores its problems locally, and TextArena's single-player games run in
process.
"""

from __future__ import annotations

import string

import pytest
import torch

from workers.envs.base import Action, EnvError, EnvStep, Observation, StepKey, UnknownEnvError
from workers.envs.recorder import InMemoryTurnRecorder, ModelTurn
from workers.envs.runner import EpisodeRunner
from workers.envs.sampler import TorchTurnSampler
from workers.envs.task import EpisodeTask, as_episode_task
from workers.models.config import SamplingSection
from workers.models.tiny import TinyCausalLM, TinyConfig
from workers.models.tokenizer import EOS_ID, CharTokenizer
from workers.tasks import UnknownTaskError, make_task

pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]')")
pytest.importorskip("textarena", reason="the envs extra (pip install -e '.[envs]')")

KEY = StepKey("run", "g", 0, 0)
#: every printable character but the ones no prompt here uses: TextArena's texts fit
WIDE = CharTokenizer("".join(c for c in string.printable if c not in "\r\x0b\x0c"))


# -- reasoning-gym --------------------------------------------------------------------


def test_reasoning_gym_dataset_is_a_task_with_its_own_generator_and_scorer():
    import reasoning_gym

    task = make_task("reasoning-gym/spell_backward", min_word_len=3, max_word_len=3)
    examples = task.examples(5, seed=11)
    direct = reasoning_gym.create_dataset("spell_backward", seed=11, size=5,
                                          min_word_len=3, max_word_len=3)
    assert [e.prompt for e in examples] == [direct[i]["question"] for i in range(5)]
    assert [e.answer for e in examples] == [direct[i]["answer"] for i in range(5)]
    ex = examples[0]
    assert task.reward(ex, ex.answer, True) == 1.0
    # the dataset's own partial credit: one letter of three in place
    wrong = ex.answer[0] + "##"
    assert task.reward(ex, wrong, True) == pytest.approx(direct.score_answer(wrong, direct[0]))
    assert 0.0 < task.reward(ex, wrong, True) < 1.0


def test_reasoning_gym_answer_tag_format_scores_inside_the_tag():
    task = make_task("reasoning-gym/basic_arithmetic", answer_format="tag")
    ex = task.examples(1, seed=3)[0]
    assert task.reward(ex, f"thinking... <answer>{ex.answer}</answer>", True) == 1.0
    assert task.reward(ex, ex.answer, True) == 0.0  # no tag, no answer


def test_unknown_reasoning_gym_dataset_names_it_and_suggests_one():
    with pytest.raises(UnknownEnvError, match=r"'spel_backward'.*did you mean reasoning-gym/spell_backward"):
        make_task("reasoning-gym/spel_backward")


def test_unknown_reasoning_gym_option_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['word_len'\].*max_word_len"):
        make_task("reasoning-gym/spell_backward", word_len=3)


def test_a_reasoning_gym_task_runs_as_a_one_turn_episode():
    task = as_episode_task(make_task("reasoning-gym/spell_backward", min_word_len=3, max_word_len=3))
    assert isinstance(task, EpisodeTask) and task.max_turns == 1
    ex = task.examples(1, seed=0)[0]
    env = task.make_env(ex)
    assert env.reset(KEY).text == ex.prompt
    step = env.step(Action(ex.answer, (), True), KEY.at(1))
    assert step.done and step.reward == 1.0


def test_unknown_task_family_member_is_a_clear_error_not_a_plugin_lookup():
    with pytest.raises(UnknownTaskError, match="calculater"):
        make_task("calculater")


# -- TextArena ------------------------------------------------------------------------


class BinarySearchAgent:
    """A TurnSampler that plays Guess The Number (1..20) by bisection on the hints."""

    def __init__(self) -> None:
        self.state: dict[int, tuple[int, int, int]] = {}  # sample -> (low, high, last guess)

    def generate(self, requests):  # type: ignore[no-untyped-def]
        out = []
        for r in requests:
            lo, hi, last = self.state.get(r.key.sample, (1, 20, 0))
            if last:
                after_turn = list(r.context)[len(r.context) - r.context[::-1].index(EOS_ID):]
                hint = WIDE.decode(after_turn)  # the game's answer to the last guess
                lo, hi = (last + 1, hi) if "higher" in hint else (lo, last - 1)
            guess = (lo + hi) // 2
            self.state[r.key.sample] = (lo, hi, guess)
            ids = tuple(WIDE.encode(f"[{guess}]")) + (EOS_ID,)
            out.append(ModelTurn(ids, (0.0,) * len(ids), True, 0, 0))
        return out


def test_textarena_guess_the_number_is_won_by_bisection_through_the_runner():
    task = make_task("textarena/GuessTheNumber-v0", max_turns=8)
    examples = task.examples(3, seed=5)
    agent = BinarySearchAgent()
    runner = EpisodeRunner(agent, WIDE, InMemoryTurnRecorder(), 4096, 8, task.max_turns, task.name)
    keys = [StepKey("run", "g", i, 0) for i in range(3)]
    trajs = runner.run(keys, [task.make_env(ex) for ex in examples])
    for traj in trajs:
        assert traj.end_reason == "done" and traj.reward == 1.0
        assert traj.turns[-1].info["reason"].startswith("Congratulations")
        text = WIDE.decode([i for i in traj.input_ids if i != EOS_ID])
        assert "The target number is" in text  # the game's hints were appended


def test_textarena_step_is_answered_once_per_key():
    task = make_task("textarena/GuessTheNumber-v0")
    env = task.make_env(task.examples(1, seed=1)[0])
    env.reset(KEY)
    first = env.step(Action("[10]", (), True), KEY.at(1))
    again = env.step(Action("[10]", (), True), KEY.at(1))  # re-issued with the same key
    assert again is first
    nxt = env.step(Action("[10]", (), True), KEY.at(2))  # a new key is a new move
    assert "already guessed" in nxt.observation.text


def test_a_resumed_textarena_game_is_rebuilt_by_restore_step_without_new_moves():
    task = make_task("textarena/GuessTheNumber-v0", max_turns=8)
    example = task.examples(1, seed=3)[0]
    moves = [Action(f"[{g}]", (), True) for g in (10, 5, 15)]
    played = task.make_env(example)
    played.reset(KEY)
    results = [played.step(m, KEY.at(t)) for t, m in enumerate(moves, start=1)]
    fresh = task.make_env(example)  # after a crash: a new instance, the first two moves restored
    fresh.reset(KEY)
    for t, (move, result) in enumerate(zip(moves[:2], results[:2]), start=1):
        fresh.restore_step(move, result, KEY.at(t))
    assert fresh.step(moves[2], KEY.at(3)) == results[2]
    with pytest.raises(EnvError, match="not deterministic on replay"):
        other = task.make_env(example)
        other.reset(KEY)
        other.restore_step(moves[0], EnvStep(Observation(text=""), 1.0, True), KEY.at(1))


def test_tiny_model_plays_a_textarena_game_with_exact_ids():
    task = make_task("textarena/GuessTheNumber-v0", max_turns=3)
    model = TinyCausalLM(TinyConfig(vocab_size=WIDE.vocab_size, context_len=1024, d_model=32, n_heads=2))
    sampler = TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=6), torch.Generator().manual_seed(0))
    recorder = InMemoryTurnRecorder()
    runner = EpisodeRunner(sampler, WIDE, recorder, 1024, 6, task.max_turns, task.name)
    (traj,) = runner.run([KEY], [task.make_env(task.examples(1, seed=2)[0])])
    # a random model makes invalid moves: the game ends after its second one
    assert len(traj.turns) >= 2 and traj.end_reason in ("max_turns", "done")
    for t in traj.turns:
        recorded = recorder.turns[KEY.at(t.turn)][1]
        assert tuple(traj.input_ids[t.start:t.end]) == recorded.tokens
        assert all(traj.loss_mask[t.start:t.end]) and not any(traj.loss_mask[t.end:t.obs_end])


def test_unknown_or_multiplayer_textarena_games_are_refused_by_name():
    with pytest.raises(UnknownEnvError, match=r"did you mean textarena/GuessTheNumber-v0"):
        make_task("textarena/GuesTheNumber-v0")
    with pytest.raises(EnvError, match=r"textarena/TicTacToe-v0 did not start as a single-player game"):
        make_task("textarena/TicTacToe-v0")
    with pytest.raises(ValueError, match=r"invalid options \{'colour': 1\}"):
        make_task("textarena/GuessTheNumber-v0", colour=1)



def test_the_ledger_tool_makes_a_keyed_call_once_unless_it_says_it_cannot_dedupe(tmp_path):
    from workers.envs.ledger import read_ledger

    path = tmp_path / "ledger.txt"
    for dedupe, lines in ((True, 1), (False, 2)):
        path.unlink(missing_ok=True)
        task = make_task("ledger", path=str(path), turns=2, dedupe=dedupe)
        env = task.make_env(task.examples(1, seed=0)[0])
        assert env.dedupes_by_key is dedupe
        env.reset(KEY)
        first = env.step(Action("x", (1, 2), True), KEY.at(1))
        again = env.step(Action("x", (1, 2), True), KEY.at(1))  # the same key, re-issued
        assert [k for k, _ in read_ledger(path)] == [str(KEY.at(1))] * lines
        assert (first == again) is dedupe and first.reward == 2 / 4 and not first.done
    with pytest.raises(ValueError, match="task.options.path"):
        make_task("ledger")


def test_a_textarena_game_plays_on_its_own_random_state():
    """2048 spawns a tile from the global ``random`` on every move: games stepped in turn
    in one process (a group), or a game resumed alone, must still be functions of their
    seed and moves, or a resumed game goes on from another board than its log's."""
    import random

    task = make_task("textarena/2048-v0", max_turns=8)
    example = task.examples(1, seed=4)[0]
    moves = [Action(m, (), True) for m in ("[up]", "[left]", "[down]", "[right]")]
    alone = task.make_env(example)
    alone.reset(KEY)
    expected = [alone.step(m, KEY.at(t)) for t, m in enumerate(moves, start=1)]
    played, other = task.make_env(example), task.make_env(task.examples(1, seed=9)[0])
    played.reset(KEY)
    other.reset(KEY.at(0))
    results = []
    for t, move in enumerate(moves, start=1):
        random.random()  # anything else in the process that draws
        other.step(move, StepKey("run", "g", 1, t))
        results.append(played.step(move, KEY.at(t)))
    assert results == expected
    resumed = task.make_env(example)  # after a crash: the first three moves restored
    resumed.reset(KEY)
    for t, (move, result) in enumerate(zip(moves[:3], expected[:3]), start=1):
        random.random()
        resumed.restore_step(move, result, KEY.at(t))
    assert resumed.step(moves[3], KEY.at(4)) == expected[3]


def test_a_game_that_echoes_moves_out_of_order_is_shown_its_board():
    # textarena 0.7.4's Countdown passes add_observation its arguments out of order (the
    # task refuses it for its malformed-move path, below; its valid moves show the fix)
    from workers.envs.textarena import TextArenaEnv

    env = TextArenaEnv("Countdown-v0", 5)
    first = env.reset(KEY).text
    assert first is not None and "[0 2 *]" in first
    step = env.step(Action("[0 1 +]", (), True), KEY.at(1))
    assert not step.done and "Move history:\n  1. " in (step.observation.text or "")
    assert not (step.observation.text or "").startswith("[0 1 +]")  # its own move: not repeated


def test_a_word_game_that_would_download_at_run_time_is_refused_at_load(monkeypatch, tmp_path):
    nltk = pytest.importorskip("nltk")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # no nltk data installed
    with pytest.raises(UnknownEnvError, match=r"textarena/Hangman-v0 needs nltk data \['words'\], "
                       r"which TextArena would download at run time; install it first"):
        make_task("textarena/Hangman-v0")


def test_a_game_that_cannot_start_with_its_options_says_so_not_that_it_needs_players():
    with pytest.raises(EnvError, match=r"textarena/GuessTheNumber-v0 could not start with options "
                       r"\{'min_number': 30, 'max_number': 5\}: ValueError: empty range"):
        make_task("textarena/GuessTheNumber-v0", min_number=30, max_number=5)


def test_a_game_that_raises_on_a_malformed_move_is_refused_at_load():
    # textarena 0.7.4's Slitherlink passes set_invalid_move its arguments out of order:
    # the game ended by malformed moves gives its reason as its reward
    with pytest.raises(EnvError, match=r"textarena/Slitherlink-v0 fails when malformed moves end it "
                       r"\(textarena/Slitherlink-v0 returned reward 'Bad action format"):
        make_task("textarena/Slitherlink-v0")


def test_reasoning_gym_questions_do_not_depend_on_the_process_hash_seed():
    """isomorphic_strings draws from sets of strings: in processes with other hash seeds
    (each generator, a resumed run) one prompt index would be another question."""
    import os
    import subprocess
    import sys

    code = ("from workers.envs.reasoning_gym import ReasoningGymTask; "
            "print([(e.prompt, e.answer) for e in ReasoningGymTask('isomorphic_strings')"
            ".examples(4, 11)])")
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2", "0")
    ]
    assert runs[0] == runs[1] == runs[2] and "isomorphic" in runs[0]


def test_a_dataset_that_prints_while_it_makes_questions_still_gives_them():
    # bf prints while it generates: the child's output must not mix into its questions
    from workers.envs.reasoning_gym import ReasoningGymTask

    (example,) = ReasoningGymTask("bf").examples(1, 3)
    assert example.prompt and example.answer


class _Guesses:
    """A sampler that plays the same guesses in every game (``[10]``, then ``[5]``, ...)."""

    def __init__(self, *guesses: int) -> None:
        self.turns = [tuple(WIDE.encode(f"[{g}]")) + (EOS_ID,) for g in guesses]

    def generate(self, requests):  # type: ignore[no-untyped-def]
        return [ModelTurn(self.turns[r.key.turn - 1], (0.0,) * len(self.turns[r.key.turn - 1]),
                          True, 0, 0) for r in requests]


def test_a_textarena_replay_that_reaches_another_state_is_caught_though_done_agrees():
    """Seed 3's number is below 10, seed 5's above: the same move '[10]' answers 'lower'
    in one game and 'higher' in the other, and neither game ends. A replay whose game
    went elsewhere (the package changed its draws, say) must fail the episode at that
    step, not go on training on a context the game never showed."""
    task = make_task("textarena/GuessTheNumber-v0", max_turns=8)
    game, elsewhere = (task.make_env(task.examples(1, seed=s)[0]) for s in (3, 5))
    move = Action("[10]", (), True)
    game.reset(KEY)
    recorded = game.step(move, KEY.at(1))
    elsewhere.reset(KEY)
    assert not recorded.done and "lower" in recorded.observation.text
    with pytest.raises(EnvError, match=r"not deterministic on replay at run/g/s0/t1: the log "
                                       r"recorded .*lower.*the re-applied move gave .*higher"):
        elsewhere.restore_step(move, recorded, KEY.at(1))


def test_the_runner_catches_a_restored_textarena_game_whose_observation_differs():
    """Through the runner, as after a crash: the log holds the step's observation as ids
    only, and the re-applied move's observation is checked against them."""
    task = make_task("textarena/GuessTheNumber-v0", max_turns=3)
    recorder = InMemoryTurnRecorder()

    def play(seed: int) -> list:  # type: ignore[type-arg]
        runner = EpisodeRunner(_Guesses(10, 5, 7), WIDE, recorder, 1024, 6, task.max_turns,
                               task.name)
        return runner.run([KEY], [task.make_env(task.examples(1, seed=seed)[0])])

    (first,) = play(3)
    (again,) = play(3)  # the same game restored from the record: no complaint
    assert again.input_ids == first.input_ids
    with pytest.raises(EnvError, match=r"textarena/GuessTheNumber-v0 is not deterministic on "
                                       r"replay at run/g/s0/t1"):
        play(5)
