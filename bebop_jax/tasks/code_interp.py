"""The interpreter of the code task's language (`bebop_jax.tasks.code_lang`): runs a parsed
program on a list of ints under a step budget, and never raises.

Semantics: `//` and `%` floor like Python's; division or modulo by zero, a value outside
[-max_int, max_int], max/min of an empty list and exceeding the step budget are runtime
failures. `until` may loop forever; the step budget stops it.

Bounds (module constants, overridable per call): evaluation steps per run (MAX_STEPS),
input list length (MAX_LIST_LEN; no stage lengthens a list), integer magnitude
(code_lang.MAX_INT: every arithmetic result is checked, so operands never exceed max_int).
A step is one expression node evaluated, one stage started, or one list element touched by
a whole-list stage. The interpreter walks the tree; no Python eval/exec/compile is used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from bebop_jax.tasks.code_lang import (MAX_INT, BinOp, BoolOp, Compare, Drop, Expr, Filter,
                                       Fold, Map, Neg, Not, Num, ParseError, Program, Reduce,
                                       Rev, Sort, Stage, Take, Until, Value, Var,
                                       parse_program)

# Bounds.
MAX_STEPS = 20_000
MAX_LIST_LEN = 64

# Run statuses.
OK = "ok"
ERROR = "error"
STEP_LIMIT = "step_limit"
PARSE_ERROR = "parse_error"


@dataclasses.dataclass(frozen=True)
class RunResult:
  """The outcome of one run; produced for every input, never raised.

  Attributes:
    status: OK, ERROR (runtime failure or invalid input), STEP_LIMIT or PARSE_ERROR.
    value: the output (list of ints, or an int after a reducer) when status is OK.
    steps: steps used; equals the step bound exactly when status is STEP_LIMIT.
    error: a short description of the failure ("" when OK).
    trace: when requested, the value after each completed stage.
  """
  status: str
  value: Value | None = None
  steps: int = 0
  error: str = ""
  trace: tuple[Value, ...] = ()

  @property
  def ok(self) -> bool:
    return self.status == OK


class _Failure(Exception):
  """A runtime error of the program (the test case fails)."""


class _StepLimit(Exception):
  """The step budget is exhausted."""


class _Machine:
  """Evaluates stages and expressions under a step budget and an integer bound."""

  def __init__(self, max_steps: int, max_int: int):
    self.steps = 0
    self._max_steps = max_steps
    self._max_int = max_int
    self._eval_fns: dict[type, Callable[[Any, int, int], Any]] = {
        Num: self._num, Var: self._var, Neg: self._neg, BinOp: self._binop,
        Compare: self._compare, BoolOp: self._boolop, Not: self._not, Until: self._until}

  def tick(self, n: int = 1) -> None:
    """Charges `n` steps; raises _StepLimit (leaving steps at the bound) past the budget."""
    self.steps += n
    if self.steps > self._max_steps:
      self.steps = self._max_steps
      raise _StepLimit()

  def check(self, v: int) -> int:
    """Returns `v`; raises _Failure if |v| exceeds max_int."""
    if v > self._max_int or v < -self._max_int:
      raise _Failure("integer overflow")
    return v

  # Expressions: evaluate(node, x, a) returns an int or a bool.

  def evaluate(self, node: Expr, x: int, a: int) -> Any:
    self.tick()
    return self._eval_fns[type(node)](node, x, a)

  def _num(self, node: Num, x: int, a: int) -> int:
    return self.check(node.value)

  def _var(self, node: Var, x: int, a: int) -> int:
    return x if node.name == "x" else a

  def _neg(self, node: Neg, x: int, a: int) -> int:
    return self.check(-self.evaluate(node.operand, x, a))

  def _binop(self, node: BinOp, x: int, a: int) -> int:
    left = self.evaluate(node.left, x, a)
    right = self.evaluate(node.right, x, a)
    op = node.op
    if op == "+":
      return self.check(left + right)
    if op == "-":
      return self.check(left - right)
    if op == "*":
      return self.check(left * right)  # |operands| <= max_int: a small product.
    if right == 0:
      raise _Failure("division by zero" if op == "//" else "modulo by zero")
    return self.check(left // right if op == "//" else left % right)

  def _compare(self, node: Compare, x: int, a: int) -> bool:
    left = self.evaluate(node.left, x, a)
    right = self.evaluate(node.right, x, a)
    op = node.op
    if op == "<":
      return left < right
    if op == ">":
      return left > right
    if op == "<=":
      return left <= right
    if op == ">=":
      return left >= right
    if op == "==":
      return left == right
    return left != right

  def _boolop(self, node: BoolOp, x: int, a: int) -> bool:
    left = self.evaluate(node.left, x, a)
    if node.op == "and":
      return left and self.evaluate(node.right, x, a)
    return left or self.evaluate(node.right, x, a)

  def _not(self, node: Not, x: int, a: int) -> bool:
    return not self.evaluate(node.operand, x, a)

  def _until(self, node: Until, x: int, a: int) -> int:
    # Every iteration evaluates at least one node, so the step budget bounds the loop.
    while not self.evaluate(node.cond, x, a):
      x = self.evaluate(node.body, x, a)
    return x

  # Stages.

  def run_stage(self, stage: Stage, xs: list[int]) -> Value:
    """Returns the stage applied to `xs` (a list, or an int for a reducer)."""
    self.tick()
    if isinstance(stage, Map):
      return [self.evaluate(stage.expr, v, 0) for v in xs]
    if isinstance(stage, Filter):
      return [v for v in xs if self.evaluate(stage.cond, v, 0)]
    if isinstance(stage, Fold):
      acc = self.evaluate(stage.init, 0, 0)
      for v in xs:
        acc = self.evaluate(stage.step, v, acc)
      return acc
    self.tick(len(xs))  # whole-list stages: one step per element
    if isinstance(stage, Sort):
      return sorted(xs)
    if isinstance(stage, Rev):
      return xs[::-1]
    if isinstance(stage, Take):
      return xs[:stage.n]
    if isinstance(stage, Drop):
      return xs[stage.n:]
    if isinstance(stage, Reduce):
      return self._reduce(stage.op, xs)
    raise _Failure(f"not a stage: {type(stage).__name__}")

  def _reduce(self, op: str, xs: list[int]) -> int:
    if op == "len":
      return len(xs)
    if op == "sum":
      total = 0
      for v in xs:
        total = self.check(total + v)
      return total
    if not xs:
      raise _Failure(f"{op} of an empty list")
    return max(xs) if op == "max" else min(xs)


def _validate_inputs(inputs: Any, max_list_len: int, max_int: int) -> list[int]:
  """Returns `inputs` as a fresh list of ints; raises _Failure if it is out of bounds."""
  if not isinstance(inputs, (list, tuple)):
    raise _Failure("input must be a list of ints")
  if len(inputs) > max_list_len:
    raise _Failure(f"input longer than {max_list_len}")
  for v in inputs:
    if not isinstance(v, int) or isinstance(v, bool) or not -max_int <= v <= max_int:
      raise _Failure("input elements must be ints within bounds")
  return [int(v) for v in inputs]


def run_program(program: Program, inputs: Any, *, max_steps: int = MAX_STEPS,
                max_list_len: int = MAX_LIST_LEN, max_int: int = MAX_INT,
                record_trace: bool = False) -> RunResult:
  """Returns the RunResult of `program` on the list `inputs`; never raises.

  Work is O(max_steps): every expression node, stage and whole-list element is a step.
  """
  try:
    value: Value = _validate_inputs(inputs, max_list_len, max_int)
  except _Failure as e:
    return RunResult(ERROR, error=str(e))
  machine = _Machine(max_steps, max_int)
  trace: list[Value] = []
  try:
    for stage in program.stages:
      if not isinstance(value, list):
        raise _Failure("a reducer must end the pipeline")
      value = machine.run_stage(stage, value)
      if record_trace:
        trace.append(value)
  except _Failure as e:
    return RunResult(ERROR, steps=machine.steps, error=str(e), trace=tuple(trace))
  except _StepLimit:
    return RunResult(STEP_LIMIT, steps=machine.steps, error="step limit reached",
                     trace=tuple(trace))
  except Exception as e:  # pylint: disable=broad-except  # defensive: hand-built trees
    return RunResult(ERROR, steps=machine.steps, error=f"internal: {type(e).__name__}",
                     trace=tuple(trace))
  return RunResult(OK, value=value, steps=machine.steps, trace=tuple(trace))


def run_source(source: Any, inputs: Any, *, max_steps: int = MAX_STEPS,
               max_list_len: int = MAX_LIST_LEN, max_int: int = MAX_INT,
               record_trace: bool = False) -> RunResult:
  """Returns the RunResult of parsing and running `source` on `inputs`; never raises.

  A source that does not parse gives status PARSE_ERROR.
  """
  try:
    program = parse_program(source, max_int=max_int)
  except ParseError as e:
    return RunResult(PARSE_ERROR, error=str(e))
  return run_program(program, inputs, max_steps=max_steps, max_list_len=max_list_len,
                     max_int=max_int, record_trace=record_trace)
