import random
import time

import pytest

from bebop_jax import tasks
from bebop_jax.tasks import base
from bebop_jax.tasks import code_interp as interp
from bebop_jax.tasks import code_lang as lang
from bebop_jax.tasks.code import ALL_STAGE_KINDS, CodeTask, score_program

_ALLOWED_CHARS = set(chr(c) for c in range(32, 127)) | {"\n"}
_PER_CALL_LIMIT_S = 0.5


def _run(source, inputs, **bounds):
  return interp.run_source(source, inputs, **bounds)


def _value(source, inputs):
  result = _run(source, inputs)
  assert result.status == interp.OK, (source, inputs, result)
  return result.value


def _visible(text):
  """The text with the special markers removed (they are single tokens, not characters)."""
  for marker in base.SPECIAL_MARKERS:
    text = text.replace(marker, "")
  return text


# ----------------------------------------------------------------------------------------
# Task: demonstrations, determinism, format.


@pytest.mark.parametrize("knobs", [
    {},
    {"stage_kinds": ALL_STAGE_KINDS, "min_stages": 2, "max_stages": 4, "min_len": 0,
     "max_len": 8, "min_value": -20, "max_value": 20, "num_held_out": 12},
    {"stage_kinds": ("until", "sort", "sum"), "num_shown": 1},
])
def test_demonstrations_score_one(knobs):
  task = tasks.get_task("code", **knobs)
  lengths = []
  for seed in range(300):
    ex = task.sample(seed)
    assert ex.task == "code"
    assert task.reward(ex, ex.demonstration) == 1.0
    assert task.reward(ex, ex.demonstration + base.EOS_MARKER + "junk") == 1.0
    assert task.reward(base.Example.from_json(ex.to_json()), ex.demonstration) == 1.0
    assert set(ex.prompt) <= _ALLOWED_CHARS
    assert set(_visible(ex.demonstration)) <= _ALLOWED_CHARS
    assert ex.prompt.endswith("\nprogram:\n")
    assert ex.prompt.count("\n") == task.num_shown + 1
    assert len(ex.meta["tests"]) == task.num_held_out
    assert ex.demonstration.endswith(base.ANSWER_MARKER + ex.meta["program"])
    assert str(lang.parse_program(ex.meta["program"])) == ex.meta["program"]
    lengths.append(len(ex.demonstration))
  if not knobs:
    assert max(lengths) < 200, max(lengths)


def test_default_example_format():
  ex = CodeTask().sample(7)
  lines = ex.prompt.split("\n")
  shown = ex.meta["shown"]
  assert lines[:-2] == [f"{lang.format_value(c['input'])} -> {lang.format_value(c['output'])}"
                        for c in shown]
  trace, answer = ex.demonstration.split("\n" + base.ANSWER_MARKER)
  assert answer == ex.meta["program"]
  assert trace.startswith(lang.format_value(shown[0]["input"]) + " ")
  assert trace.endswith(" -> " + lang.format_value(shown[0]["output"]))
  assert trace.count(" -> ") == len(lang.parse_program(answer).stages)


def test_trace_format():
  from bebop_jax.tasks.code import trace_text
  program = lang.parse_program("map(x*2) | sort")
  assert trace_text(program, [3, 1, 2]) == "[3,1,2] map(x*2) -> [6,2,4] | sort -> [2,4,6]"
  assert trace_text(lang.parse_program("sum"), [3, 1]) == "[3,1] sum -> 4"


def test_sample_is_deterministic_and_varied():
  task = CodeTask()
  for seed in (0, 1, 12345, -3, 2**40):
    assert task.sample(seed) == task.sample(seed)
    assert CodeTask().sample(seed).to_json() == task.sample(seed).to_json()
  prompts = {task.sample(seed).prompt for seed in range(200)}
  assert len(prompts) == 200
  programs = {task.sample(seed).meta["program"] for seed in range(200)}
  assert len(programs) > 40


