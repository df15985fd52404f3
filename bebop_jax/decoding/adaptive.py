"""Choosing the draft length K from live acceptance and measured cost: the decision rule of
the adaptive speculative decoder (decoding/segments.py runs it).

An iteration with K drafts emits 1 + sum_{k<=K} prod_{j<=k} alpha_j tokens in expectation
(alpha_j: the acceptance rate of depth j given the earlier ones were accepted) and costs
c(K, rows, cache bucket) seconds; K = 0 is the plain autoregressive step (one token, no
drafting, no verification). The rule picks the K of the highest expected tokens per second.

  AcceptanceEstimate: per-depth acceptance as an exponential moving average over the
    iterations seen so far, seeded from the drafter's measured acceptance;
  CostTable: seconds per iteration by (K, live rows, cache bucket), measured in-process
    (segments.calibrate) or modelled from weight reads (`weight_read_costs`); rows between
    measured sizes take the next larger measured one (a batch is padded up to its bucket);
    every full segment a decoder runs moves its K's entry towards the time it took
    (`CostTable.observe`), so a table skewed by a burst of load elsewhere is corrected as
    the run goes;
  choose_k(estimate, table, rows, bucket, k_max) -> K.

A call's first K is chosen by the whole call's cost instead (`choose_first_k`,
`CostTable.call_seconds`: the prefill, a segment call's fixed cost, the depth caches' start
cost and the expected iterations) plus what measured calls that began with that K took
beyond the model (`CostTable.call_residual`), so at small batch, where a call is short and
mostly fixed costs the per-iteration table does not see, a K that loses in practice stops
being chosen. A single-turn call's measurement waits in the table (`CostTable.pending`)
until the next call settles it while its own program runs (`CostTable.settle`), and that
call plans the first K of the one after (`CostTable.planned`).

The choice depends only on the past (acceptance already observed, costs measured before),
so switching K between iterations leaves the output law unchanged: every iteration is an
exact speculative step for whichever K it runs.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
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
  observation (accepted / attempted of one iteration or segment, where attempted > 0).
  `measured` False (a seed that was not measured, e.g. optimistic ones) lets the first
  observation of each depth replace its seed."""
  alphas: np.ndarray
  smoothing: float = 0.2
  measured: bool = True

  def __post_init__(self):
    self.alphas = np.clip(np.asarray(self.alphas, np.float64), 0.0, 1.0)
    self._seen = np.full(self.alphas.shape, bool(self.measured))
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
    weight = np.where(self._seen, self.smoothing, 1.0)
    self.alphas = np.where(seen, (1 - weight) * self.alphas + weight * rate, self.alphas)
    self._seen |= seen


CALL_WINDOW = 8  # the recent calls per first K whose misses `CostTable.call_residual` reads


@dataclasses.dataclass(frozen=True)
class PendingCall:
  """A finished single-turn call's measurement, not yet in the table (`CostTable.settle`):
  its first K, its timed span (from its dispatch to its lengths on the host), its rows'
  completion lengths, its shapes, the iterations it ran at each K and the weight of its
  mean length in `CostTable.tokens_per_row` (the acceptance smoothing)."""
  k: int
  start: float
  end: float
  lengths: np.ndarray
  rows: int
  bucket: int
  k_iterations: dict[int, int]
  weight: float


