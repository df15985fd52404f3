"""experiments/findings/stats.py and the paired comparisons of the findings, against scipy and
numpy references written from the definitions."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.findings import objectives, stats, through_rl


def test_t_interval_is_scipys_one_sample_and_paired_interval():
  rng = np.random.default_rng(0)
  a = rng.normal(0.93, 0.01, 3)
  b = a + rng.normal(0.01, 0.002, 3)
  got = stats.t_interval(b - a)
  ref = scipy_stats.ttest_rel(b, a).confidence_interval(0.95)
  assert got["ci95"] == pytest.approx([ref.low, ref.high])
  assert got["df"] == 2 and got["n"] == 3
  assert got["se"] == pytest.approx(np.std(b - a, ddof=1) / np.sqrt(3))
  # Two seeds: t at 1 df is 12.7, so the interval is 12.7 standard errors wide each side.
  two = stats.t_interval([0.01, 0.02])
  assert stats.t_critical(1) == pytest.approx(12.7062, abs=1e-4)
  assert two["ci95"][1] - two["mean"] == pytest.approx(12.7062 * two["se"], rel=1e-5)
  assert np.isnan(stats.t_interval([0.5])["ci95"][0])


def test_fit_line_is_linregress_with_t_at_n_minus_2():
  rng = np.random.default_rng(1)
  x = rng.uniform(0.2, 1.0, 30)
  y = 0.9 - 0.2 * x + rng.normal(0, 0.02, 30)
  f = stats.fit_line(x, y)
  ref = scipy_stats.linregress(x, y)
  half = scipy_stats.t.ppf(0.975, 28) * ref.stderr
  assert f["slope"] == pytest.approx(ref.slope)
  assert f["slope_ci95"] == pytest.approx([ref.slope - half, ref.slope + half])
  assert f["r2"] == pytest.approx(ref.rvalue ** 2)
  assert (f["x_min"], f["x_max"], f["x_range"]) == pytest.approx((x.min(), x.max(), np.ptp(x)))
  assert f["ordered"] is False and f["corrected"] is False


def _lag1_reference(r):
  m = np.mean(r)
  num = sum((r[t] - m) * (r[t - 1] - m) for t in range(1, len(r)))
  return num / sum((v - m) ** 2 for v in r)


def _newey_west_reference(x, y, lags):
  """Var(beta) = (X'X)^-1 S (X'X)^-1 n / (n - k), S = sum_l w_l sum_t (e_t X_t)(e_{t-l} X_{t-l})'
  + its transpose for l >= 1, Bartlett weights: the full sandwich, from the definition."""
  n = len(x)
  X = np.column_stack([np.ones(n), x])
  beta = np.linalg.solve(X.T @ X, X.T @ y)
  e = y - X @ beta
  g = X * e[:, None]
  S = g.T @ g
  for lag in range(1, lags + 1):
    w = 1 - lag / (lags + 1)
    gamma = g[lag:].T @ g[:-lag]
    S += w * (gamma + gamma.T)
  bread = np.linalg.inv(X.T @ X)
  V = bread @ S @ bread * n / (n - 2)
  return float(np.sqrt(V[1, 1]))


def test_series_fit_against_the_sandwich_and_ar1_definitions():
  rng = np.random.default_rng(2)
  n = 40
  x = np.cumsum(rng.normal(0, 0.02, n)) + 0.3
  noise = np.zeros(n)
  for t in range(1, n):
    noise[t] = 0.6 * noise[t - 1] + rng.normal(0, 0.01)
  y = 0.95 - 0.2 * x + noise
  f = stats.fit_series(x, y)
  lags = int(np.floor(4 * (n / 100) ** (2 / 9)))
  assert f["hac"]["lags"] == lags == 3
  assert f["hac"]["slope_se"] == pytest.approx(_newey_west_reference(x, y, lags), rel=1e-9)
  resid = y - np.polyval(np.polyfit(x, y, 1), x)
  rho = _lag1_reference(resid)
  assert f["residual_lag1_autocorrelation"] == pytest.approx(rho)
  n_eff = n * (1 - max(rho, 0)) / (1 + max(rho, 0))
  assert f["ar1"]["n_eff"] == pytest.approx(n_eff)
  ols = scipy_stats.linregress(x, y)
  ar_half = scipy_stats.t.ppf(0.975, n_eff - 2) * ols.stderr * np.sqrt((n - 2) / (n_eff - 2))
  assert f["ar1"]["slope_ci95"][1] - f["slope"] == pytest.approx(ar_half)
  hac_half = scipy_stats.t.ppf(0.975, n - 2) * f["hac"]["slope_se"]
  assert f["slope_ci95"][1] - f["slope"] == pytest.approx(max(ar_half, hac_half))
  assert f["ordered"] and f["corrected"]
  assert f["ols_slope_ci95"] == pytest.approx(stats.fit_line(x, y)["slope_ci95"])


def test_series_interval_keeps_its_coverage_under_autocorrelated_noise():
  """A trending x and AR(1) noise (rho 0.7): the independent-points interval covers the true
  slope far less often than 95%; the corrected one comes much closer."""
  rng = np.random.default_rng(3)
  n, reps, true = 40, 300, -0.2
  hits_ols = hits_series = 0
  for _ in range(reps):
    x = np.linspace(0.2, 0.6, n) + rng.normal(0, 0.01, n)
    noise = np.zeros(n)
    noise[0] = rng.normal(0, 0.014)
    for t in range(1, n):
      noise[t] = 0.7 * noise[t - 1] + rng.normal(0, 0.01)
    f = stats.fit_series(x, 0.9 + true * x + noise)
    hits_ols += f["ols_slope_ci95"][0] < true < f["ols_slope_ci95"][1]
    hits_series += f["slope_ci95"][0] < true < f["slope_ci95"][1]
  assert hits_ols / reps < 0.75
  assert hits_series / reps > 0.85
  assert hits_series > hits_ols + 0.15 * reps


def _arm(steps, acc, entropy, pass_delta=0.0):
  acc = np.asarray(acc)
  return {"steps": list(steps), "entropy": list(entropy),
          "tf_acceptance": {"rejection": acc[:, None].repeat(3, 1).tolist(),
                            "greedy_draft": acc[:, None].repeat(3, 1).tolist()},
          "eval_acceptance": {"rejection": [[acc[0]] * 3, [acc[-1]] * 3],
                              "greedy_draft": [[acc[0]] * 3, [acc[-1]] * 3]},
          "pass_at_1_delta": {"math": {"delta": pass_delta, "se": 0.01}}}


def test_difference_of_differences_pairs_by_step():
  """Both arms share each step's batch noise (same prompts and rollout key): the per-step
  difference removes it, so the difference of differences is the numpy fit of a - c and far
  narrower than two unpaired trends combined."""
  rng = np.random.default_rng(4)
  steps = np.arange(1, 31)
  shared = rng.normal(0, 0.02, steps.size)
  a = 0.93 - 0.0005 * steps + shared + rng.normal(0, 0.001, steps.size)
  c = 0.91 + 0.0010 * steps + shared + rng.normal(0, 0.001, steps.size)
  ent = np.full(steps.size, 0.3)
  arm, control = _arm(steps, a, ent), _arm(steps, c, ent)
  did = through_rl.difference_of_differences(arm, control)
  slope = np.polyfit(steps, a - c, 1)[0]
  assert did["slope"] == pytest.approx(slope)
  assert did["change"] == pytest.approx(slope * 29)
  assert did["change_ci95"][0] < -0.0015 * 29 < did["change_ci95"][1]
  ta, tc = through_rl.trend(arm), through_rl.trend(control)
  assert ta["change"] - tc["change"] == pytest.approx(did["change"])
  unpaired_half = np.hypot(ta["change_ci95"][1] - ta["change"], tc["change_ci95"][1] - tc["change"])
  assert did["change_ci95"][1] - did["change"] < unpaired_half / 5
  assert did["change_ci95"][1] < 0  # paired, the loss against the control is clear


def test_objectives_comparison_is_paired_by_seed():
  """Seed effects shared by every loss (same data order and start): the per-seed gains are
  scipy's paired interval on acc_e2e / acc_ce - 1."""
  seed_effect = [0.00, 0.03, -0.03]
  gain = {"ce": 0.0, "kl": 0.004, "tv": 0.010, "e2e_tv": 0.012}
  rows = []
  for loss, g in gain.items():
    for k, e in enumerate(seed_effect):
      acc = 0.9 + e + g + 0.001 * ((k * 7 + len(loss)) % 3)
      rows.append({"loss": loss, "seed": k, "mode": "rejection", "task": "all",
                   "acceptance": [acc, acc, acc], "tokens_per_target_forward": 3 * acc})
  comp = objectives.comparison(rows, objectives.aggregate(rows))
  e2e = np.asarray([r["acceptance"][0] for r in rows if r["loss"] == "e2e_tv"])
  ce = np.asarray([r["acceptance"][0] for r in rows if r["loss"] == "ce"])
  ref = scipy_stats.ttest_1samp(e2e / ce - 1, 0).confidence_interval(0.95)
  assert comp["paired"]["e2e_tv"]["ci95"] == pytest.approx([ref.low, ref.high])
  assert comp["paired"]["e2e_tv"]["df"] == 2
  assert comp["best"] == "e2e_tv" and comp["seeds"] == 3
  # Unpaired, the seed effect swamps the gain; paired it does not.
  assert comp["gains_over_ce"]["e2e_tv"]["relative_gain"] < 2 * comp["gains_over_ce"][
      "e2e_tv"]["relative_gain_se"]
  assert comp["paired"]["e2e_tv"]["ci95"][0] > 0


