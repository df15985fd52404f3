"""Several valid demonstrations per problem: every sampled path is valid, scores 1, and has
choices; malformed variants score 0; diversity and spacing 0 give the canonical
demonstration."""

import re

import pytest

from bebop_jax import tasks
from bebop_jax.tasks import agentic, base
from bebop_jax.tasks import code_lang as lang
from bebop_jax.tasks import code as code_task

DIVERSITY, SPACING = 0.7, 0.5
EXTRA = {"math": {"restate": 0.35}, "agentic": {"confirm": 0.35}, "code": {}}
NUM_PROBLEMS, NUM_SEEDS = 150, 24


def _variants(task, ex):
  return [task.demonstration(ex, seed) for seed in range(NUM_SEEDS)]


def _value(line: str) -> int:
  # Independent reference: Python's evaluation of the arithmetic text.
  text = line.replace(" ", "")
  assert set(text) <= set("0123456789+-*()"), line
  return eval(text, {"__builtins__": {}})  # pylint: disable=eval-used


def _ops(text: str) -> int:
  """Binary operators in an expression text ('-' after an operator or '(' is a sign)."""
  text = text.replace(" ", "")
  return sum(c in "+*" or (c == "-" and i > 0 and text[i - 1] not in "+-*(")
             for i, c in enumerate(text))


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_most_problems_have_three_or_more_valid_paths(name):
  task = tasks.get_task(name, diversity=DIVERSITY, spacing=SPACING, **EXTRA[name])
  counts = []
  for seed in range(NUM_PROBLEMS):
    ex = task.sample(seed)
    variants = _variants(task, ex)
    assert all(task.reward(ex, v) == 1.0 for v in variants)
    assert task.demonstration(ex, 3) == task.demonstration(ex, 3)  # deterministic
    counts.append(len(set(variants)))
  assert sum(c >= 3 for c in counts) >= 0.8 * NUM_PROBLEMS, counts


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_diversity_zero_is_the_canonical_demonstration(name):
  task = tasks.get_task(name)
  ex = task.sample(0)
  assert {task.demonstration(ex, s) for s in range(5)} == {ex.demonstration}


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_spacing_is_one_style_per_demonstration(name):
  task = tasks.get_task(name, spacing=0.5)
  styles = set()
  for seed in range(NUM_PROBLEMS):
    ex = task.sample(seed)
    for variant in _variants(task, ex)[:4]:
      policy_text = variant.split(base.ANSWER_MARKER)[0]
      if name == "agentic":
        policy_text = "".join(agentic.demonstration_calls(variant))
      if name == "code":  # the trace's lists (programs keep their own spaces)
        policy_text = "".join(re.findall(r"\[[^\]]*\]", policy_text))
      assert task.reward(ex, variant) == 1.0
      assert variant.replace(" ", "") == ex.demonstration.replace(" ", "")  # only spaces
      spaced = re.findall(r"[,+*] |  ?- ", policy_text)
      tight = re.findall(r"[,+*][^ ]", policy_text) if name != "math" else re.findall(
          r"[0-9)][+*-]", policy_text)
      assert not (spaced and tight), variant  # never both styles in one demonstration
      styles.add(bool(spaced))
  assert styles == {True, False}


def test_math_paths_reduce_one_valid_operation_per_line():
  task = tasks.get_task("math", diversity=DIVERSITY, spacing=SPACING, max_operands=4,
                        **EXTRA["math"])
  for seed in range(NUM_PROBLEMS):
    ex = task.sample(seed)
    for variant in _variants(task, ex):
      *lines, answer = variant.split("\n")
      assert answer == base.ANSWER_MARKER + str(ex.meta["answer"])
      exprs = [line[1:] for line in lines]
      assert all(line.startswith("=") for line in lines)
      assert all(_value(e) == ex.meta["answer"] for e in exprs)
      previous = ex.meta["expression"]
      if _ops(exprs[0]) == _ops(previous):  # a restatement (commuted operands)
        previous = exprs.pop(0)
      for e in exprs:
        assert _ops(previous) - _ops(e) == 1, (previous, e)
        previous = e
      assert _ops(previous) == 0