@dataclasses.dataclass
class CostTable:
  """Seconds per iteration, {(k, rows, bucket): seconds}, measured in-process, and the fixed
  seconds of one segment call (dispatch and the host round trip), {rows: seconds}."""
  seconds: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
  overhead: dict[int, float] = dataclasses.field(default_factory=dict)
  # The extra fixed seconds of a call's first segment with k drafts over one without, at
  # `rows` rows ({(k, rows): seconds}): the depth caches computed over the prompt.
  start: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
  # Tokens a row emits per call, an exponential moving average over the calls run so far
  # (None before the first): what a first segment's start cost is spread over.
  tokens_per_row: float | None = None
  # Seconds of the prefill of a call of these shapes (measured once): the part of a call
  # that no K changes.
  prefill: float = 0.0
  # What the rule's model of a whole call misses, per first K: a call's measured seconds
  # less the model's for the iterations it ran, for the last CALL_WINDOW calls that began
  # with K ({k: [seconds]}), and how many calls began with each K.
  call_misses: dict[int, list[float]] = dataclasses.field(default_factory=dict)
  calls: dict[int, int] = dataclasses.field(default_factory=dict)
  # The last call's measurement, settled during the next call (`settle`), and the next
  # call's first (K, iterations), chosen during the last one ({its acceptance seed: plan}).
  pending: PendingCall | None = None
  planned: dict = dataclasses.field(default_factory=dict)
  # Derived, rebuilt when `seconds` changes: the entry `lookup` reads for (k, rows,
  # bucket), and `call_model`'s terms.
  _resolved: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _call_terms: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def add(self, k: int, rows: int, bucket: int, seconds: float) -> None:
    if seconds <= 0:
      raise ValueError(f"seconds={seconds} must be > 0")
    self.seconds[(int(k), int(rows), int(bucket))] = float(seconds)
    self._resolved.clear()
    self._call_terms.clear()

  def _entry(self, k: int, rows: int, bucket: int) -> tuple[int, int, int] | None:
    """The key of `seconds` that (k, rows, bucket) reads (None: no entry for k)."""
    key = (k, rows, bucket)
    if key not in self._resolved:
      entries = [(r, b) for (kk, r, b) in self.seconds if kk == k]
      if not entries:
        return None
      r = _at_least(sorted({r for r, _ in entries}), rows)
      self._resolved[key] = (k, r, _at_least(sorted({b for rr, b in entries if rr == r}),
                                             bucket))
    return self._resolved[key]

  def lookup(self, k: int, rows: int, bucket: int) -> float:
    """The cost of k drafts at the smallest measured batch >= rows (the largest when rows
    exceeds them all) and the smallest measured bucket >= bucket (likewise)."""
    entry = self._entry(k, rows, bucket)
    if entry is None:
      raise KeyError(f"no cost measured for k={k}")
    return self.seconds[entry]

  def observe(self, k: int, rows: int, bucket: int, seconds: float, weight: float) -> None:
    """Moves the entry `lookup(k, rows, bucket)` reads towards `seconds` per iteration seen
    in a live segment of that batch (an exponential moving average of weight `weight`), so
    a calibration that noise skewed is corrected by the loop's own timings."""
    entry = self._entry(k, rows, bucket)
    if entry is None or seconds <= 0:
      return
    self.seconds[entry] = (1 - weight) * self.seconds[entry] + weight * seconds
    self._call_terms.clear()

  def start_cost(self, k: int, rows: int) -> float:
    """`start` at the smallest measured batch >= rows (0 where none was measured)."""
    sizes = sorted({r for kk, r in self.start if kk == k})
    return self.start[(k, _at_least(sizes, rows))] if sizes else 0.0

  def call_seconds(self, k: int, rows: int, bucket: int, alphas: Sequence[float],
                   call_tokens: float) -> float:
    """The modelled seconds of a call of `rows` rows that emits `call_tokens` per row with
    K = k throughout: the prefill, one segment call's fixed cost, K's start cost and
    call_tokens / E(K) iterations."""
    fixed, per_token = self.call_model(rows, bucket, tuple(alphas), k)
    return fixed[k] + max(call_tokens, 1.0) * per_token[k]

  def call_model(self, rows: int, bucket: int, alphas: tuple[float, ...], k_max: int
                 ) -> tuple[list[float], list[float]]:
    """`call_seconds`' terms for K = 0..k_max: the fixed seconds of a call beginning with K
    and the seconds per emitted token, c(K) / E(K), kept until `add` or `observe` changes
    a cost (a call's first choice reads them on every call; `overhead` and `start` are set
    by the calibration, before any choice)."""
    key = (rows, bucket, alphas, k_max, self.prefill)
    if key not in self._call_terms:
      self._call_terms[key] = (
          [self.fixed_call_seconds(k, rows) for k in range(k_max + 1)],
          [self.lookup(k, rows, bucket) / expected_tokens(alphas, k)
           for k in range(k_max + 1)])
    return self._call_terms[key]

  def call_overhead(self, rows: int) -> float:
    """`overhead` (one segment call's fixed seconds) at the smallest measured batch >= rows
    (the largest when rows exceeds them all; 0 where none was measured)."""
    return self.overhead[_at_least(sorted(self.overhead), rows)] if self.overhead else 0.0

  def fixed_call_seconds(self, k: int, rows: int) -> float:
    """The modelled seconds of a call beginning with K = k besides its iterations: the
    prefill, one segment call's fixed cost and K's start cost."""
    return self.prefill + self.call_overhead(rows) + self.start_cost(k, rows)

  def observe_call(self, tokens_per_row: float, weight: float, k: int | None = None,
                   seconds: float | None = None, modelled: float | None = None) -> None:
    """Moves `tokens_per_row` towards a finished call's mean completion length and, given
    the call's first K, its measured `seconds` and the `modelled` seconds of what it ran,
    records their difference among K's last CALL_WINDOW. (A call compiles nothing: a fresh
    calibration compiles every program a call of its shapes can run.)"""
    self.tokens_per_row = (float(tokens_per_row) if self.tokens_per_row is None else
                           (1 - weight) * self.tokens_per_row + weight * tokens_per_row)
    if k is None:
      return
    self.calls[k] = self.calls.get(k, 0) + 1
    misses = self.call_misses.setdefault(k, [])
    misses.append(float(seconds) - float(modelled))
    del misses[:-CALL_WINDOW]

  def settle(self) -> None:
    """The pending call into the table (`observe_call`): its seconds against the model's for
    the iterations it actually ran (`call_seconds`' terms with the iterations counted, not
    expected, so a call's length does not count as the model's error)."""
    call, self.pending = self.pending, None
    if call is None:
      return
    modelled = self.fixed_call_seconds(call.k, call.rows) + sum(
        n * self.lookup(k, call.rows, call.bucket) for k, n in call.k_iterations.items())
    self.observe_call(float(np.mean(call.lengths)), call.weight, k=call.k,
                      seconds=call.end - call.start, modelled=modelled)

  def seed_from(self, other: "CostTable") -> None:
    """Takes `other`'s call length and call misses as this table's prior (a new prompt
    bucket starts from a neighbouring bucket's experience: what a call of the speculative
    machinery costs beyond the model hardly depends on the prompt's length, and each K
    need not be tried again in every bucket). This table's own calls replace them."""
    self.tokens_per_row = other.tokens_per_row
    self.call_misses = {k: list(v) for k, v in other.call_misses.items()}

  def call_residual(self, k: int) -> float:
    """What calls that began with K took beyond the model: the least of K's recent misses
    once two are recorded (load from elsewhere only ever adds time, so one slow call does
    not rule a K out), else 0 (the model alone)."""
    misses = self.call_misses.get(k, ())
    return min(misses) if len(misses) >= 2 else 0.0

  def min_iterations(self, k: int, rows: int, bucket: int, host_fraction: float) -> int:
    """The fewest iterations of k drafts whose time the segment call's overhead is at most
    `host_fraction` of (1 when no overhead was measured)."""
    if not self.overhead or not any(kk == k for kk, _, _ in self.seconds):
      return 1
    over = self.call_overhead(rows)
    return max(1, math.ceil(over / (host_fraction * self.lookup(k, rows, bucket))))

  def to_json(self) -> list[dict]:
    return [{"k": k, "rows": r, "bucket": b, "seconds": s}
            for (k, r, b), s in sorted(self.seconds.items())]


