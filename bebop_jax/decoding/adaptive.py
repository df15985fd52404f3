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

The decoder (`generate`) prefills the main cache once (speculative.prefill; the depth
caches are computed by the first segment that drafts, so a call that never drafts costs what
autoregressive decoding does) and then runs segments of iterations (speculative.segment),
deciding K before each from the estimate and the table. A segment runs at least
`Settings.segment` iterations, and at least enough that its call's fixed cost (dispatch and
the host round trip, measured) is a small fraction of it; a segment that keeps the K of the
one before runs twice as many. Between segments, rows that finished leave the batch: the
state is gathered down to the smallest batch bucket (the powers of `batch_factor` below the
batch) that holds the live rows, so a rollout's long tail runs at small batch, where
speculation pays most; the gathers are compiled before the first segment. The cost table is
measured once per run and shape (`calibrate`: the slope of segment time in iterations for
each K at each batch bucket, on a scratch copy of the prefilled state), or, with calibration
off, modelled from weight reads (`weight_read_costs`). The calibration times its programs
in interleaved rounds, and every full segment the loop runs afterwards moves its K's entry
towards the time it took (`CostTable.observe`), so a table skewed by a burst of load
elsewhere is corrected as the run goes. A call's first K is chosen by the whole call's
cost (`CostTable.call_seconds`: prefill, fixed cost, the depth caches' start cost and the
expected iterations) plus what measured calls that began with that K took beyond the model
(`CostTable.call_residual`), so at small batch, where a call is short and mostly fixed
costs the per-iteration table does not see, a K that loses in practice stops being chosen.
A call whose first segment is expected to emit the whole budget runs K's whole-call program
instead (fixed-K speculative decoding's, or the autoregressive one at K = 0); at K = 0 that
program and segments are separate arms wherever the batch can shrink, told apart by their
calls. A single-turn call's bookkeeping runs while its program does (`CostTable.planned`,
`CostTable.settle`).

The choice depends only on the past (acceptance already observed, costs measured before),
so switching K between iterations leaves the output law unchanged: every iteration is an
exact speculative step for whichever K it runs.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bebop_jax.decoding import autoregressive
from bebop_jax.decoding import sampling
from bebop_jax.decoding import speculative


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
  whole: bool


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

  def fixed_call_seconds(self, k: int, rows: int) -> float:
    """The modelled seconds of a call beginning with K = k besides its iterations: the
    prefill, one segment call's fixed cost and K's start cost."""
    over = self.overhead[_at_least(sorted(self.overhead), rows)] if self.overhead else 0.0
    return self.prefill + over + self.start_cost(k, rows)

  def observe_call(self, tokens_per_row: float, weight: float, k: int | None = None,
                   seconds: float | None = None, modelled: float | None = None,
                   whole: bool = False) -> None:
    """Moves `tokens_per_row` towards a finished call's mean completion length and, given
    the call's first K (and `whole`: whether it ran K's whole-call program), its measured
    `seconds` and the `modelled` seconds of what it ran, records their difference among
    that arm's last CALL_WINDOW. (A call compiles nothing: a fresh calibration compiles
    every program a call of its shapes can run.)"""
    self.tokens_per_row = (float(tokens_per_row) if self.tokens_per_row is None else
                           (1 - weight) * self.tokens_per_row + weight * tokens_per_row)
    if k is None:
      return
    arm = (k, whole)
    self.calls[arm] = self.calls.get(arm, 0) + 1
    misses = self.call_misses.setdefault(arm, [])
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
                      seconds=call.end - call.start, modelled=modelled, whole=call.whole)

  def seed_from(self, other: "CostTable") -> None:
    """Takes `other`'s call length and call misses as this table's prior (a new prompt
    bucket starts from a neighbouring bucket's experience: what a call of the speculative
    machinery costs beyond the model hardly depends on the prompt's length, and each K
    need not be tried again in every bucket). This table's own calls replace them."""
    self.tokens_per_row = other.tokens_per_row
    self.call_misses = {k: list(v) for k, v in other.call_misses.items()}

  def call_residual(self, k: int, whole: bool = False) -> float:
    """What calls that began with K (run as K's whole-call program when `whole`) took
    beyond the model: the least of the arm's recent misses once two are recorded (load from
    elsewhere only ever adds time, so one slow call does not rule an arm out), else 0 (the
    model alone)."""
    misses = self.call_misses.get((k, whole), ())
    return min(misses) if len(misses) >= 2 else 0.0

  def min_iterations(self, k: int, rows: int, bucket: int, host_fraction: float) -> int:
    """The fewest iterations of k drafts whose time the segment call's overhead is at most
    `host_fraction` of (1 when no overhead was measured)."""
    if not self.overhead or not any(kk == k for kk, _, _ in self.seconds):
      return 1
    over = self.overhead[_at_least(sorted(self.overhead), rows)]
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
    return choose_first_k(tuple(estimate.alphas), table, rows, bucket, k_max,
                          call_tokens)[0]
  best_k, best_rate = 0, -1.0
  for k in range(k_max + 1):
    rate = expected_tokens(estimate.alphas, k) / table.lookup(k, rows, bucket)
    if rate > best_rate * (1 + 1e-12):
      best_k, best_rate = k, rate
  return best_k


