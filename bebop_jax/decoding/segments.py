"""The adaptive speculative decoder: segments of iterations with a draft length K chosen
before each by the rule of decoding/adaptive.py, finished rows leaving the batch between
them, and the cost table the rule reads, calibrated in-process.

`generate` (single turn), `start` and `continue_with_reply` (multi-turn: the state is kept
between turns) and `decode` (the current turn of a prefilled state). A call prefills the
main cache once (speculative.prefill; the depth caches are computed by the first segment
that drafts, so a call that never drafts costs what autoregressive decoding does) and then
runs segments (speculative.segment), deciding K before each from the acceptance estimate
and the cost table (adaptive.choose_k; a call's first K by the whole call's cost,
adaptive.choose_first_k). A segment runs at least `Settings.segment` iterations, and at
least enough that its call's fixed cost (dispatch and the host round trip, measured) is a
small fraction of it; a segment that keeps the K of the one before runs twice as many.
Between segments, rows that finished leave the batch: the state is gathered down to the
smallest batch bucket (`batch_buckets`: the batch and the powers of `batch_factor` below
it) that holds the live rows, so a rollout's long tail runs at small batch, where
speculation pays most; the gathers are compiled before the first segment.

The cost table is measured once per run and shape (`calibrate`: the slope of segment time
in iterations for each K at each batch bucket, on a scratch copy of the prefilled state,
its programs timed in interleaved rounds), or, with calibration off, modelled from weight
reads (adaptive.weight_read_costs); every full segment the loop runs afterwards moves its
K's entry towards the time it took (CostTable.observe). A single-turn call measures its own
span for the rule's call residual, and does that bookkeeping while its program runs
(CostTable.planned, CostTable.settle).

Every iteration is an exact speculative (or autoregressive) step for whichever K it runs,
and K depends only on the past, so the output law is the target's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bebop_jax.decoding import adaptive
from bebop_jax.decoding import sampling
from bebop_jax.decoding import speculative


@dataclasses.dataclass
class Stats:
  """What one adaptive call did: iterations run with each K, the (K, live rows, batch) of
  each segment, the cost table it decided with and the final acceptance estimate."""
  k_iterations: dict[int, int]
  segments: list[tuple[int, int, int]]
  table: adaptive.CostTable
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
            "call_residual_s": {str(k): self.table.call_residual(k)
                                for k in sorted(self.table.call_misses)},
            "acceptance_estimate": self.alphas, "calibration_s": self.calibration_s}


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


CALIBRATION_ROUNDS = 3  # timed passes over every (K, segment length) of a calibration

# Calibrations, per run (process), model and shape: {(model config, placement): {key:
# table}}, so that a stage that restarts (a new graphdef of the same model: an RL stage
# resumed block by block) reuses the calibration of its first start; and
# {id(graphdef): (graphdef, that model key)}, so that a call finds its model without merging.
_TABLES: dict[tuple, dict[tuple, adaptive.CostTable]] = {}
_MODELS: dict[int, tuple[object, tuple]] = {}


def _model_tables(graphdef, state) -> dict[tuple, adaptive.CostTable]:
  """The calibrations of the model `graphdef`, `state` describe (its config and placement)."""
  owner, key = _MODELS.get(id(graphdef), (None, None))
  if owner is not graphdef:
    from flax import nnx  # pylint: disable=g-import-not-at-top
    leaf = jax.tree.leaves(state)[0]
    key = (nnx.merge(graphdef, state).config, str(getattr(leaf, "sharding", None)))
    _MODELS[id(graphdef)] = (graphdef, key)
  return _TABLES.setdefault(key, {})


def calibrate(graphdef, state, s0: speculative.DecodeState, *, rows: Sequence[int],
              k_max: int, iterations: int, params, mode, draft_vocab=None
              ) -> adaptive.CostTable:
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

  table = adaptive.CostTable()
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
           settings: adaptive.Settings, rows, params, mode, draft_vocab, cache_length: int,
           batch: int, max_new_tokens: int, depths: int) -> tuple[adaptive.CostTable, float]:
  """The cost table of `settings` for these shapes and the seconds it took: cached per
  process and model (_model_tables; only the draft vocabulary's size matters to cost), else
  calibrated on `make_state()` (a prefilled state
  of these shapes) or modelled from weight reads."""
  tables = _model_tables(graphdef, state)
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
    table = adaptive.weight_read_costs(nnx.merge(graphdef, state).config, rows, cache_length,
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


def _segment_length(k: int, k_before: int | None, before: int, table: adaptive.CostTable,
                    live: int, bucket: int, settings: adaptive.Settings) -> int:
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


def _plan(settings: adaptive.Settings, acceptance, depths: int,
          table: adaptive.CostTable | None, schedule):
  """The acceptance estimate (seeded from `acceptance`, else optimistic ones) and, with K
  forced by `schedule` and no table given, an empty table (nothing to decide with)."""
  estimate = adaptive.AcceptanceEstimate(np.asarray(_seed_alphas(acceptance, depths)),
                                         settings.smoothing, measured=acceptance is not None)
  return estimate, (adaptive.CostTable() if table is None and schedule is not None else table)


def _drive(graphdef, state, s: speculative.DecodeState, *, params, mode,
           settings: adaptive.Settings, estimate: adaptive.AcceptanceEstimate,
           table: adaptive.CostTable, schedule, whole_state: bool, draft_vocab,
           buckets: Sequence[int], stats: Stats, first: tuple[int, int] | None,
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
         adaptive.choose_k(estimate, table, live, s.cache.length, settings.k_max))
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
      spent = time.perf_counter() - t0 - table.call_overhead(s.seq.shape[0])
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
           mode: str, settings: adaptive.Settings, acceptance: Sequence[float] | None = None,
           draft_vocab: jax.Array | None = None, table: adaptive.CostTable | None = None,
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


def _begin(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
           rng: jax.Array, *, max_new_tokens: int, cache_length: int,
           params: sampling.SamplingParams, mode: str, stop_tokens: Sequence[int],
           settings: adaptive.Settings, row_stops: jax.Array | None,
           max_turn_tokens: int | None, whole_state: bool, acceptance=None, draft_vocab=None,
           table=None, schedule=None):
  """The prefill and the first segment, with K chosen for the whole batch before them, then
  the segment loop.

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
  prefill = lambda: speculative.prefill(graphdef, state, prompt_tokens, prompt_lengths, rng,
                                        draft_prefill=False, **kw)
  # `correct`: segments correct the (calibrated) table; `observe`: so do single-turn calls.
  correct = table is None and schedule is None and settings.calibrate
  observe = correct and not whole_state
  calibration_s = 0.0
  if table is None and schedule is None:
    table, calibration_s = _table(
        graphdef, state, prefill, settings=settings, rows=buckets, params=params, mode=mode,
        draft_vocab=draft_vocab, cache_length=cache_length, batch=b,
        max_new_tokens=max_new_tokens, depths=depths)
  if calibration_s and settings.calibrate and settings.compact and not whole_state:
    # A fresh calibration also compiles the gathers of compaction, so that no call of these
    # shapes compiles (each call's seconds count towards its first K's call residual),
    # whichever rows leave its batch.
    t0 = time.perf_counter()
    _warm_compaction(prefill(), buckets, lambda st: st.out)
    calibration_s += time.perf_counter() - t0
  seed = None if acceptance is None else tuple(float(a) for a in acceptance)
  alphas = _seed_alphas(seed, depths)

  def first_choice():  # (K, iterations) of a call's first segment, by the rule or schedule
    if schedule is not None:
      k = schedule(0)
      return k, _segment_length(k, None, 0, table or adaptive.CostTable(), b, cache_length,
                                settings)
    k = adaptive.choose_first_k(alphas, table, b, cache_length, settings.k_max,
                                table.tokens_per_row or max_new_tokens)
    return k, _segment_length(k, None, 0, table, b, cache_length, settings)

  k, iterations = (table.planned.pop(seed, None) if observe else None) or first_choice()
  start_s = time.perf_counter()
  # The prefill (main cache only) and the first segment: the programs the calibration
  # compiled and timed, so whichever K a call begins with compiles nothing new, and the
  # depth caches over the prompt cost what `CostTable.start` measured.
  s = speculative.segment(graphdef, state, prefill(), np.int32(iterations), k=k,
                          params=params, mode=mode, draft_vocab=draft_vocab)
  # While the device runs: the call before's measurement into the table, and the next
  # call's first choice from it.
  if observe:
    table.settle()
    table.planned = {seed: first_choice()}  # one plan kept: for the seed seen last
  estimate, table = _plan(settings, seed, depths, table, schedule)
  stats = Stats(k_iterations={}, segments=[], table=table, alphas=[],
                calibration_s=calibration_s)
  out, stats = _drive(graphdef, state, s, params=params, mode=mode, settings=settings,
                      estimate=estimate, table=table, schedule=schedule,
                      whole_state=whole_state, draft_vocab=draft_vocab, buckets=buckets,
                      stats=stats, first=(k, iterations), observe=correct)
  if observe:
    lengths = jax.device_get(out.lengths)
    table.pending = adaptive.PendingCall(
        k=k, start=start_s, end=time.perf_counter(), lengths=lengths, rows=b,
        bucket=cache_length, k_iterations=dict(stats.k_iterations), weight=settings.smoothing)
  return out, stats


def start(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
          rng: jax.Array, *, max_new_tokens: int, cache_length: int,
          params: sampling.SamplingParams, mode: str, stop_tokens: Sequence[int],
          settings: adaptive.Settings, row_stops: jax.Array | None = None,
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
                        params: sampling.SamplingParams, mode: str,
                        settings: adaptive.Settings, max_turn_tokens: int | None = None,
                        **kwargs) -> tuple[speculative.DecodeState, Stats]:
  """As speculative.continue_with_reply with an adaptive draft length (the state donated).
  Depths left behind are caught up by the next segment that drafts with them."""
  s = speculative.append_reply(graphdef, state, decode_state, reply_tokens, reply_lengths,
                               params=params, max_turn_tokens=max_turn_tokens)
  return decode(graphdef, state, s, params=params, mode=mode, settings=settings,
                whole_state=True, **kwargs)


def generate(graphdef, state, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
             rng: jax.Array, *, max_new_tokens: int, cache_length: int,
             params: sampling.SamplingParams, mode: str, stop_tokens: Sequence[int],
             settings: adaptive.Settings, row_stops: jax.Array | None = None, **kwargs
             ) -> tuple[speculative.SpeculativeOutput, Stats]:
  """Single-turn speculative decoding with an adaptive draft length: the whole batch's
  output (as speculative.generate) and what the call did. `kwargs`: `decode`'s
  acceptance, draft_vocab, table and schedule."""
  return _begin(graphdef, state, prompt_tokens, prompt_lengths, rng,
                max_new_tokens=max_new_tokens, cache_length=cache_length, params=params,
                mode=mode, stop_tokens=stop_tokens, settings=settings, row_stops=row_stops,
                max_turn_tokens=None, whole_state=False, **kwargs)