def _at_least(values: Sequence[int], want: int) -> int:
  """The smallest of sorted `values` >= want (the largest when none is)."""
  return values[min(bisect.bisect_left(values, want), len(values) - 1)]


def choose_k(estimate: AcceptanceEstimate, table: CostTable, rows: int, bucket: int,
             k_max: int, call_tokens: float | None = None) -> int:
  """The K in 0..k_max of the most expected tokens per second (ties: the smaller K).

  With `call_tokens` (a call's first segment: the tokens a row is expected to emit in the
  call), the whole call is costed instead: `CostTable.call_seconds` (K's start cost, the
  depth caches over the prompt, spread over the call's call_tokens / E(K) iterations, so a
  short call does not pay for them) plus K's call residual, what measured calls that began
  with K took beyond the model. A K whose calls keep costing more than modelled (at small
  batch, fixed costs the per-iteration table does not see) loses to one that delivers."""
  if call_tokens:
    return choose_first_k(tuple(estimate.alphas), table, rows, bucket, k_max, call_tokens)
  best_k, best_rate = 0, -1.0
  for k in range(k_max + 1):
    rate = expected_tokens(estimate.alphas, k) / table.lookup(k, rows, bucket)
    if rate > best_rate * (1 + 1e-12):
      best_k, best_rate = k, rate
  return best_k