def test_examples_are_informative():
  task = CodeTask()
  for seed in range(200):
    ex = task.sample(seed)
    shown = ex.meta["shown"]
    assert any(c["input"] != c["output"] for c in shown)
    assert len({repr(c["output"]) for c in shown}) > 1
    assert len({repr(c["input"]) for c in shown}) == len(shown)
    stages = lang.parse_program(ex.meta["program"]).stages
    assert 1 <= len(stages) <= 2
    for c in shown + ex.meta["tests"]:
      assert 3 <= len(c["input"]) <= 5 and all(0 <= v <= 9 for v in c["input"])


def test_bad_knobs_raise_value_error():
  for knobs in ({"min_stages": 0}, {"min_stages": 3, "max_stages": 2},
                {"stage_kinds": ("map", "loop")}, {"stage_kinds": ()},
                {"min_len": 4, "max_len": 3}, {"max_len": 65}, {"num_held_out": 0},
                {"min_value": 5, "max_value": 1}, {"max_const": 1}, {"bogus": 1}):
    with pytest.raises(ValueError):
      tasks.get_task("code", **knobs)


# ----------------------------------------------------------------------------------------
# Reward.


def _example(tests):
  return base.Example(task="code", prompt="", demonstration="",
                      meta={"program": "", "shown": [], "tests": tests})


def test_reward_wrong_and_fractional():
  ex = _example([{"input": [2], "output": [4]}, {"input": [1], "output": [2]},
                 {"input": [0], "output": [0]}, {"input": [3], "output": [6]}])
  task = CodeTask()
  answer = lambda program: "some reasoning\n" + base.ANSWER_MARKER + program
  assert task.reward(ex, answer("map(x*2)")) == 1.0
  assert task.reward(ex, answer(" map( x + x ) " + base.EOS_MARKER)) == 1.0
  assert task.reward(ex, answer("map(x+2)")) == 0.25  # only [2] -> [4]
  assert task.reward(ex, answer("map(x*x)")) == 0.5  # [2] -> [4], [0] -> [0]
  assert task.reward(ex, answer("map(x+9)")) == 0.0
  assert task.reward(ex, answer("rev")) == 0.25  # [0] -> [0]
  assert task.reward(ex, answer("sum")) == 0.0  # an int is not a list
  assert task.reward(ex, answer("map(x*2")) == 0.0  # parse error
  assert task.reward(ex, answer("")) == 0.0
  assert task.reward(ex, "map(x*2)") == 0.0  # no answer marker
  assert task.reward(ex, answer("map(x//(x-1)*2)")) == 0.5  # errors on [1], wrong on [3]
  int_ex = _example([{"input": [1, 2], "output": 3}, {"input": [5], "output": 6}])
  assert task.reward(int_ex, answer("sum")) == 0.5
  assert task.reward(int_ex, answer("map(x*0) | sum")) == 0.0


def test_reward_never_raises_on_odd_arguments():
  task = CodeTask()
  ex = task.sample(0)
  good = ex.demonstration
  for completion in (None, 123, b"\xff\xfe" + good.encode(), ["x"], good.encode()):
    assert 0.0 <= task.reward(ex, completion) <= 1.0
  for meta in ({}, {"tests": None}, {"tests": [{"input": "abc"}]}, {"tests": [1, 2]},
               {"tests": [{"input": [1] * 10**4, "output": []}]}, {"tests": []}):
    assert task.reward(base.Example("code", "", "", meta), good) == 0.0
  assert score_program(None, ex.meta["tests"]) == 0.0


