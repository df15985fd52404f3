"""The statistics the findings' verdict rules decide on.

  t_interval            mean, standard error and 95% Student-t interval of a sample
                        (n - 1 degrees of freedom); on paired differences, the paired test
  fit_line              least squares y = a + b x with the slope's 95% t interval (n - 2 df),
                        the x range the points cover and the lag-1 autocorrelation of the
                        residuals
  fit_series            fit_line for points ordered in time (one per RL step), whose noise is
                        autocorrelated: the slope's interval is the wider of the Newey-West
                        (HAC, Bartlett kernel) interval and the AR(1) effective-sample-size one
  change_over_run       a series fit's slope times the span of x, with its interval
  bootstrap             percentile interval of a statistic over resampled units (prompts),
                        which includes the sampling error of the units themselves

Every interval is two-sided 95% with the Student-t critical value of its own degrees of
freedom: with 2 seeds (1 df) that value is 12.7, not 2.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

LEVEL = 0.95
NAN = float("nan")


def t_critical(df: float, level: float = LEVEL) -> float:
  """The two-sided Student-t critical value at `level` for `df` degrees of freedom (nan when
  df < 1)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top  (a dependency of jax)
  if not df >= 1:
    return NAN
  return float(stats.t.ppf(0.5 + level / 2, df))


def t_interval(values: Sequence[float] | np.ndarray) -> dict[str, Any]:
  """Mean of `values`, its standard error and the 95% Student-t interval at n - 1 degrees of
  freedom. On per-seed (or per-step) differences of two arms this is the paired t interval.
  Fewer than two values: nan error and interval."""
  v = np.asarray(values, float)
  n = int(v.size)
  mean = float(v.mean()) if n else NAN
  if n < 2:
    return {"mean": mean, "se": NAN, "df": max(n - 1, 0), "t": NAN, "ci95": [NAN, NAN], "n": n}
  se = float(v.std(ddof=1) / math.sqrt(n))
  t = t_critical(n - 1)
  return {"mean": mean, "se": se, "df": n - 1, "t": t, "ci95": [mean - t * se, mean + t * se],
          "n": n}


def lag1_autocorrelation(values: Sequence[float] | np.ndarray) -> float:
  """sum_t (r_t - m)(r_{t-1} - m) / sum_t (r_t - m)^2 (nan when fewer than 3 values or no
  spread)."""
  r = np.asarray(values, float)
  if r.size < 3:
    return NAN
  c = r - r.mean()
  denom = float(np.sum(c * c))
  return float(np.sum(c[1:] * c[:-1]) / denom) if denom > 0 else NAN


def newey_west_lags(n: int) -> int:
  """Newey and West's (1994) rule of thumb for the Bartlett kernel's bandwidth:
  floor(4 (n / 100)^(2/9)), at least 1."""
  return max(1, int(math.floor(4.0 * (n / 100.0) ** (2.0 / 9.0))))


def _empty_fit(n: int, x: np.ndarray, ordered: bool) -> dict[str, Any]:
  return {"slope": NAN, "intercept": NAN, "r2": NAN, "slope_se": NAN, "df": 0,
          "slope_ci95": [NAN, NAN], "points": n, **x_range(x),
          "residual_lag1_autocorrelation": NAN, "ordered": ordered, "corrected": False}


def x_range(x: Sequence[float] | np.ndarray) -> dict[str, float]:
  """{"x_min", "x_max", "x_range"} of the points (nan when none)."""
  x = np.asarray(x, float)
  if not x.size:
    return {"x_min": NAN, "x_max": NAN, "x_range": NAN}
  return {"x_min": float(x.min()), "x_max": float(x.max()), "x_range": float(x.max() - x.min())}


def fit_line(x: Sequence[float], y: Sequence[float], *, ordered: bool = False
             ) -> dict[str, Any]:
  """Least squares y = intercept + slope * x.

  Args:
    x, y: the points.
    ordered: whether the points are in time order (a series); recorded, so that a rule can
      refuse an uncorrected interval of a series.

  Returns:
    slope, intercept, r2, the slope's standard error and 95% Student-t interval (n - 2
    degrees of freedom), the x range the points cover (x_min, x_max, x_range), the lag-1
    autocorrelation of the residuals in the given order, the point count, `ordered`, and
    `corrected` False: the interval assumes independent points.
  """
  x, y = np.asarray(x, float), np.asarray(y, float)
  n = len(x)
  spread = float(np.sum((x - x.mean()) ** 2)) if n else 0.0
  if n < 2 or spread == 0:
    return _empty_fit(n, x, ordered)
  slope, intercept = np.polyfit(x, y, 1)
  resid = y - (intercept + slope * x)
  total = float(np.sum((y - y.mean()) ** 2))
  se = float(np.sqrt(np.sum(resid ** 2) / (n - 2) / spread)) if n > 2 else NAN
  half = t_critical(n - 2) * se if n > 2 else NAN
  return {"slope": float(slope), "intercept": float(intercept),
          "r2": float(1 - np.sum(resid ** 2) / total) if total > 0 else 0.0,
          "slope_se": se, "df": n - 2, "slope_ci95": [float(slope - half), float(slope + half)],
          "points": n, **x_range(x),
          "residual_lag1_autocorrelation": lag1_autocorrelation(resid), "ordered": ordered,
          "corrected": False}


