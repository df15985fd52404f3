"""Tests of the agentic (multi-turn tool use) task."""

from __future__ import annotations

import random
import time
import types

import pytest

from bebop_jax.tasks import agentic
from bebop_jax.tasks.agentic import (AgenticTask, CalcError, StepResult, evaluate_expression,
                                     policy_turns, run_tool)
from bebop_jax.tasks.base import (ANSWER_MARKER, CALL_END, CALL_START, EOS_MARKER,
                                  RESULT_END, RESULT_START, SPECIAL_MARKERS, Example,
                                  clip_completion)

NUM_SEEDS = 300
TIME_BOUND_S = 0.5
TASK_VARIANTS = [
    {},
    {"kinds": ("one_hop",)},
    {"kinds": ("two_hop",), "num_entities": 2},
    {"kinds": ("aggregate",), "ops": ("plus", "minus", "times"), "num_entities": 12},
    {"kinds": ("aggregate",), "use_calc": False, "max_turns": 3},
]


def _strip_markers(text: str) -> str:
  """Returns `text` without the special markers."""
  for marker in SPECIAL_MARKERS:
    text = text.replace(marker, "")
  return text


def _is_clean(text: str) -> bool:
  """Returns whether `text` is printable ASCII plus newline plus markers."""
  return all(32 <= ord(ch) <= 126 or ch == "\n" for ch in _strip_markers(text))


def _run_episode(task: AgenticTask, example: Example, policy_fn) -> types.SimpleNamespace:
  """(transcript, reward, turns, done) of `policy_fn` against the example's environment:
  policy_fn(prompt + transcript so far) gives the next turn, clipped to
  MAX_COMPLETION_CHARS; at most the environment's turn limit + 1 turns."""
  env = task.environment(example)
  transcript = ""
  for _ in range(env.max_turns + 1):
    turn = clip_completion(policy_fn(example.prompt + transcript))
    result = env.step(turn)
    transcript += turn + result.observation
    if result.done:
      return types.SimpleNamespace(transcript=transcript, reward=result.reward,
                                   turns=result.turn, done=True)
  return types.SimpleNamespace(transcript=transcript, reward=0.0, turns=env.turn, done=False)


def _scripted(turns: list[str]):
  """A policy_fn that ignores its context and plays `turns` in order, then ''."""
  remaining = list(turns)
  return lambda context: remaining.pop(0) if remaining else ""


def _replay(task: AgenticTask, example: Example) -> str:
  """Replays the demonstration's turns; returns the transcript; asserts reward 1 at the end."""
  turns = policy_turns(example.demonstration)
  env = task.environment(example)
  transcript = ""
  for index, turn in enumerate(turns):
    result = env.step(turn)
    assert isinstance(result, StepResult)
    assert result.turn == index + 1
    transcript += turn + result.observation
    if result.done:
      assert index == len(turns) - 1, "episode ended before the demonstration did"
      assert result.reward == 1.0 and result.observation == ""
      return transcript
    assert result.reward == 0.0
  raise AssertionError("episode did not end")


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("knobs", TASK_VARIANTS)
def test_replay_reproduces_demonstration(knobs):
  task = AgenticTask(**knobs)
  assert task.multi_turn and task.name == "agentic"
  for seed in range(NUM_SEEDS):
    example = task.sample(seed)
    assert _replay(task, example) == example.demonstration
    assert task.reward(example, example.demonstration) == 1.0
    assert task.reward(example, example.demonstration + EOS_MARKER) == 1.0
    episode = _run_episode(task, example, _scripted(policy_turns(example.demonstration)))
    assert episode.done and episode.reward == 1.0
    assert episode.transcript == example.demonstration


@pytest.mark.parametrize("knobs", TASK_VARIANTS)
def test_format_and_lengths(knobs):
  task = AgenticTask(**knobs)
  for seed in range(NUM_SEEDS):
    example = task.sample(seed)
    assert example.task == "agentic"
    assert len(example.prompt) < 80 and len(example.demonstration) < 200
    assert _is_clean(example.prompt) and _is_clean(example.demonstration)
    assert not any(marker in example.prompt for marker in SPECIAL_MARKERS)
    assert example.demonstration.startswith(CALL_START)
    assert example.demonstration.count(ANSWER_MARKER) == 1
    assert "error" not in example.demonstration
    assert example.meta["kind"] in task.kinds
    assert len(example.meta["world"]) == task.num_entities
    # The world's values are not in the prompt: only the asked-about names are.
    assert not any(ch.isdigit() for ch in example.prompt)
    assert not any(city in example.prompt for city in agentic.CITIES)
    assert len(policy_turns(example.demonstration)) <= task.max_turns