def test_held_out_evaluations_are_read_in_integer_step_order():
  """An RL summary's eval_by_step comes back from JSON with its keys sorted as text ("0",
  "12", "6"): F4's "after" is the last step as an integer (12), not the last key."""
  import json  # pylint: disable=g-import-not-at-top
  evals = {step: {"acceptance": {m: [step / 100] * 3 for m in ("rejection", "greedy_draft")},
                  "pass_at_1": {"math": step / 10, "code": 0.0}} for step in (0, 6, 12)}
  from_json = json.loads(json.dumps({str(k): v for k, v in evals.items()}, sort_keys=True))
  assert list(from_json) == ["0", "12", "6"]
  points = through_rl.held_out_by_step(from_json)
  assert points["eval_steps"] == [0, 6, 12]
  assert [a[0] for a in points["eval_acceptance"]["rejection"]] == [0.0, 0.06, 0.12]
  assert points["eval_pass_at_1"] == [0.0, 0.3, 0.6]


def test_bootstrap_of_a_mean_matches_its_normal_interval_and_vector_statistics():
  """The percentile bootstrap of a sample mean against mean +- 1.96 s / sqrt(n) (large n,
  where the two agree), entry by entry for a vector statistic; resamples are reproducible
  from the seed; fewer than two units give no interval."""
  rng = np.random.default_rng(0)
  x = rng.normal(1.0, 2.0, 400)
  y = rng.exponential(1.0, 400)
  b = stats.bootstrap(lambda i: np.array([x[i].mean(), y[i].mean()]), 400, draws=4000, seed=1)
  for j, v in enumerate((x, y)):
    half = 1.96 * v.std(ddof=1) / np.sqrt(v.size)
    assert b["value"][j] == pytest.approx(v.mean())
    assert b["ci95"][0][j] == pytest.approx(v.mean() - half, abs=0.15 * half)
    assert b["ci95"][1][j] == pytest.approx(v.mean() + half, abs=0.15 * half)
    assert b["se"][j] == pytest.approx(half / 1.96, rel=0.1)
  again = stats.bootstrap(lambda i: np.array([x[i].mean(), y[i].mean()]), 400, draws=4000,
                          seed=1)
  assert again["ci95"] == b["ci95"]
  one = stats.bootstrap(lambda i: x[i].mean(), 1)
  assert np.isnan(one["ci95"][0]) and one["draws"] == 0