def newey_west_slope_se(x: Sequence[float], y: Sequence[float], lags: int) -> float:
  """The slope's Newey-West (HAC) standard error of the least-squares line: with c_t = x_t -
  mean(x) and residuals e_t, Var = n / (n - 2) * sum_{|t-s| <= L} w_{|t-s|} c_t e_t c_s e_s /
  (sum c_t^2)^2, Bartlett weights w_l = 1 - l / (L + 1)."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  n = len(x)
  c = x - x.mean()
  slope = float(np.sum(c * (y - y.mean())) / np.sum(c * c))
  resid = (y - y.mean()) - slope * c
  u = c * resid
  meat = float(np.sum(u * u))
  for lag in range(1, min(lags, n - 1) + 1):
    meat += 2.0 * (1.0 - lag / (lags + 1.0)) * float(np.sum(u[lag:] * u[:-lag]))
  meat = max(meat, 0.0) * n / (n - 2)
  return float(math.sqrt(meat) / np.sum(c * c))


def fit_series(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
  """fit_line for points in time order (one per RL step), corrected for autocorrelated noise.

  Two corrections of the slope's interval, and the wider is used (`slope_ci95`, `corrected`
  True): Newey-West with newey_west_lags(n) lags and t at n - 2 df; and the AR(1) effective
  sample size n_eff = n (1 - rho) / (1 + rho) from the residuals' lag-1 autocorrelation rho
  (taken as 0 when negative): the ordinary standard error times sqrt((n - 2) / (n_eff - 2))
  and t at n_eff - 2 df. Both are kept (`hac`, `ar1`), with the uncorrected interval
  (`ols_slope_ci95`)."""
  f = fit_line(x, y, ordered=True)
  n = f["points"]
  if n < 4 or not np.isfinite(f["slope"]):
    f.update(ols_slope_ci95=list(f["slope_ci95"]), ols_slope_se=f["slope_se"],
             hac={"lags": 0, "slope_se": NAN, "slope_ci95": [NAN, NAN]},
             ar1={"rho": NAN, "n_eff": NAN, "slope_se": NAN, "slope_ci95": [NAN, NAN]},
             slope_ci95=[NAN, NAN], corrected=True)
    return f
  slope = f["slope"]
  lags = newey_west_lags(n)
  hac_se = newey_west_slope_se(x, y, lags)
  hac_half = t_critical(n - 2) * hac_se
  rho = f["residual_lag1_autocorrelation"]
  rho = max(rho, 0.0) if np.isfinite(rho) else 0.0
  n_eff = n * (1 - rho) / (1 + rho)
  if n_eff > 3:
    ar_se = f["slope_se"] * math.sqrt((n - 2) / (n_eff - 2))
    ar_half = t_critical(n_eff - 2) * ar_se
  else:
    ar_se = ar_half = float("inf")
  half = max(hac_half, ar_half)
  f.update(
      ols_slope_ci95=list(f["slope_ci95"]), ols_slope_se=f["slope_se"],
      hac={"lags": lags, "slope_se": hac_se, "slope_ci95": [slope - hac_half, slope + hac_half]},
      ar1={"rho": rho, "n_eff": n_eff, "slope_se": ar_se,
           "slope_ci95": [slope - ar_half, slope + ar_half]},
      slope_ci95=[slope - half, slope + half], corrected=True)
  return f


def change_over_run(fit: dict[str, Any], steps: Sequence[float]) -> dict[str, Any]:
  """The fitted change over the run, slope * (last step - first step), with the interval
  scaled the same way."""
  steps = np.asarray(steps, float)
  span = float(steps[-1] - steps[0]) if steps.size else 0.0
  return {"change": fit["slope"] * span, "change_ci95": [c * span for c in fit["slope_ci95"]],
          "span": span}


def bootstrap(statistic: Callable[[np.ndarray], Any], n: int, *, draws: int = 2000,
              seed: int = 0, level: float = LEVEL) -> dict[str, Any]:
  """Percentile bootstrap over n units (for example prompts): `statistic(indices)` of the
  whole sample (indices 0..n-1) and of `draws` resamples of n indices drawn with
  replacement. The statistic may be a number or an array (each entry gets its interval).
  Returns {"value", "se" (the resamples' standard deviation), "ci95" ([low, high], the
  (1 - level)/2 and (1 + level)/2 percentiles of the resamples; entries along the first
  axis), "draws", "n"}; resamples whose statistic is not finite are dropped. Fewer than two
  units: nan interval."""
  value = np.asarray(statistic(np.arange(n)), float)
  if n < 2:
    nan = np.full(value.shape, NAN)
    return {"value": value.tolist(), "se": nan.tolist(), "ci95": [nan.tolist(), nan.tolist()],
            "draws": 0, "n": n}
  rng = np.random.default_rng(seed)
  samples = np.asarray([statistic(rng.integers(0, n, n)) for _ in range(draws)], float)
  ok = np.all(np.isfinite(samples.reshape(draws, -1)), axis=1)
  samples = samples[ok]
  tail = (1 - level) / 2 * 100
  lo, hi = np.percentile(samples, [tail, 100 - tail], axis=0)
  return {"value": value.tolist(), "se": samples.std(axis=0, ddof=1).tolist(),
          "ci95": [lo.tolist(), hi.tolist()], "draws": int(ok.sum()), "n": n}
