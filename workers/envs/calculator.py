"""``calculator``: arithmetic with a calculator tool; ``calculator-notool``: without it.

An episode of ``calculator`` (prompt ``47*38=``)::

    model:  47*38<eos>         a call to the calculator (an expression is a call)
    env:    >1786              the tool's result, appended as observation tokens
    model:  1786<eos>          the answer: the episode ends

Questions are sums, differences and products of two two-digit numbers (``ops``).
Products and most sums are beyond what the tiny model can compute, but copying the
expression into a call and the result into the answer is within its reach (the
``copy`` and ``reverse`` tasks are learnt in minutes). ``calculator-notool`` asks the
same questions with no tool: the model must answer in its first turn.

Rewards, per turn (the episode's return is their sum, in [0, 1]):

* the first turn earns ``call_weight * shaped_match(turn, expression)``, whatever it
  is: without this credit a random model would never find a call worth making (a
  whole expression copied by chance);
* the answer earns ``(1 - call_weight) * shaped_match(answer, result)``, but only after
  a call that computed the right value: answering without the right result to read
  earns nothing (otherwise guesses with common digits pay, the policy settles there,
  and their noise drowns the call's credit). Without the tool the answer earns
  ``shaped_match(answer, result)``. So the tool variant's return reaches 0.8 only with
  answers that are right most of the time.

A first turn that is not a well-formed call ends the episode (``info['error']`` says
why); a second call is taken as the answer.

The operators vary because a constant character in every call (``*``) is the one
thing a random policy matches every time: it learnt to repeat it and collapsed there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workers.envs.base import Action, EnvStep, Observation, StepKey, ToolCallParseError
from workers.envs.task import single_turn_reward
from workers.envs.tools import Calculator, ToolCallFormat
from workers.tasks.base import Example, shaped_match_reward

#: the format the calculator task's model speaks
CALCULATOR_FORMAT = ToolCallFormat(tools=(Calculator(),))
#: the call of ``call = "bare"``: the calculator evaluates the question as asked
BARE_CALL = "c"


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


@dataclass(frozen=True)
class _CalculatorTask:
    """Sums, differences and products of two ``digits``-digit numbers."""

    digits: int = 2
    #: operators drawn from (one per question)
    ops: str = "+-*"
    #: "expression": the call spells out the expression (``47*38``); "bare": the call is
    #: ``c`` and the calculator evaluates the question as asked
    call: str = "expression"
    call_weight: float = 0.2
    use_tool: bool = True
    name = "calculator"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"{self.name}: digits must be in 1..4, got {self.digits}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"{self.name}: ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.call not in ("expression", "bare"):
            raise ValueError(f"{self.name}: call must be 'expression' or 'bare', got {self.call!r}")
        if not 0.0 <= self.call_weight < 1.0:
            raise ValueError(f"{self.name}: call_weight must be in [0, 1), got {self.call_weight}")

    @property
    def max_turns(self) -> int:
        return 2 if self.use_tool else 1

    def examples(self, count: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        tool = CALCULATOR_FORMAT.tools[0]
        out = []
        for _ in range(count):
            expression = f"{rng.randint(lo, hi)}{rng.choice(self.ops)}{rng.randint(lo, hi)}"
            answer = tool.run(tool.parse(expression))
            out.append(Example(prompt=f"{expression}=", answer=answer))
        return out

    def make_env(self, example: Example) -> CalculatorEnv:
        return CalculatorEnv(example, self.use_tool, self.call_weight if self.use_tool else 0.0,
                             bare_call=self.call == "bare")

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        return single_turn_reward(self, example, completion, stopped)


@dataclass(frozen=True)
class CalculatorTask(_CalculatorTask):
    """Multiply with a calculator tool (two turns: call, answer)."""


@dataclass(frozen=True)
class CalculatorNoToolTask(_CalculatorTask):
    """The same products, answered in one turn without a tool."""

    use_tool: bool = False
    name = "calculator-notool"