def choose_first_k(alphas: tuple[float, ...], table: CostTable, rows: int, bucket: int,
                   k_max: int, call_tokens: float) -> int:
  """`choose_k` for a call's first segment, from the acceptance `alphas` as a tuple: the K
  of the least modelled call seconds plus K's call residual (ties: the smaller K). Reads
  `CostTable.call_model`'s kept terms: it runs once per call."""
  fixed, per_token = table.call_model(rows, bucket, alphas, k_max)
  tokens = max(call_tokens, 1.0)
  best_k, best_rate = 0, -1.0
  for k in range(k_max + 1):
    rate = 1.0 / max(fixed[k] + tokens * per_token[k] + table.call_residual(k), 1e-12)
    if rate > best_rate * (1 + 1e-12):
      best_k, best_rate = k, rate
  return best_k


# --------------------------------------------------------------------- the decoder's settings


@dataclasses.dataclass(frozen=True)
class Settings:
  """config.decoding.adaptive: k_max drafts at most (<= the drafter's depths), the EMA
  weight `smoothing` of each segment's observed acceptance, `calibrate` (measure the cost
  table in-process; off: `weight_read_costs`), `segment` iterations between decisions at
  least (a segment that keeps the K of the one before runs twice as many, up to
  `max_segment`, so a settled choice costs few host round trips; and a segment is never so
  short that its call's measured fixed cost exceeds `host_fraction` of its iterations'),
  `calibration_iterations` timed per (K, rows), and `compact` (gather the live rows down to
  smaller batches as rows finish: the batch sizes are the batch and the powers of
  `batch_factor` below it, each a program per K)."""
  k_max: int
  smoothing: float = 0.2
  calibrate: bool = True
  segment: int = 16
  max_segment: int = 256
  calibration_iterations: int = 32
  compact: bool = True
  batch_factor: int = 4
  host_fraction: float = 0.02

  def __post_init__(self):
    if self.batch_factor < 2:
      raise ValueError(f"batch_factor={self.batch_factor} is not allowed: must be >= 2")
    if self.k_max < 0:
      raise ValueError(f"k_max={self.k_max} is not allowed: must be >= 0")
    if not 1 <= self.segment <= self.max_segment or self.calibration_iterations < 2:
      raise ValueError(f"segment={self.segment}, max_segment={self.max_segment} and "
                       f"calibration_iterations={self.calibration_iterations}: need "
                       "1 <= segment <= max_segment and calibration_iterations >= 2")
    if not 0 < self.host_fraction <= 1:
      raise ValueError(f"host_fraction={self.host_fraction} is not allowed: must be in (0, 1]")


def weight_read_costs(model_config, rows: Sequence[int], bucket: int, k_max: int,
                      draft_vocab_size: int | None = None) -> CostTable:
  """The cost table without calibration: decoding bound by weight reads, a verification of
  K + 1 tokens costs one target step and each draft depth one MTP module plus the head
  (over the draft vocabulary when reduced), in units of a target step's weights."""
  c = model_config
  d, f, v = c.d_model, c.mlp_dim, c.vocab_size
  attn = d * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
  block = attn + 3 * d * f
  target = c.num_layers * block + d * v
  depth = block + 2 * d * d + d * (draft_vocab_size or v)
  table = CostTable()
  for r in rows:
    for k in range(k_max + 1):
      table.add(k, r, bucket, 1.0 + k * depth / target)
  return table