def choose_first_k(alphas: tuple[float, ...], table: CostTable, rows: int, bucket: int,
                   k_max: int, call_tokens: float,
                   arms: Sequence[tuple[int, bool]] | None = None) -> tuple[int, bool]:
  """`choose_k` for a call's first segment, from the acceptance `alphas` as a tuple: the
  arm (K, whole: run as K's whole-call program) among `arms` (default: every K in
  segments) of the least modelled call seconds plus the arm's call residual (ties: the
  earlier arm). Two arms of one K share the model; only what their calls measured tells
  them apart. Reads `CostTable.call_model`'s kept terms: it runs once per call."""
  fixed, per_token = table.call_model(rows, bucket, alphas, k_max)
  tokens = max(call_tokens, 1.0)
  best, best_rate = None, -1.0
  for k, whole in (arms if arms is not None else [(k, False) for k in range(k_max + 1)]):
    rate = 1.0 / max(fixed[k] + tokens * per_token[k] + table.call_residual(k, whole), 1e-12)
    if rate > best_rate * (1 + 1e-12):
      best, best_rate = (k, whole), rate
  return best


# ----------------------------------------------------------------------------- the decoder


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


@dataclasses.dataclass
class Stats:
  """What one adaptive call did: iterations run with each K, the (K, live rows, batch) of
  each segment, the cost table it decided with and the final acceptance estimate."""
  k_iterations: dict[int, int]
  segments: list[tuple[int, int, int]]
  table: CostTable
  alphas: list[float]
  calibration_s: float = 0.0

  def to_json(self) -> dict:
    self.table.settle()  # every finished call in the residuals reported
    return {"k_iterations": {str(k): v for k, v in sorted(self.k_iterations.items())},
            "segments": [list(x) for x in self.segments], "cost_table": self.table.to_json(),
            "segment_overhead_s": {str(r): v for r, v in sorted(self.table.overhead.items())},
            "start_cost_s": {f"k{k}_rows{r}": v for (k, r), v in sorted(self.table.start.items())},
            "tokens_per_row": self.table.tokens_per_row,
            "prefill_s": self.table.prefill,
            "call_residual_s": {f"{k}{' whole' if whole else ''}":
                                self.table.call_residual(k, whole)
                                for k, whole in sorted(self.table.call_misses)},
            "acceptance_estimate": self.alphas, "calibration_s": self.calibration_s}


def settings_from_config(config) -> Settings:
  """config.decoding.adaptive as Settings (k_max 0: model.num_draft_steps)."""
  a = config.decoding.adaptive
  return Settings(k_max=a.k_max or config.model.num_draft_steps, smoothing=float(a.smoothing),
                  calibrate=a.calibrate, segment=a.segment,
                  max_segment=max(a.segment, Settings.max_segment),
                  batch_factor=a.batch_factor)


def batch_buckets(batch: int, factor: int = 4) -> list[int]:
  """The batch sizes the live batch is gathered down to: `batch`, then the powers of
  `factor` below it, largest first."""
  sizes = [batch]
  p = 1
  while p < batch:
    sizes.append(p)
    p *= factor
  return sorted(set(sizes), reverse=True)


def _rows_impl(tree, index: jax.Array, batch: int):
  return jax.tree.map(lambda x: x[index] if getattr(x, "ndim", 0) and x.shape[0] == batch
                      else x, tree)


# Every leaf with a leading batch axis of size `batch`, at rows `index` (one program per
# batch and number of rows kept; compiled ahead by `_warm_compaction`).
_rows = jax.jit(_rows_impl, static_argnames=("batch",))


