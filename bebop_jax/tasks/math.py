"""Math task: multi-step integer arithmetic with a worked, step-by-step demonstration.

Prompt:         `Compute: (3+5)*2-7\n`
Demonstration:  `=8*2-7\n=16-7\n=9\n<|answer|>9`

Each line of the demonstration reduces exactly one operation: the first innermost
parenthesised group is reduced first, inside it `*` before `+`/`-`, left to right. The reward
is 1 iff the final answer after the answer marker is exactly the value of the expression.
"""

from __future__ import annotations

import dataclasses
import random

from bebop_jax.tasks import base

_Token = int | str  # an int literal or one of "+-*()"


@dataclasses.dataclass(frozen=True)
class MathTask(base.Task):
  """Arithmetic over `min_operands..max_operands` integers in [0, max_value].

  Attributes:
    min_operands: fewest operands in an expression (>= 2).
    max_operands: most operands in an expression.
    max_value: operands are drawn uniformly from [0, max_value].
    operators: the binary operators to draw from, a subset of "+-*".
    paren_prob: probability of wrapping each composite sub-expression in parentheses.
  """
  min_operands: int = 2
  max_operands: int = 3
  max_value: int = 6
  operators: str = "+-*"
  paren_prob: float = 0.4

  name = "math"

  def __post_init__(self):
    if not 2 <= self.min_operands <= self.max_operands <= 16:
      raise ValueError("math: need 2 <= min_operands <= max_operands <= 16, got "
                       f"{self.min_operands}, {self.max_operands}")
    if not 1 <= self.max_value <= 999:
      raise ValueError(f"math: max_value must be in [1, 999], got {self.max_value}")
    if not self.operators or set(self.operators) - set("+-*"):
      raise ValueError(f"math: operators must be a non-empty subset of '+-*', "
                       f"got {self.operators!r}")
    if not 0.0 <= self.paren_prob <= 1.0:
      raise ValueError(f"math: paren_prob must be in [0, 1], got {self.paren_prob}")

  def sample(self, seed: int) -> base.Example:
    rng = random.Random(f"math/{seed}")
    n = rng.randint(self.min_operands, self.max_operands)
    tokens = self._random_expression(rng, n, top=True)
    steps = reduction_steps(tokens)
    answer = steps[-1][0]
    lines = ["=" + render(step) for step in steps]
    demonstration = "\n".join(lines) + "\n" + base.ANSWER_MARKER + str(answer)
    return base.Example(
        task=self.name,
        prompt=f"Compute: {render(tokens)}\n",
        demonstration=demonstration,
        meta={"expression": render(tokens), "answer": answer})

  def reward(self, example: base.Example, completion: str) -> float:
    try:
      answer = base.parse_int(base.extract_final_answer(completion))
      return float(answer is not None and answer == example.meta["answer"])
    except Exception:  # pylint: disable=broad-except  # defensive: never raise on model text
      return 0.0

  def _random_expression(self, rng: random.Random, n: int, top: bool) -> list[_Token]:
    if n == 1:
      return [rng.randint(0, self.max_value)]
    left = rng.randint(1, n - 1)
    op = rng.choice(self.operators)
    tokens = (self._random_expression(rng, left, False) + [op] +
              self._random_expression(rng, n - left, False))
    if not top and rng.random() < self.paren_prob:
      tokens = ["("] + tokens + [")"]
    return tokens


def render(tokens: list[_Token]) -> str:
  """The text of a token list, e.g. [8, "*", 2] -> "8*2" (negative ints keep their sign)."""
  return "".join(str(t) for t in tokens)


def _apply(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b


def _reduce_once(tokens: list[_Token]) -> list[_Token]:
  """Performs exactly one operation (see module docstring) and returns the new token list."""
  # The first innermost parenthesised group, or the whole expression.
  lo, hi = 0, len(tokens)
  for i, t in enumerate(tokens):
    if t == "(":
      lo = i + 1
    elif t == ")":
      hi = i
      break
  else:
    lo = 0
  body = tokens[lo:hi]
  if len(body) == 1:  # "(7)" -> "7"
    return tokens[:lo - 1] + body + tokens[hi + 1:]
  ops = [j for j in range(1, len(body), 2)]
  mul = [j for j in ops if body[j] == "*"]
  j = mul[0] if mul else ops[0]
  value = _apply(body[j - 1], body[j], body[j + 1])
  body = body[:j - 1] + [value] + body[j + 2:]
  if len(body) == 1 and lo > 0:  # the group is done: drop its parentheses
    return tokens[:lo - 1] + body + tokens[hi + 1:]
  return tokens[:lo] + body + tokens[hi:]


def reduction_steps(tokens: list[_Token]) -> list[list[_Token]]:
  """All intermediate expressions, one operation apart, ending with [value]."""
  steps = []
  while len(tokens) > 1:
    tokens = _reduce_once(tokens)
    steps.append(tokens)
  return steps or [tokens]