def test_world_is_hidden_and_random():
  task = AgenticTask()
  names = set()
  for seed in range(NUM_SEEDS):
    world = task.sample(seed).meta["world"]
    for name, record in world.items():
      assert 3 <= len(name) <= 5 and name.isascii() and name.isalpha() and name.islower()
      assert set(record) == set(agentic.ATTRIBUTES)
      assert record["boss"] in world and record["boss"] != name
      assert record["city"] in agentic.CITIES
      assert isinstance(record["age"], int) and isinstance(record["score"], int)
    names.update(world)
  assert len(names) > 0.9 * NUM_SEEDS * task.num_entities


def test_determinism():
  task_a, task_b = AgenticTask(), AgenticTask()
  for seed in range(50):
    assert task_a.sample(seed) == task_b.sample(seed)
    restored = Example.from_json(task_a.sample(seed).to_json())
    assert restored == task_a.sample(seed)
    assert _replay(task_a, restored) == restored.demonstration
  assert len({task_a.sample(seed).demonstration for seed in range(50)}) == 50


def test_all_kinds_and_ops_appear():
  task = AgenticTask(ops=("plus", "minus", "times"))
  kinds = {task.sample(seed).meta["kind"] for seed in range(100)}
  assert kinds == set(agentic.KINDS)
  prompts = " ".join(task.sample(seed).prompt for seed in range(300))
  assert all(f" {op} " in prompts for op in ("plus", "minus", "times"))


def test_aggregate_without_calc_has_no_calc_call():
  task = AgenticTask(kinds=("aggregate",), use_calc=False, max_turns=3)
  for seed in range(50):
    assert "calc(" not in task.sample(seed).demonstration


def test_bad_knobs_raise():
  for knobs in ({"num_entities": 1}, {"num_entities": 100}, {"kinds": ()},
                {"kinds": ("nope",)}, {"ops": ("divide",)}, {"max_turns": 3},
                {"kinds": ("one_hop",), "max_turns": 1}):
    with pytest.raises(ValueError):
      AgenticTask(**knobs)


# ------------------------------------------------------------------------------ reward


def test_wrong_answers_score_zero():
  task = AgenticTask()
  for seed in range(NUM_SEEDS):
    example = task.sample(seed)
    answer = example.meta["answer"]
    prefix = example.demonstration[:example.demonstration.index(ANSWER_MARKER)]
    wrong = [answer + "1", "x" + answer, "", " ", "None"]
    if answer.lstrip("-").isdigit():
      wrong.append(str(int(answer) + 1))
    for bad in wrong:
      assert task.reward(example, prefix + ANSWER_MARKER + bad) == 0.0
    assert task.reward(example, prefix) == 0.0
    assert task.reward(example, "") == 0.0
    assert task.reward(example, answer) == 0.0  # No marker.
    # The first answer counts.
    assert task.reward(example, ANSWER_MARKER + "zz" + ANSWER_MARKER + answer) == 0.0
    # Whitespace around the answer is fine.
    assert task.reward(example, prefix + ANSWER_MARKER + " " + answer + "\n") == 1.0


# ------------------------------------------------------------------------------ calculator


def _random_expr(rng: random.Random, depth: int) -> tuple[str, int]:
  """Returns a random (expression text, value) pair built as a tree (test oracle)."""
  if depth == 0 or rng.random() < 0.3:
    value = rng.randint(0, 999)
    return str(value), value
  left, lvalue = _random_expr(rng, depth - 1)
  right, rvalue = _random_expr(rng, depth - 1)
  op = rng.choice("+-*")
  value = {"+": lvalue + rvalue, "-": lvalue - rvalue, "*": lvalue * rvalue}[op]
  space = rng.choice(["", " "])
  return f"({left}{space}{op}{space}{right})", value


def test_calc_basic():
  cases = {
      "1+2": 3, "2*3+4": 10, "2+3*4": 14, "(2+3)*4": 20, "10-4-3": 3, "2*3*4": 24,
      "-5": -5, "--5": 5, "3*-2": -6, "+7": 7, "-(2+3)": -5, " 1 +\t2 ": 3, "0": 0,
      "007": 7, "((((((((1))))))))": 1, "999999999*999": 999999999 * 999,
  }
  for expr, value in cases.items():
    assert evaluate_expression(expr) == value, expr