def _fuzz_strings(rng):
  """Random and adversarial completions (answers), see test_reward_fuzz."""
  words = ["map", "filter", "sort", "rev", "take", "drop", "sum", "max", "min", "len",
           "fold", "until", "and", "or", "not", "x", "a", "(", ")", "|", ",", "+", "-", "*",
           "//", "%", "<", ">", "<=", ">=", "==", "!=", "0", "1", "7", "10", "999999999",
           " ", "\n", base.ANSWER_MARKER, base.EOS_MARKER]
  out = []
  for _ in range(1500):
    n = rng.randint(0, 40)
    out.append("".join(rng.choice(words) for _ in range(n)))
  for _ in range(800):
    n = rng.randint(0, 300)
    out.append("".join(chr(rng.randint(32, 126)) for _ in range(n)))
  for _ in range(100):
    out.append("".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 50))))
  huge = "1" + "0" * 200
  out += [
      f"map(x*{huge})", f"map({huge})", f"take({huge})", f"fold({huge}, a+x)",
      "map(x*1000000000)", "map(x*999999999*999999999)", "map(1000000001)",
      "map(" + "(" * 10_000 + "x" + ")" * 10_000 + ")",
      "map(" + "(" * 10_000,
      "map(" + "-" * 10_000 + "x)",
      "filter(" + "not " * 5_000 + "x<1)",
      "map(" + "x+" * 5_000 + "x)",
      "map(until(" * 3000 + "x<0, x+1" + "))" * 3000,
      "map(until(x<0, x+1))",
      "map(until(x<0, x+1)) | map(until(x<0, x+1))",
      "map(until(x>x, until(x<0, x+1)))",
      "fold(0, until(a<0, a+x+1))",
      "map(until(x<0, x*2))",
      "map(until(x>1000000000, x+1000))",
      " | ".join(["sort"] * 60),
      " | ".join(["map(x+1)"] * 60),
      " | ".join(["sort"] * 5000),
      "map(x", "map(", "filter(x<", "fold(0,", "take(", "sort |", "| sort", "(", ")",
      "map(x)) | sort", "sort sort", "",
  ]
  for body in list(out[-40:]):
    out.append(base.ANSWER_MARKER + body)
    out.append("reasoning " + base.ANSWER_MARKER + body + base.EOS_MARKER + "tail")
  big = 10 * 1024 * 1024
  out += ["a" * big, base.ANSWER_MARKER + "(" * big, "(" * big + base.ANSWER_MARKER,
          base.ANSWER_MARKER + "map(until(x<0, x+1))" + " " * big,
          base.ANSWER_MARKER * (big // len(base.ANSWER_MARKER))]
  return out


def test_reward_fuzz_never_raises_and_is_fast():
  task = CodeTask()
  rng = random.Random(0)
  examples = [task.sample(seed) for seed in range(5)]
  worst, worst_text = 0.0, ""
  count = 0
  for i, text in enumerate(_fuzz_strings(rng)):
    candidates = [text] if text.startswith(base.ANSWER_MARKER) or len(text) > 10**6 else [
        text, base.ANSWER_MARKER + text]
    for completion in candidates:
      start = time.perf_counter()
      score = task.reward(examples[i % 5], completion)
      elapsed = time.perf_counter() - start
      count += 1
      assert 0.0 <= score <= 1.0
      if elapsed > worst:
        worst, worst_text = elapsed, completion[:60]
      # The language entry points directly, without the reward's answer-length clip.
      start = time.perf_counter()
      result = _run(completion[:100_000], [1, 2, 3])
      assert result.status in (interp.OK, interp.ERROR, interp.STEP_LIMIT, interp.PARSE_ERROR)
      worst = max(worst, time.perf_counter() - start)
  print(f"fuzz: {count} reward calls, max per-call {worst * 1e3:.1f} ms ({worst_text!r})")
  assert count > 4000
  assert worst < _PER_CALL_LIMIT_S, (worst, worst_text)


# ----------------------------------------------------------------------------------------
# Interpreter: stages and operators against hand-computed results.


@pytest.mark.parametrize("source, inputs, expected", [
    # Stages.
    ("map(x*2+1)", [1, 2, 3], [3, 5, 7]),
    ("filter(x%2==0)", [1, 2, 3, 4, 6], [2, 4, 6]),
    ("sort", [3, -1, 2, 2], [-1, 2, 2, 3]),
    ("rev", [1, 2, 3], [3, 2, 1]),
    ("take(2)", [5, 6, 7], [5, 6]),
    ("take(0)", [5, 6, 7], []),
    ("take(10)", [5, 6, 7], [5, 6, 7]),
    ("drop(2)", [5, 6, 7], [7]),
    ("drop(10)", [5, 6, 7], []),
    ("sum", [5, 6, -7], 4),
    ("sum", [], 0),
    ("max", [5, 9, -7], 9),
    ("min", [5, 9, -7], -7),
    ("len", [5, 9, -7], 3),
    ("len", [], 0),
    ("fold(0, a*10+x)", [1, 2, 3], 123),
    ("fold(5, a-x)", [1, 2], 2),
    ("fold(0, x-a)", [1, 2, 3], 2),  # 1, 2-1=1, 3-1=2
    ("fold(2+3, a)", [1, 2], 5),
    ("fold(7, a+x)", [], 7),
    ("map(until(x%3==0, x+1))", [1, 2, 3, 4], [3, 3, 3, 6]),
    ("map(until(x>10, x*2))", [1, 11], [16, 11]),
    ("fold(0, until(x>=a, x+1))", [3, 1, 5], 5),  # a := max(a, x)
    ("map(x*2+1) | filter(x%3!=0) | sort | take(3)", [5, 1, 4, 2], [5, 11]),
    ("filter(x>1) | map(x-1) | rev | len", [0, 1, 2, 3], 2),
    ("filter(x>5) | map(x+1)", [1, 2], []),
    # Floor division and modulo, Python semantics.
    ("map(x//2)", [7, -7, -1, 0], [3, -4, -1, 0]),
    ("map(x//-2)", [7, -7, 3], [-4, 3, -2]),
    ("map(x%3)", [7, -7, -1, 0], [1, 2, 2, 0]),
    ("map(x%-3)", [7, -7, 1], [-2, -1, -2]),
    # Precedence and associativity (as in Python).
    ("map(-x//2)", [3], [-2]),  # unary minus binds tighter than //
    ("map(-(x//2))", [3], [-1]),
    ("map(1+x*2)", [3], [7]),
    ("map((1+x)*2)", [3], [8]),
    ("map(x-1-1)", [3], [1]),
    ("map(x-(1-1))", [3], [3]),
    ("map(20//x//2)", [3], [3]),
    ("map(x*x%7)", [4], [2]),
    ("map(--x)", [4], [4]),
    ("map(2-3)", [0], [-1]),
    ("map(x*-2)", [4], [-8]),
    ("map( x * ( 2 + 1 ) )", [4], [12]),
    # Comparisons and boolean operators.
    ("filter(x<2)", [1, 2, 3], [1]),
    ("filter(x>2)", [1, 2, 3], [3]),
    ("filter(x<=2)", [1, 2, 3], [1, 2]),
    ("filter(x>=2)", [1, 2, 3], [2, 3]),
    ("filter(x==2)", [1, 2, 3], [2]),
    ("filter(x!=2)", [1, 2, 3], [1, 3]),
    ("filter(x>1 and x<4)", [1, 2, 3, 4], [2, 3]),
    ("filter(x<2 or x>3)", [1, 2, 3, 4], [1, 4]),
    ("filter(not x==2)", [1, 2, 3], [1, 3]),
    ("filter(not x>1 and x>0)", [0, 1, 2], [1]),  # (not x>1) and x>0
    ("filter(not (x>1 and x<3))", [1, 2, 3], [1, 3]),
    ("filter(x<1 or x>2 and x<4)", [0, 1, 3, 4], [0, 3]),  # and binds tighter than or
    ("filter(x==0 or 1//x>0)", [0, 1, 2], [0, 1]),  # short-circuit: no division by zero
    ("filter(x!=0 and 6%x==0)", [0, 2, 4], [2]),
    ("filter(x+1>2*x)", [0, 1, 2], [0]),
    ("filter(not not x<1)", [0, 1], [0]),
])
def test_interpreter_values(source, inputs, expected):
  result = _run(source, inputs)
  assert result.status == interp.OK, result
  assert result.value == expected and type(result.value) is type(expected)


@pytest.mark.parametrize("source, inputs, message", [
    ("map(x//0)", [1], "division by zero"),
    ("map(x%(x-1))", [2, 1], "modulo by zero"),
    ("max", [], "empty"),
    ("min", [], "empty"),
    ("map(x*100000)", [100000], "overflow"),
    ("map(x+1)", [10**9], "overflow"),
    ("map(-x-2)", [10**9 - 1], "overflow"),
    ("sum", [10**9, 1], "overflow"),
    ("fold(1, a*x)", [1000, 1000, 1000, 1000], "overflow"),
    ("map(until(x>1000000000, x+1000000))", [0], "overflow"),
    ("sort", [1] * 65, "longer"),
    ("sort", [10**9 + 1], "bounds"),
    ("sort", [True], "bounds"),
    ("sort", [1.0], "bounds"),
    ("sort", "123", "list"),
    ("sort", None, "list"),
])
def test_interpreter_errors(source, inputs, message):
  result = _run(source, inputs)
  assert result.status == interp.ERROR and message in result.error, result
  assert result.value is None


def test_bounds_are_inclusive():
  assert _value("sort", [1] * interp.MAX_LIST_LEN) == [1] * interp.MAX_LIST_LEN
  assert _value("map(x)", [10**9, -10**9]) == [10**9, -10**9]
  assert _value("map(1000000000-x)", [0]) == [10**9]
  assert _value("map(x*x)", [31622]) == [31622**2]
  assert _value("map(-x)", [10**9]) == [-10**9]


@pytest.mark.parametrize("source", [
    "", " ", "map", "map()", "map(x", "map(x))", "sort sort", "sort |", "| sort",
    "sum | sort", "fold(0, a+x) | len", "filter(x+1)", "map(x<1)", "map(a)", "fold(x, a+x)",
    "fold(a, a+x)", "fold(0, a+x", "map(1<2<3)", "take(-1)", "take(x)", "take(1+1)",
    "take(2", "map(x ** 2)", "map(x/2)", "map(x^2)", "map(y)", "map(X)", "Map(x)",
    "map(x+)", "map(+x)", "filter(x=1)", "filter(x and x)", "filter(x<1 and 2)",
    "filter(not x)", "map(not x<1)", "map(1 + not x<1)", "filter(x == not x<1)",
    "filter(x<1 <2)", "map(1000000001)", "map(12345678901234567890)", "map(x,1)",
    "map(until(x<1))", "map(until(x, x+1))", "map(until(x<1, x<2))",
    "fold(until(x>1, x+1), a)", "map(x\u0661)", "map(x+\u0661)", "map(\uff11)",
    "map(x)\x00", "sort\u00a0", "map(2x)", "map(x2)", "rev()", "sum(x)", "take()",
])
def test_parse_errors(source):
  with pytest.raises(lang.ParseError):
    lang.parse_program(source)
  assert lang.try_parse(source) is None
  assert _run(source, [1, 2]).status == interp.PARSE_ERROR


def test_parse_bounds():
  assert lang.parse_program("map(1000000000)") == lang.parse_program("map(0001000000000)")
  assert lang.parse_program(f"map({'0' * 300}7)").stages[0].expr == lang.Num(7)
  with pytest.raises(lang.ParseError, match="longer"):
    lang.parse_program("sort" + " " * lang.MAX_SOURCE_CHARS)
  for source in (123, None, b"sort", ["sort"]):
    with pytest.raises(lang.ParseError):
      lang.parse_program(source)
  # Parenthesis nesting: MAX_DEPTH levels parse, one more is an error (no RecursionError).
  d = lang.MAX_DEPTH
  assert _value("map(" + "(" * d + "x" + ")" * d + ")", [4]) == [4]
  for deep in ("(" * (d + 1) + "x" + ")" * (d + 1), "-" * (d + 1) + "x",
               "(" * 100_000 + "x" + ")" * 100_000):
    with pytest.raises(lang.ParseError):
      lang.parse_program("map(" + deep + ")", max_source_chars=10**6)
  assert _value("map(" + "-" * (d - 1) + "x)", [4]) == [-4]
  # Tree height bounds left-deep chains too.
  assert _value("map(" + "x+" * (d - 1) + "x)", [1]) == [d]
  with pytest.raises(lang.ParseError, match="deeper"):
    lang.parse_program("map(" + "x+" * d + "x)")
  with pytest.raises(lang.ParseError):
    lang.parse_program("filter(" + "not " * (d + 1) + "x<1)")


def test_format_round_trip():
  for source in ("map(x*2+1) | filter(x%3!=0) | sort | take(3)", "fold(0, a*10+x)",
                 "filter(x>1 and not x>5 or x==0)", "map(-(x+1)*-2)", "map(x-(1-x))",
                 "filter(not (x<1 or x>2))", "map(until(x%3==0, x+1)) | rev | drop(1)",
                 "map((x+1)%(2-x)//3)", "len"):
    program = lang.parse_program(source)
    assert str(program) == source
    assert lang.parse_program(str(program)) == program
  assert str(lang.parse_program(" map( ( (x) ) * 2 )|sort ")) == "map(x*2) | sort"


def _random_expr(rng, depth, want):
  """A random well-typed expression tree (ints or bools) over x."""
  if depth == 0 or rng.random() < 0.2:
    if want == lang.INT:
      return rng.choice([lang.Var("x"), lang.Num(rng.randint(0, 20))])
    return lang.Compare(rng.choice(["<", "==", ">="]), lang.Var("x"), lang.Num(3))
  if want == lang.BOOL:
    kind = rng.randrange(3)
    if kind == 0:
      return lang.Not(_random_expr(rng, depth - 1, lang.BOOL))
    if kind == 1:
      return lang.BoolOp(rng.choice(["and", "or"]), _random_expr(rng, depth - 1, lang.BOOL),
                         _random_expr(rng, depth - 1, lang.BOOL))
    return lang.Compare(rng.choice(["<", ">", "<=", ">=", "==", "!="]),
                        _random_expr(rng, depth - 1, lang.INT),
                        _random_expr(rng, depth - 1, lang.INT))
  if rng.random() < 0.2:
    return lang.Neg(_random_expr(rng, depth - 1, lang.INT))
  return lang.BinOp(rng.choice(["+", "-", "*", "//", "%"]),
                    _random_expr(rng, depth - 1, lang.INT),
                    _random_expr(rng, depth - 1, lang.INT))


def test_random_trees_format_and_parse_back_identically():
  rng = random.Random(0)
  for _ in range(500):
    program = lang.Program((lang.Map(_random_expr(rng, 4, lang.INT)),
                            lang.Filter(_random_expr(rng, 4, lang.BOOL))))
    assert lang.parse_program(str(program)) == program, str(program)


# ----------------------------------------------------------------------------------------
# Step bound.


def test_non_terminating_program_stops_at_step_bound():
  start = time.perf_counter()
  result = _run("map(until(x<0, x+1))", [1, 2])
  elapsed = time.perf_counter() - start
  assert result.status == interp.STEP_LIMIT and result.value is None
  assert result.steps == interp.MAX_STEPS
  assert elapsed < _PER_CALL_LIMIT_S
  for max_steps in (1, 2, 57, 1000):
    result = _run("map(until(x<0, x+1))", [1], max_steps=max_steps)
    assert result.status == interp.STEP_LIMIT and result.steps == max_steps


def test_step_bound_is_exact():
  for source, inputs in (("map(x*2+1) | filter(x%3!=0) | sort", [5, 1, 4, 2]),
                         ("map(until(x>=50, x+1))", [0, 7]), ("fold(0, a*2+x)", [1, 0, 1])):
    ok = _run(source, inputs)
    assert ok.status == interp.OK and ok.steps > 0
    assert _run(source, inputs, max_steps=ok.steps) == ok
    short = _run(source, inputs, max_steps=ok.steps - 1)
    assert short.status == interp.STEP_LIMIT and short.steps == ok.steps - 1
  # Counting: 1 per stage started, 1 per expression node, 1 per element of a whole-list stage.
  assert _run("map(x+1)", [1, 2]).steps == 1 + 2 * 3
  assert _run("sort | sum", [3, 1, 2]).steps == (1 + 3) * 2
  assert _run("map(until(x>=2, x+1))", [0]).steps == 1 + 1 + 3 * 3 + 2 * 3


def test_trace_is_recorded():
  result = _run("map(x*2) | sort | sum", [3, 1, 2], record_trace=True)
  assert result.trace == ([6, 2, 4], [2, 4, 6], 12)
  failed = _run("map(x*2) | max", [], record_trace=True)
  assert failed.status == interp.ERROR and failed.trace == ([],)
