"""Policy evaluation by sampling: per-task pass@1 through a rollout engine.

One rollout per held-out example (the agentic task with its environment in the loop), scored
by the task's reward; pass@1 is the fraction of prompts whose one sample solves them (reward
1: for code, every held-out test case passes), and `mean_reward` the mean reward (for code,
the mean fraction of test cases passed; for the binary tasks the same as pass@1). Each task is sampled with its own key, derived from
the seed and the task, so a task's numbers do not depend on which other tasks are evaluated.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import collections
import math

import jax
import numpy as np

from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.data.tokenizer import BaseTokenizer
from bebop_jax.rollout import RolloutEngine, Rollouts


def task_rng(seed: int, task: str) -> jax.Array:
  """The sampling key of one task's evaluation."""
  return jax.random.key(seed + 1000 * tasks_lib.TASK_NAMES.index(task))


def rollouts_by_task(engine: RolloutEngine,
                     examples: Mapping[str, Sequence[tasks_lib.Example]], *, seed: int,
                     on_task: Callable[[int], Any] | None = None) -> dict[str, Rollouts]:
  """{task: one rollout per example}; `on_task(number of examples)` after each task (a
  progress bar's update)."""
  out = {}
  for name, exs in examples.items():
    out[name] = engine.generate(list(exs), task_rng(seed, name))
    if on_task is not None:
      on_task(len(exs))
  return out


def pass_at_1(rollouts: Mapping[str, Rollouts]) -> dict[str, float]:
  """{task: fraction of rollouts that solve their example (tasks.solved)}."""
  return {name: float(tasks_lib.solved(r.rewards).mean()) if r.num_rows else 0.0
          for name, r in rollouts.items()}


def mean_reward(rollouts: Mapping[str, Rollouts]) -> dict[str, float]:
  """{task: mean reward} (for code, the mean fraction of held-out test cases passed)."""
  return {name: float(r.rewards.mean()) if r.num_rows else 0.0 for name, r in rollouts.items()}


def standard_error(values: np.ndarray) -> float:
  """Standard error of the mean of `values` (sample std / sqrt(n); 0 for n < 2)."""
  values = np.asarray(values, float)
  return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def evaluate_tasks(engines: Mapping[float, RolloutEngine],
                   examples: Mapping[str, Sequence[tasks_lib.Example]], *, seed: int
                   ) -> dict[str, float]:
  """pass@1 per task and temperature: {"<task>/t<temperature>": fraction solved}, given one
  engine per temperature."""
  results = {}
  for temperature, engine in engines.items():
    for name, value in pass_at_1(rollouts_by_task(engine, examples, seed=seed)).items():
      results[f"{name}/t{temperature:g}"] = value
  return results


ENTROPY_THRESHOLD = 0.5           # nats: a position above it is a fork
ENTROPY_BIN_EDGES = tuple(np.round(np.linspace(0.0, 3.0, 31), 3).tolist())  # nats


def entropy_stats(rollouts: Mapping[str, Rollouts]) -> dict[str, dict]:
  """Per task: the policy's per-token entropy over the sampled tokens of `rollouts`: mean,
  the fraction of positions above ENTROPY_THRESHOLD, a histogram over ENTROPY_BIN_EDGES
  (the last bin takes everything above), and the number of positions."""
  out = {}
  for name, r in rollouts.items():
    ent = r.entropy[r.policy_mask]
    counts, _ = np.histogram(np.minimum(ent, ENTROPY_BIN_EDGES[-1]), bins=ENTROPY_BIN_EDGES)
    out[name] = {"mean": float(ent.mean()) if ent.size else 0.0,
                 "above_threshold": float((ent > ENTROPY_THRESHOLD).mean()) if ent.size
                 else 0.0,
                 "histogram": counts.tolist(), "positions": int(ent.size)}
  return out


def demonstration_entropy(task, examples, num_samples: int, *,
                          tokenizer: BaseTokenizer) -> dict[str, float]:
  """The entropy of a task's sampled demonstrations themselves: per example `num_samples`
  paths from `task.demonstration` (as `tokenizer` encodes completions), and at every policy
  position of every path (tool results left out) the entropy of the next token among the
  paths sharing its prefix (a plug-in estimate, biased low for few samples). Returns the
  mean and the fraction of positions above ENTROPY_THRESHOLD."""
  tok = tokenizer
  ents = []
  for ex in examples:
    seqs = [tuple(tok.encode_completion(task.demonstration(ex, s)))
            for s in range(num_samples)]
    nexts = collections.defaultdict(collections.Counter)  # prefix -> next-token counts
    for seq in seqs:
      for i, t in enumerate(seq):
        nexts[seq[:i]][t] += 1
    for seq in seqs:
      policy = ~pipeline.tool_result_mask(np.array(seq), tok)
      for i in range(len(seq)):
        if policy[i]:
          counts = nexts[seq[:i]].values()
          total = sum(counts)
          ents.append(-sum(c / total * math.log(c / total) for c in counts))
  e = np.array(ents)
  return {"mean": float(e.mean()),
          "above_threshold": float((e > ENTROPY_THRESHOLD).mean())}