def test_calc_matches_tree_oracle():
  rng = random.Random(0)
  checked = 0
  for _ in range(2000):
    expr, value = _random_expr(rng, 3)
    if len(expr) > agentic.MAX_EXPR_CHARS:
      continue
    if abs(value) > agentic.MAX_CALC_ABS:
      with pytest.raises(CalcError):
        evaluate_expression(expr)
    else:
      assert evaluate_expression(expr) == value, expr
    checked += 1
  assert checked > 500


def test_calc_bounds():
  depth = agentic.MAX_EXPR_DEPTH
  assert evaluate_expression("(" * depth + "1" + ")" * depth) == 1
  bad = [
      "", "   ", "1+", "*1", "(1", "1)", "()", "1 2", "1//2", "1/2", "2**3", "1.5", "a",
      "__import__('os')", "1e3", "0x10", "\u0661\u0662", "\uff11", "\u00b2",
      "(" * (depth + 1) + "1" + ")" * (depth + 1),
      "(" * 10000 + "1" + ")" * 10000,
      "1" * (agentic.MAX_LITERAL_DIGITS + 1),
      str(10**200),
      "999999*999999*999999",
      "1+" * 40 + "1",
      "-" * 10000 + "1",
  ]
  for expr in bad:
    with pytest.raises(CalcError):
      evaluate_expression(expr)
  assert evaluate_expression("1000000*1000000") == 10**12
  with pytest.raises(CalcError):
    evaluate_expression("1000000*1000000+1")
  limit = agentic.MAX_EXPR_CHARS
  assert evaluate_expression("1+" * ((limit - 1) // 2) + "1") == (limit - 1) // 2 + 1
  with pytest.raises(CalcError):
    evaluate_expression(" " * limit + "1")


def test_calc_only_raises_calc_error():
  rng = random.Random(1)
  alphabet = "0123456789+-*() x\u0661"
  for _ in range(5000):
    expr = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 70)))
    try:
      value = evaluate_expression(expr)
    except CalcError:
      continue
    assert isinstance(value, int) and abs(value) <= agentic.MAX_CALC_ABS


# ------------------------------------------------------------------------------ tools / env


def _world() -> dict:
  return {"kel": {"age": 40, "city": "oslo", "boss": "bim", "score": 7},
          "bim": {"age": 51, "city": "rome", "boss": "kel", "score": 93}}


def test_run_tool():
  world = _world()
  assert run_tool(world, "get(kel,age)") == "40"
  assert run_tool(world, "  get ( kel ,  city ) ") == "oslo"
  assert run_tool(world, "get(kel,boss)") == "bim"
  assert run_tool(world, "calc(40+51)") == "91"
  assert run_tool(world, "calc( (2+3) * 4 )") == "20"
  assert run_tool(world, "get(zed,age)") == agentic.ERR_UNKNOWN_ENTITY
  assert run_tool(world, "get(kel,height)") == agentic.ERR_UNKNOWN_ATTRIBUTE
  assert run_tool(world, "get(kel)") == agentic.ERR_GET_ARGS
  assert run_tool(world, "get(kel,age,city)") == agentic.ERR_GET_ARGS
  assert run_tool(world, "set(kel,age)") == agentic.ERR_UNKNOWN_TOOL
  assert run_tool(world, "get kel age") == agentic.ERR_BAD_CALL
  assert run_tool(world, "get(kel,age") == agentic.ERR_BAD_CALL
  assert run_tool(world, "") == agentic.ERR_BAD_CALL
  assert run_tool(world, "get(" + "k" * 500 + ",age)") == agentic.ERR_CALL_TOO_LONG
  assert run_tool(world, "calc(1/0)").startswith(agentic.ERR_CALC)
  assert run_tool(world, "calc(" + str(10**200) + ")") == agentic.ERR_CALL_TOO_LONG
  assert run_tool(world, "calc(" + str(10**50) + ")") == agentic.ERR_CALC + "number too big"
  assert run_tool(world, "calc(99999*99999*99999)") == agentic.ERR_CALC + "overflow"
  assert run_tool(world, "get(__class__,age)") == agentic.ERR_UNKNOWN_ENTITY


def _example(max_turns_task: AgenticTask | None = None) -> tuple[AgenticTask, Example]:
  task = max_turns_task or AgenticTask()
  return task, task.sample(7)


