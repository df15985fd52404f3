"""Choosing the draft length K from live acceptance and measured cost (the decision rule of an
adaptive speculative decoder).

An iteration with K drafts emits 1 + sum_{k<=K} prod_{j<=k} alpha_j tokens in expectation
(alpha_j: the acceptance rate of depth j given the earlier ones were accepted) and costs
c(K, rows, cache bucket) seconds; K = 0 is the plain autoregressive step (one token, no
drafting, no verification). The rule picks the K of the highest expected tokens per second.

  AcceptanceEstimate: per-depth acceptance as an exponential moving average over the
    iterations seen so far, seeded from the drafter's measured acceptance;
  CostTable: seconds per iteration by (K, live rows, cache bucket), measured in-process;
    rows between measured sizes take the next larger measured one (a batch is padded up
    to its bucket);
  choose_k(estimate, table, rows, bucket, k_max) -> K.

The choice depends only on the past (acceptance already observed, costs measured before),
so switching K between iterations leaves the output law unchanged: every iteration is an
exact speculative step for whichever K it runs.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

import numpy as np


def expected_tokens(alphas: Sequence[float], k: int) -> float:
  """1 + sum_{j<=k} prod_{i<=j} alpha_i: tokens one iteration with k drafts emits in
  expectation (k = 0: one autoregressive token)."""
  if not 0 <= k <= len(alphas):
    raise ValueError(f"k={k} is not allowed: must be in [0, {len(alphas)}]")
  return float(1.0 + np.sum(np.cumprod(np.asarray(alphas[:k], np.float64))))


@dataclasses.dataclass
class AcceptanceEstimate:
  """Per-depth acceptance, an exponential moving average with weight `smoothing` on each new
  observation (accepted / attempted of one iteration or segment, where attempted > 0)."""
  alphas: np.ndarray
  smoothing: float = 0.2

  def __post_init__(self):
    self.alphas = np.clip(np.asarray(self.alphas, np.float64), 0.0, 1.0)
    if not 0 < self.smoothing <= 1:
      raise ValueError(f"smoothing={self.smoothing} is not allowed: must be in (0, 1]")

  def update(self, accepted: Sequence[int], attempted: Sequence[int]) -> None:
    accepted = np.asarray(accepted, np.float64)
    attempted = np.asarray(attempted, np.float64)
    if accepted.shape != self.alphas.shape or attempted.shape != self.alphas.shape:
      raise ValueError(f"accepted {accepted.shape} and attempted {attempted.shape} must have "
                       f"one entry per depth {self.alphas.shape}")
    seen = attempted > 0
    rate = np.where(seen, accepted / np.maximum(attempted, 1), self.alphas)
    self.alphas = np.where(seen, (1 - self.smoothing) * self.alphas + self.smoothing * rate,
                           self.alphas)


@dataclasses.dataclass
class CostTable:
  """Seconds per iteration, {(k, rows, bucket): seconds}, measured in-process."""
  seconds: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)

  def add(self, k: int, rows: int, bucket: int, seconds: float) -> None:
    if seconds <= 0:
      raise ValueError(f"seconds={seconds} must be > 0")
    self.seconds[(int(k), int(rows), int(bucket))] = float(seconds)

  def lookup(self, k: int, rows: int, bucket: int) -> float:
    """The cost of k drafts at the smallest measured batch >= rows (the largest when rows
    exceeds them all) and the smallest measured bucket >= bucket (likewise)."""
    entries = [(r, b) for (kk, r, b) in self.seconds if kk == k]
    if not entries:
      raise KeyError(f"no cost measured for k={k}")
    pick = lambda values, want: values[min(bisect.bisect_left(values, want), len(values) - 1)]
    r = pick(sorted({r for r, _ in entries}), rows)
    b = pick(sorted({b for rr, b in entries if rr == r}), bucket)
    return self.seconds[(k, r, b)]

  def to_json(self) -> list[dict]:
    return [{"k": k, "rows": r, "bucket": b, "seconds": s}
            for (k, r, b), s in sorted(self.seconds.items())]


def choose_k(estimate: AcceptanceEstimate, table: CostTable, rows: int, bucket: int,
             k_max: int) -> int:
  """The K in 0..k_max of the most expected tokens per second (ties: the smaller K)."""
  best_k, best_rate = 0, -1.0
  for k in range(k_max + 1):
    rate = expected_tokens(estimate.alphas, k) / table.lookup(k, rows, bucket)
    if rate > best_rate * (1 + 1e-12):
      best_k, best_rate = k, rate
  return best_k
