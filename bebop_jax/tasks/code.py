"""Code task: synthesise a list-processing program from input/output examples.

The language (pipelines like `map(x*2+1) | filter(x%3!=0) | sort | take(3)`) is defined in
`bebop_jax.tasks.code_lang` and run by `bebop_jax.tasks.code_interp`. Each example hides a
random program; the prompt shows a few of its input -> output pairs, and the reward runs the
policy's program on held-out inputs.

Prompt:         `[3,1,2] -> [2,4,6]\n[5,0,7] -> [0,10,14]\n[1,1,4] -> [2,2,8]\nprogram:\n`
Demonstration:  `[3,1,2] map(x*2) -> [6,2,4] | sort -> [2,4,6]\n<|answer|>map(x*2) | sort`

The canonical demonstration traces the program stage by stage on the first shown example,
then gives the canonical program text after ANSWER_MARKER (no EOS_MARKER).
`task.demonstration(example, seed)` samples other valid paths with probability `diversity`:
an equivalent program (commuted `+`, `*`, `and`, `or` and comparisons, `x*2` as `x+x`,
`x>t` as `x>=t+1`, commuting stages such as filter and sort swapped), checked to give the
same outputs on every shown and held-out input, and a trace of another shown example. With
probability `spacing` the trace writes its list separators ", ". The reward is the fraction
of held-out cases (`meta["tests"]`) on which the answer's program returns exactly the
expected output; 0.0 without an answer or if it does not parse. Reward work is bounded by
design: the answer is at most MAX_ANSWER_CHARS, each run at most code_interp.MAX_STEPS steps,
and there are at most MAX_TESTS cases.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

from bebop_jax.tasks import base
from bebop_jax.tasks import code_interp as interp
from bebop_jax.tasks import code_lang as lang
from bebop_jax.tasks.code_lang import BinOp, BoolOp, Compare, Num, Var

LIST_KINDS = ("map", "filter", "sort", "rev", "take", "drop", "until")
REDUCER_KINDS = ("sum", "max", "min", "len", "fold")
ALL_STAGE_KINDS = LIST_KINDS + REDUCER_KINDS
# "until" (map(until(cond, expr))) is off by default.
DEFAULT_STAGE_KINDS = ("map", "filter", "sort", "rev", "take", "drop",
                       "sum", "max", "min", "len", "fold")
MAX_TESTS = 64
MAX_STAGES = 8
MAX_VALUE_MAGNITUDE = 10**6
MAX_CONST = 100

_X = Var("x")
_A = Var("a")


def _op(op: str, left: lang.Expr, right: lang.Expr | int) -> lang.Expr:
  """Returns the node `left <op> right` (an int right operand becomes a literal)."""
  right = Num(right) if isinstance(right, int) else right
  if op in ("and", "or"):
    return BoolOp(op, left, right)
  if op in ("<", ">", "<=", ">=", "==", "!="):
    return Compare(op, left, right)
  return BinOp(op, left, right)


def same_value(got: Any, expected: Any) -> bool:
  """Returns whether a program output equals an expected one (an int is not a list)."""
  if isinstance(expected, list):
    return isinstance(got, list) and got == expected
  return (isinstance(got, int) and isinstance(expected, int) and
          not isinstance(expected, bool) and got == expected)


def score_program(answer: str | None, tests: Sequence[dict[str, Any]]) -> float:
  """Returns the fraction of `tests` ({"input", "output"}) the program `answer` passes.

  0.0 if `answer` is None, does not parse, or there are no tests. Never raises.
  """
  try:
    program = lang.try_parse(answer) if isinstance(answer, str) else None
    if program is None or not tests:
      return 0.0
    tests = list(tests)[:MAX_TESTS]
    passed = 0
    for case in tests:
      result = interp.run_program(program, case["input"])
      passed += result.ok and same_value(result.value, case["output"])
    return passed / len(tests)
  except Exception:  # pylint: disable=broad-except  # defensive: malformed meta
    return 0.0


def trace_text(program: lang.Program, inputs: list[int],
               value_format: Callable[[Any], str] = lang.format_value) -> str:
  """Returns the stage-by-stage trace, e.g. `[3,1,2] map(x*2) -> [6,2,4] | sort -> [2,4,6]`
  (values written by `value_format`).

  Stops after a failing stage (not expected for generated examples).
  """
  result = interp.run_program(program, inputs, record_trace=True)
  parts = [f"{lang.format_stage(stage)} -> {value_format(value)}"
           for stage, value in zip(program.stages, result.trace)]
  return value_format(inputs) + " " + " | ".join(parts)


def _spaced_value(value: Any) -> str:
  """A value with its list separators written ", "."""
  if not isinstance(value, list):
    return lang.format_value(value)
  return "[" + ", ".join(str(v) for v in value) + "]"


@dataclasses.dataclass(frozen=True)
class CodeTask(base.Task):
  """Program synthesis from examples in the code_lang pipeline language.

  Attributes:
    min_stages: fewest stages of the hidden program (>= 1).
    max_stages: most stages of the hidden program.
    num_shown: input/output examples in the prompt.
    num_held_out: held-out cases the reward runs.
    min_len: shortest input list.
    max_len: longest input list.
    min_value: smallest input element.
    max_value: largest input element.
    max_const: largest constant in map/filter/fold templates (thresholds follow the values).
    stage_kinds: kinds of stage to draw from, a subset of ALL_STAGE_KINDS; a reducer
      (sum max min len fold) is only drawn for the last stage, "until" is
      `map(until(cond, expr))`.
    max_attempts: programs tried per sample; the first half must be informative (every
      stage changes some shown output, shown outputs not all equal, held-out outputs not
      all equal), the rest need only run.
    diversity: how often `demonstration` leaves the canonical path (0 = never).
    spacing: probability that a sampled demonstration's trace writes list separators ", ".
  """
  min_stages: int = 1
  max_stages: int = 1
  num_shown: int = 3
  num_held_out: int = 5
  min_len: int = 3
  max_len: int = 5
  min_value: int = 0
  max_value: int = 9
  max_const: int = 5
  stage_kinds: tuple[str, ...] = DEFAULT_STAGE_KINDS
  max_attempts: int = 200
  diversity: float = 0.0
  spacing: float = 0.0

  name = "code"

  def __post_init__(self):
    object.__setattr__(self, "stage_kinds", tuple(self.stage_kinds))
    checks = (
        (1 <= self.min_stages <= self.max_stages <= MAX_STAGES,
         f"need 1 <= min_stages <= max_stages <= {MAX_STAGES}"),
        (1 <= self.num_shown <= 16, "num_shown must be in [1, 16]"),
        (1 <= self.num_held_out <= MAX_TESTS, f"num_held_out must be in [1, {MAX_TESTS}]"),
        (0 <= self.min_len <= self.max_len <= interp.MAX_LIST_LEN and self.max_len >= 1,
         f"need 0 <= min_len <= max_len <= {interp.MAX_LIST_LEN}, max_len >= 1"),
        (-MAX_VALUE_MAGNITUDE <= self.min_value <= self.max_value <= MAX_VALUE_MAGNITUDE,
         f"need -{MAX_VALUE_MAGNITUDE} <= min_value <= max_value <= {MAX_VALUE_MAGNITUDE}"),
        (2 <= self.max_const <= MAX_CONST, f"max_const must be in [2, {MAX_CONST}]"),
        (bool(self.stage_kinds) and set(self.stage_kinds) <= set(ALL_STAGE_KINDS),
         f"stage_kinds must be a non-empty subset of {ALL_STAGE_KINDS}"),
        (self.max_attempts >= 2, "max_attempts must be >= 2"),
        (0.0 <= self.diversity <= 1.0, "diversity must be in [0, 1]"),
        (0.0 <= self.spacing <= 1.0, "spacing must be in [0, 1]"),
    )
    for ok, message in checks:
      if not ok:
        raise ValueError(f"code: {message}; got {self}")

  def sample(self, seed: int) -> base.Example:
    """Returns the example of `seed` (deterministic in seed and the knobs).

    Raises:
      RuntimeError: if the knobs admit no runnable program (e.g. only max/min with empty
        lists); never for the defaults.
    """
    rng = random.Random(f"code/{seed}")
    for attempt in range(self.max_attempts):
      example = self._try_sample(rng, strict=attempt < self.max_attempts // 2)
      if example is not None:
        return example
    raise RuntimeError(f"code: no runnable program found for seed {seed} with {self}")

  def reward(self, example: base.Example, completion: str) -> float:
    try:
      return score_program(base.extract_final_answer(completion), example.meta["tests"])
    except Exception:  # pylint: disable=broad-except  # defensive: never raise
      return 0.0

  def demonstration(self, example: base.Example, seed: int) -> str:
    """One valid solution path of `example` (the canonical one with diversity 0)."""
    if self.diversity <= 0 and self.spacing <= 0:
      return example.demonstration
    rng = random.Random(f"code-demo/{seed}")
    program = lang.parse_program(example.meta["program"])
    shown, tests = example.meta["shown"], example.meta["tests"]
    if rng.random() < self.diversity:
      variant = lang.parse_program(lang.format_program(equivalent_program(program, rng)))
      inputs = [case["input"] for case in list(shown) + list(tests)]
      if _outputs(variant, inputs) == _outputs(program, inputs):
        program = variant
    first = rng.randrange(len(shown)) if rng.random() < self.diversity else 0
    spaced = rng.random() < self.spacing  # one separator style for the whole trace
    trace = trace_text(program, shown[first]["input"],
                       _spaced_value if spaced else lang.format_value)
    return trace + "\n" + base.ANSWER_MARKER + lang.format_program(program)

  # Generation.

  def _try_sample(self, rng: random.Random, strict: bool) -> base.Example | None:
    """Returns an example built on a fresh random program, or None if it is rejected."""
    program = lang.parse_program(lang.format_program(self._random_program(rng)))
    shown = self._cases(rng, program, self.num_shown, distinct=True)
    if shown is None or (strict and not _informative(program, shown)):
      return None
    tests = self._cases(rng, program, self.num_held_out, distinct=False)
    if tests is None or (strict and len(tests) > 1 and _all_equal(tests)):
      return None
    source = lang.format_program(program)
    prompt = "".join(f"{lang.format_value(case['input'])} -> "
                     f"{lang.format_value(case['output'])}\n" for case in shown)
    demonstration = (trace_text(program, shown[0]["input"]) + "\n" + base.ANSWER_MARKER +
                     source)
    return base.Example(task=self.name, prompt=prompt + "program:\n",
                        demonstration=demonstration,
                        meta={"program": source, "shown": shown, "tests": tests})

  def _cases(self, rng: random.Random, program: lang.Program, n: int,
             distinct: bool) -> list[dict[str, Any]] | None:
    """Returns `n` cases {"input", "output"} on which `program` runs, or None."""
    cases: list[dict[str, Any]] = []
    for _ in range(4 * n + 8):
      if len(cases) == n:
        break
      inputs = self._random_list(rng)
      if distinct and any(case["input"] == inputs for case in cases):
        continue
      result = interp.run_program(program, inputs)
      if result.ok:
        cases.append({"input": inputs, "output": result.value})
    return cases if len(cases) == n else None

  def _random_list(self, rng: random.Random) -> list[int]:
    length = rng.randint(self.min_len, self.max_len)
    return [rng.randint(self.min_value, self.max_value) for _ in range(length)]

  def _random_program(self, rng: random.Random) -> lang.Program:
    """Returns a random program; a reducer can only be drawn for the last stage."""
    list_kinds = [k for k in self.stage_kinds if k in LIST_KINDS]
    n = rng.randint(self.min_stages, self.max_stages) if list_kinds else 1
    stages = []
    for i in range(n):
      kinds = self.stage_kinds if i == n - 1 else list_kinds
      stages.append(self._random_stage(rng, rng.choice(kinds)))
    return lang.Program(tuple(stages))

  def _random_stage(self, rng: random.Random, kind: str) -> lang.Stage:
    """Returns a random stage of `kind` with small constants."""
    if kind == "map":
      return lang.Map(self._random_map_expr(rng))
    if kind == "filter":
      return lang.Filter(self._random_condition(rng))
    if kind == "until":
      return lang.Map(self._random_until(rng))
    if kind in ("take", "drop"):
      n = rng.randint(1, max(1, self.max_len - 1))
      return lang.Take(n) if kind == "take" else lang.Drop(n)
    if kind == "fold":
      return self._random_fold(rng)
    if kind in ("sort", "rev"):
      return lang.Sort() if kind == "sort" else lang.Rev()
    return lang.Reduce(kind)

  def _random_map_expr(self, rng: random.Random) -> lang.Expr:
    k = rng.randint(1, self.max_const)  # an addend
    c = rng.randint(2, self.max_const)  # a factor, divisor or modulus
    templates: tuple[Callable[[], lang.Expr], ...] = (
        lambda: _op("+", _X, k),
        lambda: _op("-", _X, k),
        lambda: _op("*", _X, c),
        lambda: _op("+", _op("*", _X, c), k),
        lambda: _op("-", _op("*", _X, c), k),
        lambda: _op("//", _X, c),
        lambda: _op("%", _X, c),
        lambda: _op("-", Num(k), _X),
        lambda: lang.Neg(_X),
        lambda: _op("*", _X, _X),
    )
    return rng.choice(templates)()

  def _random_condition(self, rng: random.Random) -> lang.Expr:
    t = rng.randint(self.min_value, self.max_value)  # a threshold among the values
    lo, hi = sorted(rng.sample(range(self.min_value, self.max_value + 2), 2))
    c = rng.randint(2, self.max_const)
    templates: tuple[Callable[[], lang.Expr], ...] = (
        lambda: _op("==", _op("%", _X, c), 0),
        lambda: _op("!=", _op("%", _X, c), 0),
        lambda: _op(">", _X, _num(t)),
        lambda: _op("<", _X, _num(t)),
        lambda: _op(">=", _X, _num(t)),
        lambda: _op("<=", _X, _num(t)),
        lambda: _op("!=", _X, _num(t)),
        lambda: _op("and", _op(">", _X, _num(lo)), _op("<", _X, _num(hi))),
        lambda: _op("or", _op("<", _X, _num(lo)), _op(">", _X, _num(hi))),
    )
    return rng.choice(templates)()

  def _random_until(self, rng: random.Random) -> lang.Expr:
    """Returns a terminating `until`: round up to a multiple, or step up past a threshold."""
    c = rng.randint(2, self.max_const)
    if rng.random() < 0.5:
      return lang.Until(_op("==", _op("%", _X, c), 0), _op("+", _X, 1))
    t = rng.randint(self.min_value, self.max_value)
    return lang.Until(_op(">=", _X, _num(t)), _op("+", _X, rng.randint(1, self.max_const)))

  def _random_fold(self, rng: random.Random) -> lang.Fold:
    init = rng.randint(0, self.max_const)
    c = rng.randint(2, self.max_const)
    steps = (_op("+", _op("*", _A, c), _X), _op("+", _A, _op("*", _X, c)),
             _op("-", _X, _A), _op("*", _A, _X), _op("-", _A, _X))
    return lang.Fold(Num(init), rng.choice(steps))


def _num(v: int) -> lang.Expr:
  """Returns a literal for `v` (negative values as unary minus, as the parser reads them)."""
  return Num(v) if v >= 0 else lang.Neg(Num(-v))


def _outputs(program: lang.Program, inputs: list[list[int]]) -> list[Any] | None:
  """Returns the outputs of `program` on each input, or None if any run fails."""
  if not program.stages:
    return list(inputs)
  outputs = []
  for xs in inputs:
    result = interp.run_program(program, xs)
    if not result.ok:
      return None
    outputs.append(result.value)
  return outputs


def _all_equal(cases: list[dict[str, Any]]) -> bool:
  """Returns whether all cases have the same output."""
  return all(case["output"] == cases[0]["output"] for case in cases)


def _informative(program: lang.Program, cases: list[dict[str, Any]]) -> bool:
  """Returns whether the shown cases pin the program down a little.

  Outputs must not all be equal (when there are several) nor all equal their inputs, and
  removing any one stage must change some output (no redundant stage).
  """
  inputs = [case["input"] for case in cases]
  outputs = [case["output"] for case in cases]
  if (len(cases) > 1 and _all_equal(cases)) or outputs == inputs:
    return False
  for i in range(len(program.stages)):
    reduced = lang.Program(program.stages[:i] + program.stages[i + 1:])
    if _outputs(reduced, inputs) == outputs:
      return False
  return True


# Equivalent programs (demonstration variants).

_FLIPPED = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "==", "!=": "!="}
_COMMUTING = ((lang.Filter, lang.Sort), (lang.Filter, lang.Rev))


def equivalent_expr(node: lang.Expr, rng: random.Random) -> lang.Expr:
  """A randomly rewritten expression with the same value for every integer x and a."""
  if isinstance(node, BinOp):
    left, right = equivalent_expr(node.left, rng), equivalent_expr(node.right, rng)
    if node.op == "*" and right == Num(2) and rng.random() < 0.4:
      return BinOp("+", left, left)
    if node.op in ("+", "*") and rng.random() < 0.5:
      left, right = right, left
    return BinOp(node.op, left, right)
  if isinstance(node, Compare):
    left, right = equivalent_expr(node.left, rng), equivalent_expr(node.right, rng)
    op = node.op
    if isinstance(right, Num) and op in (">", "<") and rng.random() < 0.3:
      op, right = (">=", Num(right.value + 1)) if op == ">" else ("<=", Num(right.value - 1))
      if right.value < 0:
        right = lang.Neg(Num(-right.value))
    if rng.random() < 0.5:
      return Compare(_FLIPPED[op], right, left)
    return Compare(op, left, right)
  if isinstance(node, BoolOp):
    left, right = equivalent_expr(node.left, rng), equivalent_expr(node.right, rng)
    return BoolOp(node.op, right, left) if rng.random() < 0.5 else BoolOp(node.op, left, right)
  if isinstance(node, lang.Neg):
    return lang.Neg(equivalent_expr(node.operand, rng))
  if isinstance(node, lang.Until):
    return lang.Until(equivalent_expr(node.cond, rng), equivalent_expr(node.body, rng))
  return node


def equivalent_program(program: lang.Program, rng: random.Random) -> lang.Program:
  """A randomly rewritten program: equivalent expressions in every stage and, at random,
  adjacent commuting stages swapped (filter with sort or rev). The caller checks the
  outputs (CodeTask.demonstration)."""
  stages = []
  for stage in program.stages:
    if isinstance(stage, lang.Map):
      stage = lang.Map(equivalent_expr(stage.expr, rng))
    elif isinstance(stage, lang.Filter):
      stage = lang.Filter(equivalent_expr(stage.cond, rng))
    elif isinstance(stage, lang.Fold):
      stage = lang.Fold(stage.init, equivalent_expr(stage.step, rng))
    stages.append(stage)
  for i in range(len(stages) - 1):
    pair = (type(stages[i]), type(stages[i + 1]))
    if (pair in _COMMUTING or pair[::-1] in _COMMUTING) and rng.random() < 0.5:
      stages[i], stages[i + 1] = stages[i + 1], stages[i]
  return lang.Program(tuple(stages))