@functools.partial(jax.jit, static_argnames=("rows",))
def _calibration_state(s0: speculative.DecodeState, rows: int) -> speculative.DecodeState:
  """The first `rows` rows of a prefilled state, every row live and without a stop token:
  what the calibration times. Built in one program, so its arrays are placed as a live
  call's are (outputs of a program), and the segment programs the calibration compiles are
  the ones the calls run (an array created outside a program is uncommitted, and would
  compile a program of its own)."""
  base = _rows_impl(s0, jnp.arange(rows, dtype=jnp.int32), s0.seq.shape[0])
  return base.replace(done=jnp.zeros((rows,), bool), stop=jnp.full_like(base.stop, -1),
                      limit=jnp.full((rows,), s0.out.tokens.shape[1], jnp.int32))


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_rows(full, part, index: jax.Array):
  """`full` (a whole batch's output, donated) with rows `index` replaced by `part`'s rows;
  scalars (the call's target_forwards) taken from `part`."""
  return jax.tree.map(lambda f, p: f.at[index].set(p) if getattr(f, "ndim", 0) else p,
                      full, part)


_WARM: set[tuple] = set()  # compaction programs compiled, per process and shape


def _warm_compaction(s: speculative.DecodeState, buckets: Sequence[int], part) -> None:
  """Compiles (and runs once on scratch copies) every gather from one batch size of
  `buckets` to a smaller one and every put of a smaller batch's `part` back into the whole
  batch's, so rows finishing mid-call never compile anything."""
  if len(buckets) < 2:
    return
  b = s.seq.shape[0]
  key = (tuple(buckets), part(s) is s, jax.tree.structure(s),
         tuple((x.shape, x.dtype) for x in jax.tree.leaves(s)))
  if key in _WARM:
    return
  smaller = {}
  for big in buckets:
    source = s if big == b else smaller[big]
    for small in buckets:
      if small < big:
        rows = _rows(source, np.arange(small, dtype=np.int32), batch=big)
        smaller.setdefault(small, rows)
  whole = part(s)
  for small, rows in smaller.items():
    whole = _put_rows(jax.tree.map(jnp.copy, whole), part(rows),
                      np.arange(small, dtype=np.int32))
  jax.block_until_ready(whole)
  _WARM.add(key)


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


CALIBRATION_ROUNDS = 3  # timed passes over every (K, segment length) of a calibration

# Calibrations, per run (process) and shape: {id(graphdef): (graphdef, {key: table})}.
_TABLES: dict[int, tuple[object, dict[tuple, CostTable]]] = {}


