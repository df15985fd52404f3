"""The demonstrations' own entropy (evaluation.demonstration_entropy) against hand counts."""

import math

import pytest

from bebop_jax import evaluation, tasks
from bebop_jax.data import load_tokenizer

CHAR = load_tokenizer("char")


class _TwoPaths:
  """Paths 'ab' or 'ac' with equal frequency: one fork of ln 2 at the second token."""

  def demonstration(self, example, seed):
    del example
    return "ab" if seed % 2 else "ac"


def test_one_even_fork_is_ln2_at_its_position():
  out = evaluation.demonstration_entropy(_TwoPaths(), [None], num_samples=8,
                                         tokenizer=CHAR)
  positions = len(CHAR.encode("ab", add_eos=True))  # a, b|c, eos
  assert out["mean"] == pytest.approx(math.log(2) / positions)
  assert out["above_threshold"] == pytest.approx(1 / positions)


def test_canonical_demonstrations_carry_no_entropy():
  task = tasks.get_task("agentic")
  out = evaluation.demonstration_entropy(task, [task.sample(i) for i in range(3)], 4,
                                         tokenizer=CHAR)
  assert out == {"mean": 0.0, "above_threshold": 0.0}
