"""The adaptive draft length's decision rule (decoding/adaptive.py) against its definition."""

import numpy as np
import pytest

from bebop_jax.decoding import adaptive, segments


def test_expected_tokens_is_one_plus_the_sum_of_the_acceptance_prefix_products():
  a = [0.8, 0.5, 0.25]
  assert adaptive.expected_tokens(a, 0) == 1.0
  assert adaptive.expected_tokens(a, 1) == pytest.approx(1.8)
  assert adaptive.expected_tokens(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
  with pytest.raises(ValueError, match="k=4 is not allowed"):
    adaptive.expected_tokens(a, 4)


def test_the_estimate_is_an_ema_of_observed_rates_and_keeps_unseen_depths():
  est = adaptive.AcceptanceEstimate([0.5, 0.5, 0.5], smoothing=0.25)
  est.update(accepted=[4, 0, 0], attempted=[4, 2, 0])
  np.testing.assert_allclose(est.alphas, [0.75 * 0.5 + 0.25 * 1.0, 0.75 * 0.5, 0.5])
  with pytest.raises(ValueError, match="one entry per depth"):
    est.update([1, 1], [1, 1])
  with pytest.raises(ValueError, match="smoothing=0 is not allowed"):
    adaptive.AcceptanceEstimate([0.5], smoothing=0)


def _table(costs_by_rows):
  t = adaptive.CostTable()
  for rows, costs in costs_by_rows.items():
    for k, s in enumerate(costs):
      t.add(k, rows, 256, s)
  return t


# The decision rule written again from its definitions, independently of the module (none of
# its expected_tokens, lookup, start_cost, call_seconds or call_residual): the brute force
# the module's choices are checked against.


def _tokens_per_iteration(alphas, k):
  """E[tokens | K = k] = 1 + sum_{i=1..k} prod_{j<=i} alpha_j."""
  total, accepted_through = 1.0, 1.0
  for i in range(k):
    accepted_through *= alphas[i]
    total += accepted_through
  return total


def _measured_at_least(sizes, want):
  """The measured size a table reads for `want`: the smallest one >= want, the largest when
  want exceeds them all (a batch or cache bucket is padded up)."""
  larger = [size for size in sorted(sizes) if size >= want]
  return larger[0] if larger else max(sizes)


def _iteration_seconds(seconds, k, rows, bucket):
  """c(K, rows, bucket) from {(k, rows, bucket): seconds} measured on a full grid."""
  r = _measured_at_least({rr for kk, rr, _ in seconds if kk == k}, rows)
  b = _measured_at_least({bb for kk, rr, bb in seconds if kk == k and rr == r}, bucket)
  return seconds[(k, r, b)]


def _call_seconds(t, k, rows, bucket, alphas, call_tokens, misses=()):
  """A call's modelled seconds when it begins with K = k, from the definition: the
  prefill, one segment call's fixed cost and K's start cost (each at the smallest measured
  batch >= rows; no start cost where none was measured for K), call_tokens / E(K)
  iterations of c(K), plus K's call residual: the least of its last 8 misses once
  two are recorded (`t`: the test's own copy of the table's numbers)."""
  fixed = t["prefill"]
  if t["overhead"]:
    fixed += t["overhead"][_measured_at_least(t["overhead"], rows)]
  start_rows = [r for kk, r in t["start"] if kk == k]
  if start_rows:
    fixed += t["start"][(k, _measured_at_least(start_rows, rows))]
  iterations = max(call_tokens, 1.0) / _tokens_per_iteration(alphas, k)
  residual = min(misses[-8:]) if len(misses) >= 2 else 0.0
  return fixed + iterations * _iteration_seconds(t["seconds"], k, rows, bucket) + residual


def _random_costs(rng, k_max):
  """{(k, rows, bucket): seconds} on a grid of 1-3 batch sizes and 1-2 buckets, K costing
  more per draft at a random rate, so that every K in 0..k_max wins somewhere."""
  rows = sorted(rng.choice([1, 2, 4, 8, 16, 64], size=rng.integers(1, 4), replace=False))
  buckets = sorted(rng.choice([64, 128, 256, 512], size=rng.integers(1, 3), replace=False))
  seconds = {}
  for r in rows:
    for b in buckets:
      base, per_draft = rng.uniform(0.5, 2.0), rng.uniform(0.0, 1.0)
      for k in range(k_max + 1):
        seconds[(k, int(r), int(b))] = base * (1 + per_draft * k) * rng.uniform(0.95, 1.05)
  return seconds


def _best(values, largest):
  """The index of the best value, the first of equal ones (the rule's tie-break: the
  smaller K), or None when another value is within 1e-9 relative of it
  without being equal (a near tie that rounding may decide either way)."""
  best = max(values) if largest else min(values)
  if any(v != best and abs(v - best) <= 1e-9 * abs(best) for v in values):
    return None
  return values.index(best)


def _brute_force_choices(trials, seed=0):
  """(the module's choose_k, the brute force's argmax) over random acceptance, cost tables,
  live batches and buckets."""
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(trials):
    k_max = int(rng.integers(1, 5))
    alphas = rng.uniform(0.0, 1.0, k_max)
    seconds = _random_costs(rng, k_max)
    table = adaptive.CostTable()
    for (k, r, b), s in seconds.items():
      table.add(k, r, b, s)
    rows, bucket = int(rng.integers(1, 80)), int(rng.integers(1, 600))
    rates = [_tokens_per_iteration(alphas, k) / _iteration_seconds(seconds, k, rows, bucket)
             for k in range(k_max + 1)]
    want = _best(rates, largest=True)
    if want is not None:
      pairs.append((adaptive.choose_k(adaptive.AcceptanceEstimate(alphas), table, rows,
                                      bucket, k_max), want))
  return pairs


def test_choose_k_maximises_expected_tokens_per_second_by_brute_force(monkeypatch):
  """choose_k is the K in 0..k_max of the most E[tokens | K] / c(K, rows, bucket), computed
  by the brute force above on 400 random cases (1-4 depths, costs on grids of batch sizes
  and buckets, live batches and buckets between and beyond the measured ones); every K
  wins somewhere. The brute force has power: with E[tokens | K] broken to
  1 + sum_{k<=K} alpha_k (no products), the module's choices disagree with it."""
  pairs = _brute_force_choices(400)
  assert len(pairs) >= 390  # near ties are skipped
  for got, want in pairs:
    assert got == want
  assert {want for _, want in pairs} == {0, 1, 2, 3, 4}
  monkeypatch.setattr(adaptive, "expected_tokens",
                      lambda alphas, k: 1.0 + float(np.sum(np.asarray(alphas)[:k])))
  assert sum(got != want for got, want in _brute_force_choices(400)) >= 10


def test_a_calls_first_choice_is_the_brute_force_least_modelled_call_seconds(monkeypatch):
  """A call's first K (choose_first_k, and choose_k with call_tokens) is the one of the
  least modelled seconds of the whole call plus K's call residual, computed by the brute
  force above on 300 random cases: prefill, segment-call cost and start costs measured at
  some batch sizes, misses recorded for some K (more than 8 for some: only the last 8
  count), random call lengths. The brute force has power: with the call residual broken to
  the latest miss instead of the least of the last 8, the module's choices disagree with
  it."""
  def run(trials, seed=1):
    rng = np.random.default_rng(seed)
    disagree, checked, wants = 0, 0, set()
    for _ in range(trials):
      k_max = int(rng.integers(1, 4))
      alphas = tuple(float(a) for a in rng.uniform(0.0, 1.0, k_max))
      t = {"seconds": _random_costs(rng, k_max), "prefill": float(rng.uniform(0, 2)),
           "overhead": {int(r): float(rng.uniform(0, 1))
                        for r in rng.choice([1, 4, 16], size=rng.integers(0, 3),
                                            replace=False)},
           "start": {(k, int(r)): float(rng.uniform(0, 20))
                     for k in range(1, k_max + 1)
                     for r in rng.choice([1, 4, 16], size=rng.integers(0, 3),
                                         replace=False)}}
      table = adaptive.CostTable(prefill=t["prefill"], overhead=dict(t["overhead"]),
                                 start=dict(t["start"]))
      for (k, r, b), s in t["seconds"].items():
        table.add(k, r, b, s)
      misses = {}
      for k in range(k_max + 1):
        for _ in range(int(rng.choice([0, 1, 2, 5, 12]))):
          miss = float(rng.uniform(-2, 10))
          misses.setdefault(k, []).append(miss)
          table.observe_call(10.0, 0.5, k=k, seconds=100.0 + miss, modelled=100.0)
      rows, bucket = int(rng.integers(1, 40)), int(rng.integers(1, 600))
      call_tokens = float(rng.uniform(0.5, 300))
      total = [_call_seconds(t, k, rows, bucket, alphas, call_tokens, misses.get(k, ()))
               for k in range(k_max + 1)]
      want = _best(total, largest=False)
      if want is None:
        continue
      checked += 1
      wants.add(want)
      disagree += adaptive.choose_first_k(alphas, table, rows, bucket, k_max,
                                          call_tokens) != want
      disagree += adaptive.choose_k(adaptive.AcceptanceEstimate(np.asarray(alphas)), table,
                                    rows, bucket, k_max, call_tokens=call_tokens) != want
    return disagree, checked, wants

  disagree, checked, wants = run(300)
  assert disagree == 0 and checked >= 290 and wants == {0, 1, 2, 3}
  monkeypatch.setattr(adaptive.CostTable, "call_residual",
                      lambda self, k: self.call_misses.get(k, [0.0])[-1])
  assert run(300)[0] >= 10


def test_choose_k_switches_speculation_off_where_it_cannot_pay():
  # Cheap verification at batch 1, expensive at batch 64 (a compute-bound forward).
  table = _table({1: [1.0, 1.1, 1.2, 1.3], 64: [1.0, 1.9, 2.8, 3.7]})
  good = adaptive.AcceptanceEstimate([0.9, 0.9, 0.9])
  assert adaptive.choose_k(good, table, 1, 256, 3) == 3
  assert adaptive.choose_k(good, table, 64, 256, 3) == 0
  # A batch between measured sizes is costed at the next larger one (it is padded up).
  assert table.lookup(2, 9, 100) == 2.8 and table.lookup(2, 100, 9999) == 2.8
  assert adaptive.choose_k(adaptive.AcceptanceEstimate([0.05, 0.05, 0.05]), table, 1, 256,
                           3) == 0
  with pytest.raises(KeyError, match="k=5"):
    table.lookup(5, 1, 256)


def test_a_short_call_does_not_pay_for_the_depth_caches():
  """A first segment spreads K's start cost (the depth caches over the prompt) over the
  call's expected iterations at K: the same table and acceptance choose K = 3 for a long
  call and K = 0 for a short one; brute force over every K agrees."""
  table = _table({1: [1.0, 1.2, 1.4, 1.6]})
  table.start.update({(1, 1): 4.0, (2, 1): 6.0, (3, 1): 8.0})
  good = adaptive.AcceptanceEstimate([0.9, 0.9, 0.9])
  assert adaptive.choose_k(good, table, 1, 256, 3) == 3  # no call length: the start is free
  costs = [1.0, 1.2, 1.4, 1.6]
  start = [0.0, 4.0, 6.0, 8.0]
  for call_tokens in (1, 4, 16, 64, 512):
    seconds = [start[k] + call_tokens / _tokens_per_iteration([0.9] * 3, k) * costs[k]
               for k in range(4)]
    want = int(np.argmin(seconds))
    assert adaptive.choose_k(good, table, 1, 256, 3, call_tokens=call_tokens) == want
  assert adaptive.choose_k(good, table, 1, 256, 3, call_tokens=4) == 0
  assert adaptive.choose_k(good, table, 1, 256, 3, call_tokens=512) == 3
  # Calls' lengths move the estimate: the first sets it, then an EMA.
  table.observe_call(20.0, 0.5)
  table.observe_call(10.0, 0.5)
  assert table.tokens_per_row == 15.0
  assert table.start_cost(2, 64) == 6.0 and adaptive.CostTable().start_cost(1, 1) == 0.0


def test_calls_that_cost_more_than_modelled_move_the_choice():
  """A call's first K is chosen by its modelled seconds plus K's call residual: the least
  of K's last CALL_WINDOW misses once two are recorded (one slow call does not rule K
  out), and a K whose calls keep costing more than modelled loses to one not yet measured
  (which counts the model alone)."""
  table = _table({1: [1.0, 1.2, 1.4, 1.6]})
  table.prefill, table.overhead[1] = 5.0, 0.5
  good = adaptive.AcceptanceEstimate([0.9, 0.9, 0.9])
  tokens = 64.0
  # The model from its definition: prefill + call cost + tokens / E(K) iterations of c(K).
  modelled = [5.0 + 0.5 + tokens / _tokens_per_iteration([0.9] * 3, k) * c
              for k, c in enumerate([1.0, 1.2, 1.4, 1.6])]
  np.testing.assert_allclose([table.call_seconds(k, 1, 256, good.alphas, tokens)
                              for k in range(4)], modelled, rtol=1e-12)
  assert modelled[3] == pytest.approx(5.5 + 64 / (1 + 0.9 + 0.81 + 0.729) * 1.6)
  assert adaptive.choose_k(good, table, 1, 256, 3, call_tokens=tokens) == 3
  table.observe_call(tokens, 0.5, k=3, seconds=modelled[3] + 30.0, modelled=modelled[3])
  assert table.calls == {3: 1}
  assert table.call_misses[3] == [pytest.approx(30.0)]
  assert table.call_residual(3) == 0.0  # one miss: the model alone still
  assert adaptive.choose_k(good, table, 1, 256, 3, call_tokens=tokens) == 3
  table.observe_call(tokens, 0.5, k=3, seconds=modelled[3] + 25.0, modelled=modelled[3])
  assert table.call_residual(3) == pytest.approx(25.0)
  # K = 3 now costs its model plus 25 s: the best of the rest by the model alone.
  want = int(np.argmin([m + (25.0 if k == 3 else 0.0) for k, m in enumerate(modelled)]))
  assert want == 2 and adaptive.choose_k(good, table, 1, 256, 3, call_tokens=tokens) == want
  # Only the last CALL_WINDOW misses count.
  for _ in range(adaptive.CALL_WINDOW):
    table.observe_call(tokens, 0.5, k=3, seconds=modelled[3] + 40.0, modelled=modelled[3])
  assert table.call_residual(3) == pytest.approx(40.0)
  assert len(table.call_misses[3]) == adaptive.CALL_WINDOW
  # Without a call length (a later segment) the per-iteration rule is unchanged.
  assert adaptive.choose_k(good, table, 1, 256, 3) == 3
  # A new prompt bucket's table starts from this one's call length and misses (copies).
  other = _table({1: [1.0, 1.2, 1.4, 1.6]})
  other.seed_from(table)
  assert other.tokens_per_row == table.tokens_per_row and other.calls == {}
  assert other.call_residual(3) == pytest.approx(40.0)
  other.observe_call(tokens, 0.5, k=3, seconds=modelled[3], modelled=modelled[3])
  assert other.call_residual(3) == 0.0 and table.call_residual(3) == pytest.approx(40.0)


def test_weight_read_costs_charge_each_depth_a_block_and_the_head():
  from bebop_jax.model import config as model_config  # pylint: disable=g-import-not-at-top
  c = model_config.preset("tiny")
  t = adaptive.weight_read_costs(c, [1, 8], 64, 3)
  d, f, v = c.d_model, c.mlp_dim, c.vocab_size
  block = d * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * d * f
  depth = (block + 2 * d * d + d * v) / (c.num_layers * block + d * v)
  for k in range(4):
    assert t.lookup(k, 8, 64) == pytest.approx(1 + k * depth)
  reduced = adaptive.weight_read_costs(c, [1], 64, 3, draft_vocab_size=v // 4)
  assert reduced.lookup(3, 1, 64) < t.lookup(3, 1, 64)


def test_settings_and_batch_buckets():
  assert segments.batch_buckets(64) == [64, 16, 4, 1]
  assert segments.batch_buckets(8, 2) == [8, 4, 2, 1]
  assert segments.batch_buckets(1) == [1]
  with pytest.raises(ValueError, match="batch_factor=1 is not allowed"):
    adaptive.Settings(k_max=3, batch_factor=1)
  with pytest.raises(ValueError, match="segment=0"):
    adaptive.Settings(k_max=3, segment=0)


def test_an_unmeasured_seed_is_replaced_by_the_first_observation():
  est = adaptive.AcceptanceEstimate([1.0, 1.0], smoothing=0.2, measured=False)
  est.update([1, 0], [4, 0])
  np.testing.assert_allclose(est.alphas, [0.25, 1.0])
  est.update([4, 2], [4, 4])
  np.testing.assert_allclose(est.alphas, [0.8 * 0.25 + 0.2, 0.5])


def test_the_eval_stage_summarizes_adaptive_rows():
  from bebop_jax.stages import eval as eval_stage  # pylint: disable=g-import-not-at-top
  table = [{"k": 0, "rows": 1, "bucket": 64, "seconds": 0.001}]
  rows = [{"batch": 1, "mode": "rejection", "speedup": 0.9},
          {"batch": 1, "mode": "rejection", "k": "adaptive", "speedup": 1.1,
           "k_iterations": {"0": 10, "2": 5}, "cost_table": table},
          {"batch": 1, "mode": "block", "k": "adaptive", "speedup": 1.2,
           "k_iterations": {"3": 4}, "cost_table": table}]
  got = eval_stage._adaptive_summary(rows, "rejection")["adaptive"]  # pylint: disable=protected-access
  assert got == {"speedup_vs_autoregressive": {"1": 1.1},
                 "k_iterations": {"1": {"0": 10, "2": 5}}, "cost_table": table}
  assert eval_stage._adaptive_summary(rows[:1], "rejection") == {}  # pylint: disable=protected-access


def test_a_segment_is_long_enough_that_its_call_overhead_stays_a_small_fraction():
  table = adaptive.CostTable()
  for rows in (1, 8):
    table.add(0, rows, 64, 1e-4 * rows)
    table.add(2, rows, 64, 2e-4 * rows)
  assert table.min_iterations(0, 1, 64, 0.02) == 1  # no overhead measured
  table.overhead.update({1: 1e-3, 8: 2e-3})
  # ceil(overhead / (fraction * seconds per iteration)), at the next measured batch size.
  assert table.min_iterations(0, 1, 64, 0.02) == 500
  assert table.min_iterations(2, 1, 64, 0.02) == 250
  assert table.min_iterations(2, 5, 64, 0.02) == 63  # rows 5 -> the 8-row entries
  assert table.min_iterations(2, 5, 64, 1.0) == 2


def test_observed_segments_move_the_entry_that_lookup_reads():
  table = adaptive.CostTable()
  for rows in (1, 8):
    table.add(3, rows, 64, 1.0)
  table.observe(3, 5, 64, 3.0, weight=0.25)  # 5 live rows run as the 8-row batch
  assert table.lookup(3, 8, 64) == 1.5 and table.lookup(3, 1, 64) == 1.0
  table.observe(0, 8, 64, 3.0, weight=0.25)  # K never calibrated: nothing to correct
  assert (0, 8, 64) not in table.seconds
  with pytest.raises(ValueError, match="host_fraction"):
    adaptive.Settings(k_max=2, host_fraction=0.0)
