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