def calibrate(graphdef, state, s0: speculative.DecodeState, *, rows: Sequence[int],
              k_max: int, iterations: int, params, mode, draft_vocab=None) -> CostTable:
  """Seconds per iteration of each K in 0..k_max at each batch size in `rows`, measured on
  copies of the first rows of the prefilled state `s0` with every row live and no stop
  token (their outputs are discarded), and the fixed seconds of a segment call at each.
  A K's cost is the slope between a segment of about `iterations` * (k_max + 1) / (K + 1)
  iterations (as many as no row can finish in: every K's segment emits about as many
  tokens) and one a quarter as long; the difference cancels the call's fixed cost, which
  would otherwise flatter the costlier K. A K's start cost (`CostTable.start`) is one
  iteration's time beyond its slope, less K = 0's. The fixed cost is a call of no
  iterations and its host round trip. Each program runs once to compile; then
  `CALIBRATION_ROUNDS` rounds time every (K, length) once each, interleaved, and the best
  of each counts."""
  b = s0.seq.shape[0]
  cache_length = s0.cache.length

  def seconds(base, k, n):  # one timed segment call on a fresh copy of `base`
    s = jax.tree.map(jnp.copy, base)
    jax.block_until_ready(s)
    t0 = time.perf_counter()
    s = speculative.segment(graphdef, state, s, np.int32(n), k=k, params=params, mode=mode,
                            draft_vocab=draft_vocab)
    jax.device_get((s.done, s.out.attempted, s.out.accepted, s.out.target_forwards))
    return time.perf_counter() - t0

  table = CostTable()
  for r in sorted(rows, reverse=True):
    base = _calibration_state(s0, rows=r)
    runs, lengths = [(0, 0)], {}  # (K, iterations); (0, 0): the call's fixed cost
    for k in range(k_max + 1):
      # As many iterations as no row can finish in (up to `iterations` per unit of
      # K + 1, so every K's segment runs about as long), and a quarter as many.
      room = (s0.out.tokens.shape[1] - 1) // (k + 1)
      long = max(2, min(iterations * (k_max + 1) // (k + 1), room))
      lengths[k] = (max(1, long // 4), long)
      # One iteration on the state as prefilled: the call's fixed cost at K, the depth
      # caches over the prompt included (the start cost below).
      runs += [(k, n) for n in (1, *lengths[k]) if (k, n) not in runs]
    for run in runs:  # compiles each K's program and warms it
      seconds(base, *run)
    # Rounds over every run, alternating direction: a burst of load from elsewhere falls on
    # neighbouring runs of different K, not on all the runs of one K.
    best = dict.fromkeys(runs, math.inf)
    for i in range(CALIBRATION_ROUNDS):
      for run in (runs if i % 2 == 0 else runs[::-1]):
        best[run] = min(best[run], seconds(base, *run))
    intercept = {}
    for k, (short, long) in lengths.items():
      slope = (best[(k, long)] - best[(k, short)]) / (long - short)
      table.add(k, r, cache_length, slope if slope > 0 else best[(k, long)] / long)  # noise
      # The state is prefilled without depths, so a K > 0 segment first computes them over
      # the prompt, as a call's first segment with K drafts does: its fixed cost beyond K = 0's
      # is what one iteration costs beyond its slope (measured directly: an intercept
      # extrapolated from longer segments would carry their slope's noise many times over).
      intercept[k] = best[(k, 1)] - table.lookup(k, r, cache_length)
    table.overhead[r] = best[(0, 0)]
    for k in range(1, k_max + 1):
      table.start[(k, r)] = max(0.0, intercept[k] - intercept[0])
  logging.info("adaptive decoding cost table (seconds per iteration): %s; segment call "
               "overhead by rows: %s; start cost by (K, rows): %s", table.to_json(),
               table.overhead, table.start)
  return table


def _table(graphdef, state, make_state: Callable[[], speculative.DecodeState], *,
           settings: Settings, rows, params, mode, draft_vocab, cache_length: int,
           batch: int, max_new_tokens: int, depths: int) -> tuple[CostTable, float]:
  """The cost table of `settings` for these shapes and the seconds it took: cached per
  process (the key is cheap: the graphdef fixes the parameters' shapes, and only the draft
  vocabulary's size matters to cost), else calibrated on `make_state()` (a prefilled state
  of these shapes) or modelled from weight reads."""
  # Keyed by the graphdef's identity first: hashing a graphdef walks the whole module tree.
  owner, tables = _TABLES.get(id(graphdef), (None, None))
  if owner is not graphdef:
    tables = {}
    _TABLES[id(graphdef)] = (graphdef, tables)
  key = (tuple(sorted(rows)), settings.k_max, settings.calibrate,
         settings.calibration_iterations, params, mode, cache_length, batch, max_new_tokens,
         depths, None if draft_vocab is None else draft_vocab.shape[0])
  if key in tables:
    return tables[key], 0.0
  t0 = time.perf_counter()
  if settings.calibrate:
    prefill = math.inf  # the best of three prefills after the one that compiles
    for i in range(4):
      t1 = time.perf_counter()
      s0 = jax.block_until_ready(make_state())
      prefill = prefill if i == 0 else min(prefill, time.perf_counter() - t1)
    table = calibrate(graphdef, state, s0, rows=rows, k_max=settings.k_max,
                      iterations=settings.calibration_iterations, params=params, mode=mode,
                      draft_vocab=draft_vocab)
    table.prefill = prefill
  else:
    from flax import nnx  # pylint: disable=g-import-not-at-top
    table = weight_read_costs(nnx.merge(graphdef, state).config, rows, cache_length,
                              settings.k_max,
                              None if draft_vocab is None else draft_vocab.shape[0])
  # Other prompt buckets of the same calls (keys differing only in the cache length): the
  # nearest one's call experience is the new table's prior (`CostTable.seed_from`).
  siblings = [(abs(other[6] - cache_length), other) for other in tables
              if other[:6] + other[7:] == key[:6] + key[7:]]
  if siblings:
    table.seed_from(tables[min(siblings)[1]])
  tables[key] = table
  return table, time.perf_counter() - t0


def _segment_length(k: int, k_before: int | None, before: int, table: CostTable, live: int,
                    bucket: int, settings: Settings) -> int:
  """Iterations of the next segment: at least `settings.segment` and enough that the call's
  fixed cost is at most `host_fraction` of it; twice the one before's when K is kept; at
  most `max_segment`."""
  floor = max(settings.segment,
              table.min_iterations(k, live, bucket, settings.host_fraction))
  want = max(2 * before, floor) if k == k_before else floor
  return min(want, settings.max_segment)


def _seed_alphas(acceptance, depths: int) -> tuple[float, ...]:
  """The estimate's seed: the first `depths` of `acceptance`, clipped to [0, 1] (None:
  optimistic ones)."""
  if acceptance is None:
    return (1.0,) * depths
  return tuple(min(max(float(a), 0.0), 1.0) for a in list(acceptance)[:depths])


def _plan(settings: Settings, acceptance, depths: int, table: CostTable | None, schedule):
  """The acceptance estimate (seeded from `acceptance`, else optimistic ones) and, with K
  forced by `schedule` and no table given, an empty table (nothing to decide with)."""
  estimate = AcceptanceEstimate(np.asarray(_seed_alphas(acceptance, depths)),
                                settings.smoothing, measured=acceptance is not None)
  return estimate, (CostTable() if table is None and schedule is not None else table)


def _drive(graphdef, state, s: speculative.DecodeState, *, params, mode, settings: Settings,
           estimate: AcceptanceEstimate, table: CostTable, schedule, whole_state: bool,
           draft_vocab, buckets: Sequence[int], stats: Stats, first: tuple[int, int] | None,
           observe: bool) -> tuple[speculative.DecodeState | speculative.SpeculativeOutput,
                                   Stats]:
  """The segment loop of `decode` and `generate` on `s` (donated). `first` = (K, iterations)
  when `s` has already run its first segment from a fresh prefill.
  `observe`: correct the (calibrated) table with each full segment's measured time."""
  b = s.seq.shape[0]
  part = (lambda st: st) if whole_state else (lambda st: st.out)
  if settings.compact:
    _warm_compaction(s, buckets, part)
  full = None  # the whole batch, kept from the first time rows leave it
  index = np.arange(b, dtype=np.int32)  # the original row of each row of the current batch
  done, attempted, accepted, forwards = jax.device_get(
      (s.done, s.out.attempted, s.out.accepted, s.out.target_forwards))
  segment_i, k_before, iterations = 0, None, 0
  if first is not None:  # account the first segment against the fresh state's zeros
    k_before, iterations = first
    estimate.update(accepted.sum(0), attempted.sum(0))
    stats.k_iterations[k_before] = int(forwards)
    stats.segments.append((k_before, b, b))
    segment_i = 1
  while not done.all():
    live = int((~done).sum())
    size = min(x for x in buckets if x >= live)
    if size < s.seq.shape[0]:  # rows that finished leave the batch (never donated again)
      full = part(s) if full is None else _put_rows(full, part(s), index)
      keep = np.concatenate([np.flatnonzero(~done), np.flatnonzero(done)[:size - live]]
                            ).astype(np.int32)
      s = _rows(s, keep, batch=s.seq.shape[0])
      index, attempted, accepted = index[keep], attempted[keep], accepted[keep]
    k = (schedule(segment_i) if schedule is not None else
         choose_k(estimate, table, live, s.cache.length, settings.k_max))
    iterations = _segment_length(k, k_before, iterations, table, live, s.cache.length,
                                 settings)
    t0 = time.perf_counter()
    s = speculative.segment(graphdef, state, s, np.int32(iterations), k=k,
                            params=params, mode=mode, draft_vocab=draft_vocab)
    done, now_att, now_acc, now_fwd = jax.device_get(
        (s.done, s.out.attempted, s.out.accepted, s.out.target_forwards))
    if observe and now_fwd - forwards == iterations and table.overhead:
      # A segment that ran all its iterations: its time per iteration, less the call's
      # measured fixed cost, corrects this K's entry at this batch size.
      spent = time.perf_counter() - t0 - table.overhead[_at_least(sorted(table.overhead),
                                                                   s.seq.shape[0])]
      table.observe(k, s.seq.shape[0], s.cache.length, spent / iterations,
                    settings.smoothing)
    estimate.update((now_acc - accepted).sum(0), (now_att - attempted).sum(0))
    stats.k_iterations[k] = stats.k_iterations.get(k, 0) + int(now_fwd - forwards)
    stats.segments.append((k, live, s.seq.shape[0]))
    attempted, accepted, forwards = now_att, now_acc, now_fwd
    segment_i, k_before = segment_i + 1, k
  stats.alphas = [float(a) for a in estimate.alphas]
  return (part(s) if full is None else _put_rows(full, part(s), index)), stats


def decode(graphdef, state, s: speculative.DecodeState, *, params: sampling.SamplingParams,
           mode: str, settings: Settings, acceptance: Sequence[float] | None = None,
           draft_vocab: jax.Array | None = None, table: CostTable | None = None,
           schedule: Callable[[int], int] | None = None, whole_state: bool = False
           ) -> tuple[speculative.DecodeState | speculative.SpeculativeOutput, Stats]:
  """Decodes the current turn of every row of `s` (donated) in segments with a draft length
  chosen before each (module docstring). `acceptance`: the drafter's measured per-depth
  acceptance, the estimate's seed (None: optimistic ones, replaced by the first observation
  of each depth). `table`: a cost table to use instead of calibrating (or modelling) one.
  `schedule`: K of segment i, overriding the rule (tests force switching with it).
  Returns the whole batch's state (`whole_state`, for a later turn) or output, and what
  the call did."""
  b = s.seq.shape[0]
  buckets = batch_buckets(b, settings.batch_factor) if settings.compact else [b]
  observe = table is None and schedule is None and settings.calibrate
  estimate, table = _plan(settings, acceptance, s.out.attempted.shape[1], table, schedule)
  calibration_s = 0.0
  if table is None:
    table, calibration_s = _table(
        graphdef, state, lambda: s, settings=settings, rows=buckets, params=params,
        mode=mode, draft_vocab=draft_vocab, cache_length=s.cache.length, batch=b,
        max_new_tokens=s.out.tokens.shape[1], depths=s.out.attempted.shape[1])
  stats = Stats(k_iterations={}, segments=[], table=table, alphas=[],
                calibration_s=calibration_s)
  return _drive(graphdef, state, s, params=params, mode=mode, settings=settings,
                estimate=estimate, table=table, schedule=schedule, whole_state=whole_state,
                draft_vocab=draft_vocab, buckets=buckets, stats=stats, first=None,
                observe=observe)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_length",
                                             "params", "stop_tokens", "depths"))
def _autoregressive_call(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                         rng: jax.Array, row_stops: jax.Array | None, *, max_new_tokens: int,
                         cache_length: int, params: sampling.SamplingParams,
                         stop_tokens: tuple[int, ...], depths: int
                         ) -> speculative.SpeculativeOutput:
  """A whole single-turn call at K = 0 as the autoregressive program itself (no decoding
  state for drafts, nothing kept for a later segment), its output in speculative decoding's
  form: every token after the first came from one target forward, no draft was attempted."""
  g = autoregressive.generate(graphdef, state, prompt_tokens, prompt_lengths, rng,
                              max_new_tokens=max_new_tokens, cache_length=cache_length,
                              params=params, stop_tokens=stop_tokens, row_stops=row_stops)
  b, p = prompt_tokens.shape
  steps = jnp.maximum(g.lengths - 1, 0)  # the first token comes from the prefill
  none = jnp.zeros((b, depths), jnp.int32)
  return speculative.SpeculativeOutput(
      tokens=g.tokens, lengths=g.lengths,
      policy_mask=jnp.arange(max_new_tokens)[None, :] < g.lengths[:, None],
      logprobs=g.logprobs, entropy=g.entropy, attempted=none, accepted=none,
      emitted_by_forwards=steps, frontier_depths=jnp.zeros((b, p + max_new_tokens), jnp.int32),
      row_forwards=steps, target_forwards=g.target_forwards)


def _fixed_call_impl(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                     rng: jax.Array, row_stops: jax.Array | None,
                     draft_vocab: jax.Array | None, *, max_new_tokens: int,
                     cache_length: int, params: sampling.SamplingParams, program: str,
                     mode_index: jax.Array, stop_tokens: tuple[int, ...], k: int,
                     depths: int) -> speculative.SpeculativeOutput:
  """A whole single-turn call at a fixed K >= 1 as fixed-K speculative decoding's own
  program (its prefill computes the depth caches, one loop to the end, no host round trip
  between), its per-depth counts padded to `depths`."""
  out = speculative._generate(  # pylint: disable=protected-access
      graphdef, state, prompt_tokens, prompt_lengths, rng, max_new_tokens=max_new_tokens,
      cache_length=cache_length, params=params, program=program, mode_index=mode_index,
      stop_tokens=stop_tokens, row_stops=row_stops, num_draft_steps=k,
      draft_vocab=draft_vocab)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, depths - k)))
  return out.replace(attempted=pad(out.attempted), accepted=pad(out.accepted))