def test_rescoring_points_from_sequence_sums_equal_the_pooled_ratios():
  """acceptance_entropy.points_from_units over every sequence: per temperature, the entropy
  and per-depth acceptance pooled over all positions (sum over sequences / count), and a
  resample with repeats weights each sequence by its multiplicity."""
  from experiments.findings import acceptance_entropy  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  temps, n, k = 3, 5, 2
  count = rng.integers(1, 9, n).astype(float)
  ent = rng.uniform(0, 2, (temps, n)) * count
  alpha = {m: rng.uniform(0, 1, (temps, n, k)) * count[None, :, None]
           for m in ("rejection", "greedy_draft")}
  units = {"temperature": np.arange(temps, dtype=float), "entropy_sum": ent,
           "entropy_count": count, "alpha_sum": alpha,
           "alpha_count": np.repeat(count[:, None], k, 1)}
  pts = acceptance_entropy.points_from_units(units, np.arange(n))
  for t in range(temps):
    assert pts["rejection"]["entropy"][t] == pytest.approx(ent[t].sum() / count.sum())
    per_depth = alpha["greedy_draft"][t].sum(0) / count.sum()
    assert pts["greedy_draft"]["depth1"][t] == pytest.approx(per_depth[0])
    assert pts["greedy_draft"]["mean"][t] == pytest.approx(per_depth.mean())
  twice = acceptance_entropy.points_from_units(units, np.array([0, 0, 3]))
  w = np.array([2 * count[0], count[3]])
  assert twice["rejection"]["depth1"][1] == pytest.approx(
      (2 * alpha["rejection"][1, 0, 0] + alpha["rejection"][1, 3, 0]) / w.sum())