def test_env_errors_are_observations():
  task, example = _example()
  env = task.environment(example)
  for turn in ("<|call|>nope(1)<|/call|>", "<|call|>get(zzzzzz,age)<|/call|>",
               "<|call|><|call|>get(a,b)<|/call|>"):
    result = env.step(turn)
    assert not result.done and result.reward == 0.0
    assert result.observation.startswith(RESULT_START + "error")
    assert result.observation.endswith(RESULT_END)


def test_env_recovers_after_error():
  task = AgenticTask(max_turns=6)
  for seed in range(50):
    example = task.sample(seed)
    turns = ["<|call|>oops<|/call|>"] + policy_turns(example.demonstration)
    if len(turns) > task.max_turns:
      continue
    episode = _run_episode(task, example, _scripted(turns))
    assert episode.done and episode.reward == 1.0


def test_env_executes_first_call_only():
  task, example = _example()
  env = task.environment(example)
  name = sorted(example.meta["world"])[0]
  record = example.meta["world"][name]
  turn = (f"think {CALL_START} get( {name} , age ) {CALL_END}"
          f"{CALL_START}get({name},city){CALL_END}" * 1000)
  result = env.step(turn)
  assert result.observation == RESULT_START + str(record["age"]) + RESULT_END
  assert not result.done


def test_env_truncated_turn_ends_episode():
  task, example = _example()
  for turn in ("", "some thoughts", CALL_START + "get(kel,", "get(kel,age)" + CALL_END,
               RESULT_START + "1" + RESULT_END):
    env = task.environment(example)
    result = env.step(turn)
    assert result.done and result.reward == 0.0 and result.observation == ""
    # Steps after the end keep returning done without reward.
    again = env.step(example.demonstration)
    assert again.done and again.reward == 0.0


def test_env_answer_ends_episode():
  task, example = _example()
  answer = example.meta["answer"]
  assert task.environment(example).step(ANSWER_MARKER + answer).reward == 1.0
  assert task.environment(example).step(ANSWER_MARKER + answer + EOS_MARKER).reward == 1.0
  # An answer wins over a call in the same turn.
  env = task.environment(example)
  result = env.step(CALL_START + "get(a,age)" + CALL_END + ANSWER_MARKER + answer)
  assert result.done and result.reward == 1.0
  result = task.environment(example).step(ANSWER_MARKER + answer + "0")
  assert result.done and result.reward == 0.0


@pytest.mark.parametrize("max_turns", [4, 5, 8])
def test_turn_limit_ends_episode(max_turns):
  task = AgenticTask(max_turns=max_turns)
  example = task.sample(3)
  name = sorted(example.meta["world"])[0]
  env = task.environment(example)
  call = f"{CALL_START}get({name},age){CALL_END}"
  for turn in range(1, max_turns):
    result = env.step(call)
    assert not result.done and result.turn == turn and result.observation
  result = env.step(call)
  assert result.done and result.reward == 0.0 and result.turn == max_turns
  # A correct answer after the limit gets nothing.
  assert env.step(ANSWER_MARKER + example.meta["answer"]).reward == 0.0
  # An episode stops a policy that never answers.
  episode = _run_episode(task, example, lambda context: call)
  assert episode.done and episode.reward == 0.0 and episode.turns == max_turns
  assert episode.transcript.count(RESULT_START) == max_turns - 1


def test_policy_turns():
  assert policy_turns("") == [""]
  assert policy_turns("a" + RESULT_START + "x" + RESULT_END + "b") == ["a", "b"]
  assert policy_turns("a" + RESULT_START + "x") == ["a"]


# ------------------------------------------------------------------------------ fuzz

_PIECES = (list(SPECIAL_MARKERS) * 3 + ["get(", "calc(", "(", ")", ",", " ", "\n", "age",
           "city", "boss", "score", "kel", "1", "-", "*", "+", "9" * 30, "\u00e9", "\u2603",
           "\U0001f600", "\x00", "\ud800", "\u0661", "\uff11"] +
           [chr(c) for c in range(32, 127)])


def _random_turn(rng: random.Random, names: list[str]) -> str:
  """Returns a random (mostly hostile) policy turn."""
  pieces = _PIECES + names
  return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))