_fixed_call = speculative._ModeArgument(jax.jit(  # pylint: disable=protected-access
    _fixed_call_impl, static_argnames=("graphdef", "max_new_tokens", "cache_length", "params",
                                       "program", "stop_tokens", "k", "depths")))


def _begin(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
           rng: jax.Array, *, max_new_tokens: int, cache_length: int,
           params: sampling.SamplingParams, mode: str, stop_tokens: Sequence[int],
           settings: Settings, row_stops: jax.Array | None, max_turn_tokens: int | None,
           whole_state: bool, acceptance=None, draft_vocab=None, table=None, schedule=None):
  """The prefill and the first segment, with K chosen for the whole batch before them, then
  the segment loop; or, when the first segment is expected to run the whole call (or K = 0
  at a batch that cannot shrink: no later decision could differ), that K's whole-call
  program: the autoregressive program at K = 0, fixed-K speculative decoding's otherwise.

  A single-turn call that corrects the table does its bookkeeping while the device runs,
  not between one call's end and the next call's dispatch (at batch 1 a call of the tiny
  policy is a few milliseconds; experiments/bench_call_overhead.py measures what remains).
  So its first K was planned during the call before (`CostTable.planned`), and its own
  measurement is settled into the table during the next call (`CostTable.settle`): a
  choice uses the calls finished before the one before it. It still depends only on the
  past, so the law is unchanged."""
  b = prompt_tokens.shape[0]
  depths = max(settings.k_max, 1)
  buckets = batch_buckets(b, settings.batch_factor) if settings.compact else [b]
  kw = dict(max_new_tokens=max_new_tokens, cache_length=cache_length, params=params,
            stop_tokens=tuple(stop_tokens), row_stops=row_stops, num_draft_steps=depths,
            max_turn_tokens=max_turn_tokens)
  # `correct`: segments correct the (calibrated) table; `observe`: so do whole calls.
  correct = table is None and schedule is None and settings.calibrate
  observe = correct and not whole_state
  calibration_s = 0.0
  if table is None and schedule is None:
    table, calibration_s = _table(
        graphdef, state,
        lambda: speculative.prefill(graphdef, state, prompt_tokens, prompt_lengths, rng,
                                    draft_prefill=False, **kw),
        settings=settings, rows=buckets, params=params, mode=mode, draft_vocab=draft_vocab,
        cache_length=cache_length, batch=b, max_new_tokens=max_new_tokens, depths=depths)

  def whole_call(k: int):  # a whole single-turn call at K, dispatched
    if k == 0:
      return _autoregressive_call(graphdef, state, prompt_tokens, prompt_lengths, rng,
                                  row_stops, max_new_tokens=max_new_tokens,
                                  cache_length=cache_length, params=params,
                                  stop_tokens=tuple(stop_tokens), depths=depths)
    return _fixed_call(graphdef, state, prompt_tokens, prompt_lengths, rng, row_stops,
                       draft_vocab, max_new_tokens=max_new_tokens, cache_length=cache_length,
                       params=params, mode=mode, stop_tokens=tuple(stop_tokens), k=k,
                       depths=depths)

  if calibration_s and settings.calibrate and not whole_state:
    # A fresh calibration also compiles the whole-call programs a call may run (below: the
    # autoregressive one, and each K's whose first segment could cover the budget at full
    # acceptance) and the gathers of compaction, so that no call of these shapes compiles
    # (each call's seconds count towards its first K's call residual), whichever K it
    # begins with.
    t0 = time.perf_counter()
    for k in range(settings.k_max + 1):
      if k == 0 or (_segment_length(k, None, 0, table, b, cache_length, settings) * (k + 1)
                    >= max_new_tokens - 1):
        jax.block_until_ready(whole_call(k))
    if settings.compact:
      _warm_compaction(speculative.prefill(graphdef, state, prompt_tokens, prompt_lengths,
                                           rng, draft_prefill=False, **kw),
                       buckets, lambda st: st.out)
    calibration_s += time.perf_counter() - t0
  seed = None if acceptance is None else tuple(float(a) for a in acceptance)
  alphas = _seed_alphas(seed, depths)

  def first_choice():
    """(K, iterations of its first segment, whether the call runs K's whole-call program)."""
    if schedule is not None:
      k = schedule(0)
      return k, _segment_length(k, None, 0, table or CostTable(), b, cache_length,
                                settings), False
    lengths = [_segment_length(k, None, 0, table, b, cache_length, settings)
               for k in range(settings.k_max + 1)]
    arms = []
    for k, n in enumerate(lengths):
      # A first segment expected to emit the whole budget makes no later decision and
      # lets no row leave the batch: K's whole-call program does the same work with no
      # host round trip between segments. At K = 0 the autoregressive program is an arm
      # of its own beside segments (which let finished rows leave the batch) where the
      # batch can shrink: calls measure which pays.
      covers = n * expected_tokens(alphas, k) >= max_new_tokens - 1
      if whole_state:
        arms.append((k, False))
      elif k == 0:
        arms += [(0, True)] + ([(0, False)] if not covers and len(buckets) > 1 else [])
      else:
        arms.append((k, covers))
    k, whole = choose_first_k(alphas, table, b, cache_length, settings.k_max,
                              table.tokens_per_row or max_new_tokens, arms)
    return k, lengths[k], whole

  k, iterations, whole = ((table.planned.pop(seed, None) if observe else None) or
                          first_choice())
  start_s = time.perf_counter()
  if whole:
    # The whole call as one program: at K = 0 the autoregressive program, which carries no
    # state for drafts (the disabled path skips the speculative machinery entirely, as vLLM
    # found it must); at K >= 1 fixed-K speculative decoding's, with no host round trip
    # between segments.
    out = whole_call(k)
  else:
    # The prefill (main cache only) and the first segment: the programs the calibration
    # compiled and timed, so whichever K a call begins with compiles nothing new, and the
    # depth caches over the prompt cost what `CostTable.start` measured.
    s = speculative.prefill(graphdef, state, prompt_tokens, prompt_lengths, rng,
                            draft_prefill=False, **kw)
    s = speculative.segment(graphdef, state, s, np.int32(iterations), k=k, params=params,
                            mode=mode, draft_vocab=draft_vocab)
  # While the device runs: the call before's measurement into the table, and the next
  # call's first choice from it.
  if observe:
    table.settle()
    table.planned = {seed: first_choice()}  # one plan kept: for the seed seen last
  if whole:
    forwards, lengths = jax.device_get((out.target_forwards, out.lengths))
    end_s = time.perf_counter()
    stats = Stats(k_iterations={k: int(forwards)}, segments=[(k, b, b)], table=table,
                  alphas=list(alphas), calibration_s=calibration_s)
  else:
    estimate, table = _plan(settings, seed, depths, table, schedule)
    stats = Stats(k_iterations={}, segments=[], table=table, alphas=[],
                  calibration_s=calibration_s)
    out, stats = _drive(graphdef, state, s, params=params, mode=mode, settings=settings,
                        estimate=estimate, table=table, schedule=schedule,
                        whole_state=whole_state, draft_vocab=draft_vocab, buckets=buckets,
                        stats=stats, first=(k, iterations), observe=correct)
    if observe:
      lengths = jax.device_get(out.lengths)
      end_s = time.perf_counter()
  if observe:
    table.pending = PendingCall(k=k, start=start_s, end=end_s, lengths=lengths, rows=b,
                                bucket=cache_length, k_iterations=dict(stats.k_iterations),
                                weight=settings.smoothing, whole=whole)
  return out, stats


