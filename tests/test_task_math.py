import random
import time

import pytest

from bebop_jax import tasks
from bebop_jax.tasks import base
from bebop_jax.tasks.math import MathTask


def _reference_value(expression: str) -> int:
  # Independent reference: Python's own evaluation of our generated arithmetic strings
  # (operands, + - *, parentheses and negative literals only).
  assert set(expression) <= set("0123456789+-*()")
  return eval(expression, {"__builtins__": {}})  # pylint: disable=eval-used


@pytest.mark.parametrize("knobs", [{}, {"max_operands": 6, "max_value": 99},
                                   {"operators": "*", "paren_prob": 1.0}])
def test_demonstrations_are_correct_and_score_one(knobs):
  task = tasks.get_task("math", **knobs)
  for seed in range(500):
    ex = task.sample(seed)
    assert ex.meta["answer"] == _reference_value(ex.meta["expression"])
    assert task.reward(ex, ex.demonstration) == 1.0
    assert task.reward(ex, ex.demonstration + base.EOS_MARKER + "junk") == 1.0
    # Every step line is an expression with the same value.
    for line in ex.demonstration.split("\n")[:-1]:
      assert line.startswith("=")
      assert _reference_value(line[1:]) == ex.meta["answer"]


def test_steps_reduce_one_operation_each():
  ex = MathTask().sample(0)
  lines = [l[1:] for l in ex.demonstration.split("\n")[:-1]]
  exprs = [ex.meta["expression"]] + lines
  count_ops = lambda s: sum(c in "+*" for c in s) + sum(
      1 for i, c in enumerate(s) if c == "-" and i > 0 and s[i - 1] not in "+-*(")
  for before, after in zip(exprs, exprs[1:]):
    assert count_ops(before) - count_ops(after) == 1


def test_deterministic_and_varied():
  task = MathTask()
  assert task.sample(3) == task.sample(3)
  prompts = {task.sample(s).prompt for s in range(200)}
  assert len(prompts) > 100


def test_wrong_answers_score_zero():
  task = MathTask()
  ex = task.sample(1)
  answer = ex.meta["answer"]
  for completion in ["", "no marker", f"{base.ANSWER_MARKER}{answer + 1}",
                     f"{base.ANSWER_MARKER} {answer}0", f"{base.ANSWER_MARKER}",
                     f"{base.ANSWER_MARKER}{answer}.0", f"{answer}"]:
    assert task.reward(ex, completion) == 0.0
  assert task.reward(ex, f"blah {base.ANSWER_MARKER} {answer} ") == 1.0


def test_bad_knobs_are_clear_errors():
  with pytest.raises(ValueError, match="operators"):
    tasks.get_task("math", operators="/")
  with pytest.raises(ValueError, match="unexpected keyword|bad knobs"):
    tasks.get_task("math", max_opperands=3)
  with pytest.raises(ValueError, match="unknown task 'physics'"):
    tasks.get_task("physics")


def test_reward_fuzz_never_raises_and_is_fast():
  task = MathTask()
  ex = task.sample(0)
  rng = random.Random(0)
  alphabet = "0123456789+-*() \n" + base.ANSWER_MARKER + base.EOS_MARKER
  inputs = [base.ANSWER_MARKER + "9" * 10_000_000, base.ANSWER_MARKER * 100_000,
            "(" * 100_000, None, 12, b"\xff\xfe" + base.ANSWER_MARKER.encode(),
            base.ANSWER_MARKER + "-" * 50, base.ANSWER_MARKER + "\u0663"]
  inputs += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
             for _ in range(3000)]
  worst = 0.0
  for text in inputs:
    start = time.perf_counter()
    r = task.reward(ex, text)
    worst = max(worst, time.perf_counter() - start)
    assert r in (0.0, 1.0)
  assert worst < 0.1, worst
