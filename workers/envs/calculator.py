"""``calculator``: arithmetic with a calculator tool; ``calculator-notool``: without it.

An episode of ``calculator`` (prompt ``7*8=``)::

    model:  7*8<eos>           a call to the calculator (an expression is a call)
    env:    >56                the tool's result, appended as observation tokens
    model:  56<eos>            the answer: the episode ends

Questions are sums, differences and products (``ops``) of two ``digits``-digit numbers
whose result has ``result_len`` characters: by default one-digit operands and results
of two characters (``7*8`` -> ``56``, ``9+5`` -> ``14``, ``2-7`` -> ``-5``), 139
questions. With the tool the model copies the question into the call and the result
into the answer; without it (``calculator-notool``, the same questions answered in one
turn) it must know the 139 results by heart. Copying is what the tiny model learns from
random weights in a few hundred steps; the results by heart it learns far more slowly
(docs/learning.md has the measurements). The fixed result length puts the answer's characters at fixed places
after the result, which is what made copying them learnable.

Rewards, per turn (the episode's return is their sum, in [0, 1]):

* the first turn earns ``call_weight * shaped_match(turn, expression)``, whatever it
  is: without this credit a random model would never find a call worth making;
* the answer earns ``(1 - call_weight) * shaped_match(answer, result)``, but only after
  a call that computed the right value: answering without the right result to read
  earns nothing (otherwise guesses with common digits pay, the policy settles there,
  and their noise drowns the call's credit). Without the tool the answer earns
  ``shaped_match(answer, result)``;
* a turn holding tokens that are not text (padding, which decoding drops) earns nothing
  and ends the episode: with an entropy bonus the policy learnt to end its answer with
  invisible padding instead of EOS, which the text alone cannot tell from a clean stop.

A first turn that is not a well-formed call ends the episode (``info['error']`` says
why); a second call is taken as the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from workers.envs.base import Action, EnvStep, Observation, StepKey, ToolCallParseError
from workers.envs.task import single_turn_reward
from workers.envs.tools import Calculator, ToolCallFormat
from workers.tasks.base import Example, shaped_match_reward

#: the format the calculator task's model speaks
CALCULATOR_FORMAT = ToolCallFormat(tools=(Calculator(),))
#: the call of ``call = "bare"``: the calculator evaluates the question as asked
BARE_CALL = "c"
#: every character a calculator episode uses (either call form): what the tiny model's
#: tokenizer needs
CALCULATOR_ALPHABET = "0123456789+-*=>" + BARE_CALL


@dataclass
class CalculatorEnv:
    """One episode: the call turn (with the tool), then the answer."""

    example: Example
    use_tool: bool
    call_weight: float
    #: the call is BARE_CALL, asking the question as it stands (else the expression)
    bare_call: bool = False
    #: the calculator is pure: re-running a call has no side effect to repeat
    dedupes_by_key: bool = True

    def reset(self, key: StepKey) -> Observation:
        self._steps = 0
        self._right_result_shown = False
        return Observation(text=self.example.prompt)

    def step(self, action: Action, key: StepKey) -> EnvStep:
        self._steps += 1
        hidden = _hidden_tokens(action)
        if hidden:
            return EnvStep(Observation(text=""), 0.0, True,
                           {"error": f"the turn holds {hidden} token(s) that are not text"})
        if self.use_tool and self._steps == 1:
            return self._call(action)
        if self.use_tool and not self._right_result_shown:
            # the task is to consult the calculator: an answer given without the right
            # result to read earns nothing (else guesses with common digits pay, and
            # their noise drowns the credit for getting the call right)
            return EnvStep(Observation(text=""), 0.0, True,
                           {"error": "answered without the right result to read"})
        weight = 1.0 - self.call_weight if self.use_tool else 1.0
        score = shaped_match_reward(action.text, self.example.answer, action.stopped)
        return EnvStep(Observation(text=""), weight * score, True, {})

    def _call(self, action: Action) -> EnvStep:
        """The first turn: credit for its likeness to the right call, then the result."""
        tool = CALCULATOR_FORMAT.tools[0]
        question = self.example.prompt.rstrip("=")
        right_call = BARE_CALL if self.bare_call else question
        reward = self.call_weight * shaped_match_reward(action.text, right_call, action.stopped)
        expression, error = self._expression(action.text, question)
        if expression is None:
            # no result to read, so nothing to answer from: the episode ends here (its
            # turns after a failed call would only add tokens whose credit is noise)
            return EnvStep(Observation(text=""), reward, True, {"error": error})
        result = tool.run({"expression": expression})
        self._right_result_shown = result == self.example.answer
        return EnvStep(Observation(text=CALCULATOR_FORMAT.render_result(result)), reward, False,
                       {"tool": tool.name})

    def _expression(self, text: str, question: str) -> tuple[str | None, str]:
        """What the call asks the calculator, or None and why it is not a call."""
        if self.bare_call:
            if text == BARE_CALL:
                return question, ""
            return None, f"calculator call {text!r} is not {BARE_CALL!r} (the question as asked)"
        try:
            call = CALCULATOR_FORMAT.parse(text)
            Calculator().parse(text)  # the tool's own words for what is wrong, if anything
        except ToolCallParseError as err:
            return None, str(err)
        assert call is not None
        return str(call.arguments["expression"]), ""


def _hidden_tokens(action: Action) -> int:
    """How many of the turn's ids decode to no text (EOS aside): with a character-level
    tokenizer every id but padding is one character. Where ids are unknown (scoring a
    bare completion) or a token spans several characters, this reads 0."""
    ids = len(action.token_ids) - int(action.stopped)
    return max(0, ids - len(action.text))


def _lengths(first: int, last: int) -> set[int]:
    """The lengths of the integers in [first, last], written in decimal."""
    out: set[int] = set()
    if last >= 0:
        out |= set(range(len(str(max(first, 0))), len(str(last)) + 1))
    if first < 0:
        out |= set(range(len(str(min(last, -1))), len(str(first)) + 1))
    return out


@dataclass(frozen=True)
class _CalculatorTask:
    """Sums, differences and products of two ``digits``-digit numbers."""

    digits: int = 1
    #: operators drawn from (one per question)
    ops: str = "+-*"
    #: only questions whose result has this many characters (0: any); the default two
    #: keeps the answer at a fixed place, see the module docstring
    result_len: int = 2
    #: "expression": the call spells out the expression (``7*8``); "bare": the call is
    #: ``c`` and the calculator evaluates the question as asked
    call: str = "expression"
    call_weight: float = 0.2
    use_tool: bool = True
    name = "calculator"

    #: what a run of this task uses unless its config says otherwise
    #: (``workers.tasks.config.with_task_defaults``): a tokenizer that knows only the
    #: task's characters (16 symbols to copy among, not 48), and an entropy bonus that
    #: keeps a group's samples apart (the earlier probes collapsed onto one constant
    #: answer, after which every sample scores alike and nothing is learnt); the
    #: measurements with them are in docs/learning.md
    run_defaults: ClassVar[dict[str, Any]] = {
        "model": {"alphabet": CALCULATOR_ALPHABET},
        "train": {"loss": {"entropy_coef": 0.08}},
    }

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"{self.name}: digits must be in 1..4, got {self.digits}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"{self.name}: ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.call not in ("expression", "bare"):
            raise ValueError(f"{self.name}: call must be 'expression' or 'bare', got {self.call!r}")
        if not 0.0 <= self.call_weight < 1.0:
            raise ValueError(f"{self.name}: call_weight must be in [0, 1), got {self.call_weight}")
        lengths = self._result_lengths()
        if self.result_len and self.result_len not in lengths:
            raise ValueError(
                f"{self.name}: result_len = {self.result_len} is impossible with digits = "
                f"{self.digits} and ops {self.ops!r} (results have {sorted(lengths)} characters)"
            )

    def _result_lengths(self) -> set[int]:
        """Every result length the operands and ops can give."""
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        ranges = {"+": (2 * lo, 2 * hi), "-": (lo - hi, hi - lo), "*": (lo * lo, hi * hi)}
        return set().union(*(_lengths(*ranges[op]) for op in self.ops))

    @property
    def max_turns(self) -> int:
        return 2 if self.use_tool else 1

    def examples(self, count: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        tool = CALCULATOR_FORMAT.tools[0]
        out: list[Example] = []
        while len(out) < count:  # terminates: __post_init__ checked result_len occurs
            expression = f"{rng.randint(lo, hi)}{rng.choice(self.ops)}{rng.randint(lo, hi)}"
            answer = tool.run(tool.parse(expression))
            if not self.result_len or len(answer) == self.result_len:
                out.append(Example(prompt=f"{expression}=", answer=answer))
        return out

    def make_env(self, example: Example) -> CalculatorEnv:
        return CalculatorEnv(example, self.use_tool, self.call_weight if self.use_tool else 0.0,
                             bare_call=self.call == "bare")

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        return single_turn_reward(self, example, completion, stopped)


@dataclass(frozen=True)
class CalculatorTask(_CalculatorTask):
    """Arithmetic with a calculator tool (two turns: call, answer)."""


@dataclass(frozen=True)
class CalculatorNoToolTask(_CalculatorTask):
    """The same questions, answered in one turn without a tool."""

    use_tool: bool = False
    name = "calculator-notool"
