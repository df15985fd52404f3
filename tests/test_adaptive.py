"""The adaptive draft length's decision rule (decoding/adaptive.py) against its definition."""

import numpy as np
import pytest

from bebop_jax.decoding import adaptive


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


def test_choose_k_maximises_expected_tokens_per_second_by_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(200):
    alphas = rng.uniform(0, 1, 4)
    costs = np.sort(rng.uniform(1, 3, 5))
    table = _table({8: costs})
    want = int(np.argmax([adaptive.expected_tokens(alphas, k) / costs[k] for k in range(5)]))
    assert adaptive.choose_k(adaptive.AcceptanceEstimate(alphas), table, 8, 256, 4) == want


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
  for call_tokens in (1, 4, 16, 64, 512):
    seconds = [table.start_cost(k, 1) + call_tokens / adaptive.expected_tokens(good.alphas, k)
               * table.lookup(k, 1, 256) for k in range(4)]
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
  modelled = [table.call_seconds(k, 1, 256, good.alphas, tokens) for k in range(4)]
  assert modelled[0] == pytest.approx(5.0 + 0.5 + 64 * 1.0)
  assert modelled[3] == pytest.approx(5.5 + 64 / adaptive.expected_tokens(good.alphas, 3) * 1.6)
  assert adaptive.choose_k(good, table, 1, 256, 3, call_tokens=tokens) == 3
  table.observe_call(tokens, 0.5, k=3, seconds=modelled[3] + 30.0, modelled=modelled[3])
  assert table.calls == {(3, False): 1}
  assert table.call_misses[(3, False)] == [pytest.approx(30.0)]
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
  assert len(table.call_misses[(3, False)]) == adaptive.CALL_WINDOW
  # Without a call length (a later segment) the per-iteration rule is unchanged.
  assert adaptive.choose_k(good, table, 1, 256, 3) == 3
  # A new prompt bucket's table starts from this one's call length and misses (copies).
  other = _table({1: [1.0, 1.2, 1.4, 1.6]})
  other.seed_from(table)
  assert other.tokens_per_row == table.tokens_per_row and other.calls == {}
  assert other.call_residual(3) == pytest.approx(40.0)
  other.observe_call(tokens, 0.5, k=3, seconds=modelled[3], modelled=modelled[3])
  assert other.call_residual(3) == 0.0 and table.call_residual(3) == pytest.approx(40.0)


def test_the_arms_of_one_k_share_the_model_and_are_told_apart_by_their_calls():
  """A call's first choice is among arms (K, whole): K = 0 as the autoregressive program
  and K = 0 in segments have the same modelled seconds; the earlier arm wins a tie, and
  once its calls cost more than modelled the other is tried, and kept only if it delivers.
  An arm's misses are its own."""
  table = _table({8: [1.0, 1.5]})
  table.prefill, table.overhead[8] = 2.0, 0.5
  alphas, tokens = (0.2,), 32.0
  arms = [(0, True), (0, False), (1, False)]
  choose = lambda: adaptive.choose_first_k(alphas, table, 8, 256, 1, tokens, arms)
  assert choose() == (0, True)  # the model alone: K = 1 loses, the tie to the earlier arm
  modelled = table.call_seconds(0, 8, 256, alphas, tokens)
  for _ in range(2):
    table.observe_call(tokens, 0.5, k=0, whole=True, seconds=modelled + 3.0,
                       modelled=modelled)
  assert table.call_residual(0, whole=True) == pytest.approx(3.0)
  assert table.call_residual(0) == 0.0 and choose() == (0, False)
  for _ in range(2):
    table.observe_call(tokens, 0.5, k=0, seconds=modelled + 5.0, modelled=modelled)
  assert choose() == (0, True)
  assert adaptive.choose_first_k(alphas, table, 8, 256, 1, tokens) == (0, False)  # segments


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
  assert adaptive.batch_buckets(64) == [64, 16, 4, 1]
  assert adaptive.batch_buckets(8, 2) == [8, 4, 2, 1]
  assert adaptive.batch_buckets(1) == [1]
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
  from bebop_jax import eval_stage  # pylint: disable=g-import-not-at-top
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
