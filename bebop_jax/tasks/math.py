"""Math task: multi-step integer arithmetic with a worked, step-by-step demonstration.

Prompt:         `Compute: (3+5)*2-7\n`
Demonstration:  `=8*2-7\n=16-7\n=9\n<|answer|>9`

Each line of the demonstration reduces exactly one operation. The canonical demonstration
(`Example.demonstration`) reduces the first innermost parenthesised group first, inside it
`*` before `+`/`-`, left to right. `task.demonstration(example, seed)` samples one of many
valid solution paths: with probability `diversity` at each step it reduces any operation
that precedence allows (any innermost group; a `*` between two numbers; a `+`/`-` whose
neighbours are not `*` and which follows no `-`). With probability `restate` it restates the
expression first (commuting the operands of such operations at random), and with
probability `spacing` the whole path writes spaces around the operators. The reward is 1
iff the final answer after the answer marker is exactly the value of the expression,
whatever the path.
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
    diversity: how often `demonstration` leaves the canonical path (0 = never; see the
      module docstring).
    restate: probability that a sampled demonstration first restates the expression with
      commuted operands.
    spacing: probability that a sampled demonstration writes spaces around its operators
      (one style for the whole path).
  """
  min_operands: int = 2
  max_operands: int = 3
  max_value: int = 6
  operators: str = "+-*"
  paren_prob: float = 0.4
  diversity: float = 0.0
  restate: float = 0.0
  spacing: float = 0.0

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
    for knob in ("diversity", "restate", "spacing"):
      if not 0.0 <= getattr(self, knob) <= 1.0:
        raise ValueError(f"math: {knob} must be in [0, 1], got {getattr(self, knob)}")

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

  def demonstration(self, example: base.Example, seed: int) -> str:
    """One valid solution path of `example` (the canonical one with diversity 0)."""
    if self.diversity <= 0 and self.restate <= 0 and self.spacing <= 0:
      return example.demonstration
    rng = random.Random(f"math-demo/{seed}")
    tokens = parse_tokens(example.meta["expression"])
    lines = []
    if rng.random() < self.restate:  # restate, commuting operands at random
      for j in reducible_ops(tokens):
        if tokens[j] in "+*" and rng.random() < 0.5:
          tokens = tokens[:j - 1] + [tokens[j + 1], tokens[j], tokens[j - 1]] + tokens[j + 2:]
      lines.append(tokens)
    while len(tokens) > 1:
      if rng.random() < self.diversity:
        tokens = reduce_at(tokens, rng.choice(reducible_ops(tokens)))
      else:
        tokens = _reduce_once(tokens)
      lines.append(tokens)
    spaced = rng.random() < self.spacing  # one spacing style for the whole path
    text = "\n".join("=" + "".join(f" {t} " if spaced and t in ("+", "-", "*") else str(t)
                                    for t in line) for line in lines)
    return text + "\n" + base.ANSWER_MARKER + str(example.meta["answer"])

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


def parse_tokens(text: str) -> list[_Token]:
  """The token list of an expression text (inverse of `render`; '-' after an operator, '('
  or at the start is a sign)."""
  tokens: list[_Token] = []
  i = 0
  text = text.replace(" ", "")
  while i < len(text):
    ch = text[i]
    signed = ch == "-" and (not tokens or tokens[-1] in ("+", "-", "*", "("))
    if ch.isdigit() or signed:
      j = i + 1
      while j < len(text) and text[j].isdigit():
        j += 1
      tokens.append(int(text[i:j]))
      i = j
    else:
      tokens.append(ch)
      i += 1
  return tokens


def reducible_ops(tokens: list[_Token]) -> list[int]:
  """Indices of the operators precedence allows to reduce next: both operands are numbers;
  a `*` always; a `+`/`-` when neither neighbouring operator is `*` and the one before it
  is not `-` (left-to-right subtraction)."""
  out = []
  for j in range(1, len(tokens) - 1):
    op = tokens[j]
    if op not in ("+", "-", "*") or not (isinstance(tokens[j - 1], int) and
                                         isinstance(tokens[j + 1], int)):
      continue
    before = tokens[j - 2] if j >= 2 else None
    after = tokens[j + 2] if j + 2 < len(tokens) else None
    if op == "*" or (before not in ("*", "-") and after != "*"):
      out.append(j)
  return out


def reduce_at(tokens: list[_Token], j: int) -> list[_Token]:
  """Performs the operation at index j; a group left holding one number loses its
  parentheses."""
  value = _apply(tokens[j - 1], tokens[j], tokens[j + 1])
  out = tokens[:j - 1] + [value] + tokens[j + 2:]
  if j >= 2 and out[j - 2] == "(" and j < len(out) and out[j] == ")":
    out = out[:j - 2] + [value] + out[j + 1:]
  return out


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