def start(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
          rng: jax.Array, *, max_new_tokens: int, cache_length: int,
          params: sampling.SamplingParams, mode: str, stop_tokens: Sequence[int],
          settings: Settings, row_stops: jax.Array | None = None,
          max_turn_tokens: int | None = None, **kwargs
          ) -> tuple[speculative.DecodeState, Stats]:
  """As speculative.start with an adaptive draft length: prefills and decodes the first
  turn; the state (the whole batch) goes on to `continue_with_reply`. `kwargs`: `decode`'s
  acceptance, draft_vocab, table and schedule."""
  return _begin(graphdef, state, prompt_tokens, prompt_lengths, rng,
                max_new_tokens=max_new_tokens, cache_length=cache_length, params=params,
                mode=mode, stop_tokens=stop_tokens, settings=settings, row_stops=row_stops,
                max_turn_tokens=max_turn_tokens, whole_state=True, **kwargs)


def continue_with_reply(graphdef, state, decode_state: speculative.DecodeState,
                        reply_tokens: jax.Array, reply_lengths: jax.Array, *,
                        params: sampling.SamplingParams, mode: str, settings: Settings,
                        max_turn_tokens: int | None = None, **kwargs
                        ) -> tuple[speculative.DecodeState, Stats]:
  """As speculative.continue_with_reply with an adaptive draft length (the state donated).
  Depths left behind are caught up by the next segment that drafts with them."""
  s = speculative.append_reply(graphdef, state, decode_state, reply_tokens, reply_lengths,
                               params=params, max_turn_tokens=max_turn_tokens)
  return decode(graphdef, state, s, params=params, mode=mode, settings=settings,
                whole_state=True, **kwargs)


def generate(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
             rng: jax.Array, *, max_new_tokens: int, cache_length: int,
             params: sampling.SamplingParams, mode: str, stop_tokens: Sequence[int],
             settings: Settings, row_stops: jax.Array | None = None, **kwargs
             ) -> tuple[speculative.SpeculativeOutput, Stats]:
  """Single-turn speculative decoding with an adaptive draft length: the whole batch's
  output (as speculative.generate) and what the call did. `kwargs`: `decode`'s
  acceptance, draft_vocab, table and schedule."""
  return _begin(graphdef, state, prompt_tokens, prompt_lengths, rng,
                max_new_tokens=max_new_tokens, cache_length=cache_length, params=params,
                mode=mode, stop_tokens=stop_tokens, settings=settings, row_stops=row_stops,
                max_turn_tokens=None, whole_state=False, **kwargs)