def test_math_commutes_and_reorders_only_where_precedence_allows():
  from bebop_jax.tasks import math as math_task  # pylint: disable=g-import-not-at-top
  tokens = math_task.parse_tokens("2-3+4*5*1")
  # '-' at 1 (first), '*' at 5 and 7; '+' at 3 follows a '-' and precedes a '*': not yet.
  assert math_task.reducible_ops(tokens) == [1, 5, 7]
  assert math_task.render(math_task.reduce_at(math_task.parse_tokens("(1+2)*3"), 2)) == "3*3"
  assert math_task.parse_tokens("5+-3") == [5, "+", -3]


def test_code_variants_are_equivalent_programs_with_true_traces():
  task = tasks.get_task("code", diversity=DIVERSITY, spacing=SPACING, max_stages=2)
  rewritten = 0
  for seed in range(NUM_PROBLEMS):
    ex = task.sample(seed)
    for variant in _variants(task, ex):
      trace, answer = variant.split("\n" + base.ANSWER_MARKER)
      trace = re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace(" ", ""), trace)  # lists
      program = lang.parse_program(answer)
      rewritten += answer != ex.meta["program"]
      cases = ex.meta["shown"] + ex.meta["tests"]
      assert code_task.score_program(answer, cases) == 1.0
      start = [c["input"] for c in ex.meta["shown"]
               if trace.startswith(lang.format_value(c["input"]) + " ")]
      assert start and trace == code_task.trace_text(program, start[0])
  assert rewritten > NUM_PROBLEMS  # equivalent programs, not only other traces


def test_agentic_variants_replay_exactly_in_the_environment():
  task = tasks.get_task("agentic", diversity=DIVERSITY, spacing=SPACING, **EXTRA["agentic"])
  orders = set()
  for seed in range(NUM_PROBLEMS):
    ex = task.sample(seed)
    for variant in _variants(task, ex):
      turns = agentic.policy_turns(variant)
      results = re.findall(re.escape(base.RESULT_START) + "(.*?)" + re.escape(base.RESULT_END),
                           variant)
      env = task.environment(ex)
      for i, turn in enumerate(turns):
        step = env.step(turn)
        if i < len(turns) - 1:
          assert not step.done and step.observation == base.RESULT_START + results[i] + \
              base.RESULT_END
      assert step.done and step.reward == 1.0 and len(turns) <= task.max_turns
      orders.add(tuple(agentic.demonstration_calls(variant)) != tuple(
          agentic.demonstration_calls(ex.demonstration)))
  assert orders == {True, False}


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_malformed_variants_score_zero(name):
  task = tasks.get_task(name, diversity=DIVERSITY, spacing=SPACING, **EXTRA[name])
  for seed in range(40):
    ex = task.sample(seed)
    for variant in _variants(task, ex)[:6]:
      body, answer = variant.rsplit(base.ANSWER_MARKER, 1)
      assert task.reward(ex, body) == 0.0                       # no answer
      wrong = str(int(answer) + 1) if answer.lstrip("-").isdigit() else answer + " | rev | rev | take(0)"
      assert task.reward(ex, body + base.ANSWER_MARKER + wrong) < 1.0


def test_restatements_and_confirmations_have_their_own_knobs():
  math_task = tasks.get_task("math", diversity=1.0)
  restating = tasks.get_task("math", diversity=1.0, restate=1.0)
  ex = next(e for e in map(math_task.sample, range(50)) if _ops(e.meta["expression"]) >= 2)
  plain = {math_task.demonstration(ex, s).split("\n")[0] for s in range(NUM_SEEDS)}
  first = {restating.demonstration(ex, s).split("\n")[0] for s in range(NUM_SEEDS)}
  assert all(_ops(line[1:]) < _ops(ex.meta["expression"]) for line in plain)  # no restating
  assert all(_ops(line[1:]) == _ops(ex.meta["expression"]) for line in first)
  one_hop = lambda e: e.meta["kind"] == "one_hop"
  quiet, confirming = (tasks.get_task("agentic", diversity=1.0, confirm=c) for c in (0.0, 1.0))
  ex = next(e for e in map(quiet.sample, range(50)) if one_hop(e))
  assert {len(agentic.demonstration_calls(quiet.demonstration(ex, s)))
          for s in range(NUM_SEEDS)} == {1}
  assert {len(agentic.demonstration_calls(confirming.demonstration(ex, s)))
          for s in range(NUM_SEEDS)} == {2}