def _adversarial_turns(names: list[str]) -> list:
  """Returns hand-made hostile turns (and non-str values)."""
  name = names[0]
  huge = "a" * 10_000_000
  deep = "(" * 10_000 + "1" + ")" * 10_000
  return [
      None, 12, 3.5, b"\xff\xfe" * 100, ["list"], object(), "", huge,
      CALL_START * 2_000_000, CALL_END * 1_000_000, RESULT_START * 1_000_000,
      ANSWER_MARKER * 1_000_000, ANSWER_MARKER + "9" * 10_000_000,
      huge + ANSWER_MARKER + "1", CALL_START + huge, CALL_START + "get(" + huge,
      CALL_START + "calc(" + deep + ")" + CALL_END,
      CALL_START + "calc(" + str(10**200) + ")" + CALL_END,
      CALL_START + "calc(" + "9" * 5000 + "*" + "9" * 5000 + ")" + CALL_END,
      CALL_START + "calc(" + "-" * 100_000 + "1)" + CALL_END,
      CALL_START + "calc(" + "1+" * 100_000 + "1)" + CALL_END,
      (CALL_START + f"get({name},age)" + CALL_END) * 100_000,
      CALL_START + CALL_START + f"get({name},age)" + CALL_END + CALL_END,
      CALL_START + f"get({name},{ANSWER_MARKER}1)" + CALL_END,
      CALL_START + f"get({name}," + RESULT_START + "age" + RESULT_END + ")" + CALL_END,
      CALL_START + "get(k\u00e9l,\u00e2ge)" + CALL_END, CALL_START + "calc(\u0661+1)" + CALL_END,
      CALL_START + "get(\ud800,age)" + CALL_END, CALL_START + "\x00" * 100 + CALL_END,
      CALL_START + "get(" + "," * 100_000 + ")" + CALL_END,
      CALL_START + "get" + "(" * 100 + ")" * 100 + CALL_END,
      CALL_START + "calc(__import__('os').system('true'))" + CALL_END,
      CALL_START + f"get({name},__dict__)" + CALL_END,
      "\u2603" * 5_000_000, "\U0001f600" + ANSWER_MARKER + "\U0001f600",
  ]


def _check_result(result: StepResult) -> None:
  """Asserts the StepResult invariants."""
  assert isinstance(result, StepResult)
  assert result.reward in (0.0, 1.0)
  if result.done:
    assert result.observation == ""
  else:
    assert result.reward == 0.0
    assert result.observation.startswith(RESULT_START)
    assert result.observation.endswith(RESULT_END)
    inner = result.observation[len(RESULT_START):-len(RESULT_END)]
    assert len(inner) <= 64 and _is_clean(inner) and _strip_markers(inner) == inner


def test_fuzz_env_and_reward():
  task = AgenticTask()
  rng = random.Random(123)
  max_seconds = 0.0
  calls = 0
  for seed in range(20):
    example = task.sample(seed)
    names = sorted(example.meta["world"])
    turns = _adversarial_turns(names) if seed < 3 else []
    turns += [_random_turn(rng, names) for _ in range(150)]
    turns += [CALL_START + rng.choice(["get(", "calc(", ""]) + _random_turn(rng, names)
              + rng.choice([")", ""]) + CALL_END for _ in range(150)]
    env = task.environment(example)
    for turn in turns:
      start = time.perf_counter()
      result = task.environment(example)._step(turn)  # Unguarded: exceptions surface.
      _check_result(result)
      if env.done:
        env = task.environment(example)
      _check_result(env._step(turn))
      score = task.reward(example, turn)
      assert score in (0.0, 1.0)
      max_seconds = max(max_seconds, time.perf_counter() - start)
      calls += 1
  print(f"\nfuzz: {calls} turns (env x2 + reward each), max {max_seconds * 1000:.2f} ms")
  assert max_seconds < TIME_BOUND_S


def test_fuzz_run_episode_with_random_policy():
  task = AgenticTask()
  rng = random.Random(5)
  max_seconds = 0.0
  for seed in range(300):
    example = task.sample(seed)
    names = sorted(example.meta["world"])
    start = time.perf_counter()
    episode = _run_episode(task, example, lambda context: CALL_START
                           + _random_turn(rng, names) + CALL_END)
    max_seconds = max(max_seconds, time.perf_counter() - start)
    assert episode.turns <= task.max_turns and episode.reward in (0.0, 1.0)
  print(f"\nrandom-policy episodes: max {max_seconds * 1000:.2f} ms")
  assert max_seconds < TIME_BOUND_S
