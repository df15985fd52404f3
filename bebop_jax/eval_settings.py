"""Typed settings of `config.eval` (held-out evaluation by sampling, bebop_jax.evaluation) and
`config.report` (the evaluation stage, bebop_jax.stages.eval; bebop_jax.stages.report renders it)
(bebop_jax.settings_base)."""

from __future__ import annotations

import dataclasses

from bebop_jax.settings_base import (Section, count, int_at_least, is_number,
                                     number_at_least, positive_int, setting, tuple_of)


_POSITIVE_INTS = tuple_of(int_at_least(1, bools=True))


def _increasing(buckets) -> bool:
  return _POSITIVE_INTS(buckets) and list(buckets) == sorted(set(buckets))


@dataclasses.dataclass(frozen=True)
class EvalSettings(Section):
  """config.eval: pass@1 per task at each temperature, and the rollout shapes every
  evaluation and benchmark shares."""
  KEY = "eval"
  num_examples: int = positive_int(64, "held-out prompts per task")
  temperatures: tuple[float, ...] = setting(
      (0.0, 1.0), "pass@1 is measured at each of these sampling temperatures",
      allowed="must be a non-empty tuple of numbers >= 0", check=tuple_of(number_at_least(0)))
  batch_size: int = positive_int(32, "rows per decoding call")
  max_new_tokens: int = positive_int(160, "completion budget (policy turns and replies)")
  top_k: int = count(0, "sample from the k most likely tokens", note=" (0 = off)")
  top_p: float = setting(1.0, "sample from the smallest set of tokens holding this much "
                         "probability", allowed="must be in (0, 1]",
                         check=lambda v: 0 < v <= 1)
  prompt_buckets: tuple[int, ...] = setting(
      (16, 32, 64, 128, 256, 512, 1024), "prompts (and contexts) are right-padded to the "
      "smallest of these: one compile per bucket. Whole rollouts (a prompt of up to "
      "rl.max_prompt_len tokens and its completion) are padded to one too (teacher-forced "
      "acceptance)", allowed="must be a non-empty increasing tuple of positive ints",
      check=_increasing)


@dataclasses.dataclass(frozen=True)
class ReportSettings(Section):
  """config.report: the evaluation stage's measurements of the policy the job ends with,
  its decode speed and acceptance against entropy."""
  KEY = "report"
  batch_sizes: tuple[int, ...] = setting(
      (1, 8), "speculative vs autoregressive wall clock at these batch sizes",
      allowed="must be a non-empty tuple of positive ints", check=_POSITIVE_INTS)
  num_prompts: int = positive_int(32, "held-out prompts per measurement (batch 1: one by "
                                  "one)")
  repeats: int = positive_int(2, "timed passes per arm, interleaved (the ratio: their "
                              "geometric mean with a 95% interval over passes)")
  entropy_temperatures: tuple[float, ...] = setting(
      (1.0, 1.5, 2.0), "re-scoring temperatures for the fit of acceptance against entropy",
      allowed="must be a non-empty tuple of numbers > 0",
      check=tuple_of(lambda t: is_number(t) and t > 0))
  progress: bool = setting(True, "progress bars with ETA over the stage's long phases")
