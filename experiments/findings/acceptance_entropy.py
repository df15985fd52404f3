"""F1/F2: acceptance against policy entropy, for rejection sampling and greedy drafts.

Two sets of points, each a (mean target entropy, acceptance) pair:
  RL steps     one per step of F4's frozen_e2e_tv arm (common.Context.drafter_arm: the
               e2e_tv drafter frozen, the policy trained with the scale's rl_* settings, which
               move its entropy): the batch's mean entropy at the rollout temperature and its
               teacher-forced acceptance, scored against the policy that sampled it;
  re-scoring   one per temperature: the held-out rollouts of the SFT policy scored by the
               e2e_tv drafter with target and draft both at temperature T (a higher T
               raises the policy's entropy, as RL's drift to more diverse outputs does).
Acceptance is depth 1's, and the mean over depths. Each set gets a least-squares line per
mode (slope, intercept, r2, 95% Student-t interval of the slope, the entropy range the
points cover, the lag-1 autocorrelation of the residuals), the line of the paired gap
greedy_draft - rejection on the same points, and the slope ratio greedy_draft / rejection
with its delta-method standard error. The RL-step points are a series: their intervals are
corrected for autocorrelation (stats.fit_series). The verdicts are rules.F1 and rules.F2.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.findings import common
from experiments.findings import rules
from experiments.findings import stats
from bebop_jax.stages import lineage
from bebop_jax.stages import drafter_data

NAME_F1, NAME_F2 = "acceptance_entropy", "greedy_vs_rejection"
TITLE_F1 = "F1: acceptance falls as policy entropy rises"
TITLE_F2 = "F2: greedy drafts lose acceptance faster than rejection sampling"
CLAIM_F1 = "MTP acceptance falls linearly as the policy's entropy rises during RL."
CLAIM_F2 = ("the fall is far steeper with greedy drafts than with probabilistic "
            "rejection-sampling verification.")
SOURCES = ("rl_steps", "rescoring")
METRICS = ("depth1", "mean")
# Points in time order (one per RL step) get the autocorrelation-corrected fit.
ORDERED = {"rl_steps": True, "rescoring": False}
ARM = "frozen_e2e_tv"  # the F4 arm whose steps are the RL-step points


def rl_step_points(ctx: common.Context) -> dict[str, dict[str, np.ndarray]]:
  """{mode: {"entropy", "depth1", "mean", "step"}} from the steps of the RL arm ARM."""
  s = lineage.read_summary(ctx.drafter_arm(ARM), "rl")
  out = {}
  for mode in common.MODES:
    acc = np.asarray([[np.nan if a is None else a for a in row]
                      for row in s["tf_acceptance_by_step"][mode]], float)
    ok = np.isfinite(acc[:, 0])
    out[mode] = {"entropy": np.asarray(s["entropy_by_step"], float)[ok],
                 "depth1": acc[ok, 0], "mean": np.nanmean(acc[ok], axis=1),
                 "step": np.asarray(s["logged_steps"])[ok]}
  return out


def rescored_points(ctx: common.Context) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
  """({mode: {"temperature", "entropy", "depth1", "mean"}}: one point per temperature, and
  the per-sequence sums the points are ratios of (`bootstrap_units`), so that intervals can
  resample the held-out prompts)."""
  from bebop_jax.decoding import batching, diagnostics, sampling  # pylint: disable=g-import-not-at-top
  config = ctx.drafter_config("e2e_tv", 0)
  workdir = ctx.drafter("e2e_tv", 0)
  graphdef, params = lineage.restore_policy(config, workdir, stage="mtp")
  sequences = drafter_data.heldout_sequences(config, workdir, graphdef, params)  # stored by mtp
  vocab = lineage.stored_draft_vocabulary(workdir)  # the drafter drafts from its vocabulary
  vocab = None if vocab is None else jnp.asarray(vocab)
  length = batching.bucket(max(len(t) for t, _ in sequences), tuple(config.eval.prompt_buckets))
  n = len(sequences)
  temps = [float(t) for t in ctx.scale.temperatures]
  # Per temperature and sequence: summed entropy at depth 1's positions and summed
  # acceptance per depth; per sequence: the position counts (the same at every temperature).
  ent = np.zeros((len(temps), n))
  alpha = {mode: None for mode in common.MODES}
  ent_n, alpha_n = np.zeros(n), None
  for ti, t in enumerate(temps):
    sp = sampling.SamplingParams(temperature=t)
    first = 0
    for seq, gen in diagnostics.padded_batches(sequences, config.eval.batch_size, length):
      r = jax.device_get(diagnostics.acceptance_by_position(  # one forward for all modes
          graphdef, params, jnp.asarray(seq), jnp.asarray(gen), vocab, params=sp,
          modes=common.MODES))
      m = np.asarray(r["mask"], float)                                      # [K, B, T]
      rows = min(m.shape[1], n - first)
      sl = slice(first, first + rows)
      ent[ti, sl] = np.sum(r["entropy"][0] * m[0], axis=-1)[:rows]
      if alpha_n is None:
        alpha_n = np.zeros((n, m.shape[0]))
        alpha = {mode: np.zeros((len(temps), n, m.shape[0])) for mode in common.MODES}
      if ti == 0:
        ent_n[sl] = m[0].sum(-1)[:rows]
        alpha_n[sl] = m.sum(-1).T[:rows]
      for mode in common.MODES:
        alpha[mode][ti, sl] = np.sum(r["alpha"][mode] * m, axis=-1).T[:rows]
      first += rows
  units = {"temperature": np.asarray(temps), "entropy_sum": ent, "entropy_count": ent_n,
           "alpha_sum": alpha, "alpha_count": alpha_n}
  return points_from_units(units, np.arange(n)), units


def points_from_units(units: dict, index: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
  """The re-scoring points of the sequences `index` (with repeats, for a bootstrap): per
  temperature, the entropy and acceptance over their positions."""
  entropy = units["entropy_sum"][:, index].sum(1) / max(units["entropy_count"][index].sum(), 1)
  counts = np.maximum(units["alpha_count"][index].sum(0), 1)              # [K]
  out = {}
  for mode in common.MODES:
    per_depth = units["alpha_sum"][mode][:, index].sum(1) / counts         # [temps, K]
    out[mode] = {"temperature": units["temperature"], "entropy": entropy,
                 "depth1": per_depth[:, 0], "mean": per_depth.mean(1)}
  return out


def _slope(x: np.ndarray, y: np.ndarray) -> float:
  c = x - x.mean()
  spread = float(np.sum(c * c))
  return float(np.sum(c * (y - y.mean())) / spread) if spread > 0 else float("nan")


def bootstrap_slopes(units: dict, *, draws: int = 2000, seed: int = 0) -> dict:
  """{metric: {mode or "difference": stats.bootstrap of the least-squares slope against
  entropy}}: the re-scoring points recomputed from resampled held-out sequences (the
  prompts' sampling error; the same resample for every mode, metric and temperature)."""
  keys = [(metric, mode) for metric in METRICS for mode in (*common.MODES, "difference")]

  def statistic(index):
    pts = points_from_units(units, index)
    x = pts["rejection"]["entropy"]
    out = []
    for metric, mode in keys:
      y = (pts["greedy_draft"][metric] - pts["rejection"][metric] if mode == "difference"
           else pts[mode][metric])
      out.append(_slope(x, y))
    return np.asarray(out)

  b = stats.bootstrap(statistic, len(units["entropy_count"]), draws=draws, seed=seed)
  out: dict[str, dict] = {metric: {} for metric in METRICS}
  for j, (metric, mode) in enumerate(keys):
    out[metric][mode] = {"slope": b["value"][j], "slope_se": b["se"][j],
                         "slope_ci95": [b["ci95"][0][j], b["ci95"][1][j]],
                         "draws": b["draws"], "units": b["n"]}
  return out


def entropy_drift(by_mode: dict[str, dict[str, np.ndarray]]) -> dict | None:
  """The fitted change of the batch entropy over an RL run (stats.fit_series against the
  step, change over the run, with its autocorrelation-corrected 95% interval); None for
  points without steps."""
  rej = by_mode["rejection"]
  if "step" not in rej or len(rej["step"]) < 2:
    return None
  fit = stats.fit_series(rej["step"], rej["entropy"])
  return stats.change_over_run(fit, rej["step"])


def slope_ratio(greedy: dict, rejection: dict) -> dict[str, float]:
  """greedy slope / rejection slope, with the delta-method standard error (the two fits
  treated as independent)."""
  a, b = greedy["slope"], rejection["slope"]
  ratio = a / b if b else float("nan")
  se = abs(ratio) * float(np.hypot(greedy["slope_se"] / a, rejection["slope_se"] / b)) \
      if a and b else float("nan")
  return {"ratio": float(ratio), "ratio_se": se}


def fits(points: dict[str, dict[str, dict[str, np.ndarray]]], units: dict | None = None,
         draws: int = 2000) -> dict:
  """{source: {metric: {mode: fit, "ratio", "difference"}}}: a line per mode, the slope
  ratio, and the fit of the paired gap greedy_draft - rejection; sources in ORDERED's time
  order (RL steps) with stats.fit_series, the others with stats.fit_line. With the
  re-scoring `units` (rescored_points), each re-scoring fit also gets "bootstrap": its
  slope's percentile interval over resampled held-out sequences (bootstrap_slopes). An
  ordered source with steps also gets "entropy_drift" (entropy_drift)."""
  out = {}
  for source, by_mode in points.items():
    fit = stats.fit_series if ORDERED.get(source, False) else stats.fit_line
    out[source] = {}
    for metric in METRICS:
      f = {mode: fit(by_mode[mode]["entropy"], by_mode[mode][metric]) for mode in common.MODES}
      f["ratio"] = slope_ratio(f["greedy_draft"], f["rejection"])
      # Paired: both modes score the same points, so their gap against entropy tests
      # "greedy falls faster" without treating two correlated fits as independent.
      f["difference"] = fit(by_mode["rejection"]["entropy"],
                            by_mode["greedy_draft"][metric] - by_mode["rejection"][metric])
      out[source][metric] = f
    if ORDERED.get(source, False):
      out[source]["entropy_drift"] = entropy_drift(by_mode)
  if units is not None and "rescoring" in out:
    for metric, by in bootstrap_slopes(units, draws=draws).items():
      for mode, b in by.items():
        out["rescoring"][metric][mode]["bootstrap"] = b
  return out


def entropy_ranges(points: dict) -> dict[str, dict[str, float]]:
  """Per point set: the entropy min, max and max - min its points cover (nats per token)."""
  return {source: stats.x_range(by_mode["rejection"]["entropy"])
          for source, by_mode in points.items()}


def verdicts(fit: dict) -> tuple[tuple[str, str, dict], tuple[str, str, dict]]:
  """(F1, F2): (verdict, reason, every rule version's evaluation) by rules.F1 and rules.F2."""
  result = {"fits": fit}
  return rules.decide(NAME_F1, result), rules.decide(NAME_F2, result)


def plot(points: dict, fit: dict, out_dir: str) -> str:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
  colors = {"rejection": "C0", "greedy_draft": "C3"}
  for ax, metric in zip(axes, METRICS):
    for mode in common.MODES:
      for source, marker, size in (("rl_steps", ".", 30), ("rescoring", "s", 50)):
        p = points[source][mode]
        ax.scatter(p["entropy"], p[metric], marker=marker, s=size, color=colors[mode],
                   alpha=0.7, label=f"{mode}, {source}")
        f = fit[source][metric][mode]
        if np.isfinite(f["slope"]):
          xs = np.linspace(p["entropy"].min(), p["entropy"].max(), 2)
          ax.plot(xs, f["intercept"] + f["slope"] * xs, color=colors[mode],
                  ls="-" if source == "rescoring" else ":", lw=1)
    ax.set_xlabel("mean target entropy (nats per token)")
    ax.set_ylabel(f"acceptance ({'depth 1' if metric == 'depth1' else 'mean over depths'})")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.suptitle("Acceptance against entropy: points per RL step (dots) and per re-scoring "
               "temperature (squares), least-squares lines")
  return common.save_figure(fig, out_dir, f"{NAME_F1}.png")


def _interval_name(fit: dict) -> str:
  return "HAC/AR(1)" if fit.get("corrected") else "t"


def table(fit: dict) -> str:
  lines = ["| points | acceptance | mode | n | entropy min - max (range), nats | slope per nat "
           "[95% interval] | interval | intercept | r2 | residual lag-1 autocorrelation | "
           "greedy / rejection slope ± SE |", "|---" * 11 + "|"]
  for source in SOURCES:
    for metric in METRICS:
      f = fit[source][metric]
      for mode in common.MODES:
        x = f[mode]
        ratio = (f"{f['ratio']['ratio']:.2f} ± {f['ratio']['ratio_se']:.2f}"
                 if mode == "greedy_draft" else "")
        lines.append(f"| {source} | {metric} | {mode} | {x['points']} | {x['x_min']:.3f} - "
                     f"{x['x_max']:.3f} ({x['x_range']:.3f}) | {x['slope']:+.3f} "
                     f"[{x['slope_ci95'][0]:+.3f}, {x['slope_ci95'][1]:+.3f}] | "
                     f"{_interval_name(x)} | {x['intercept']:.3f} | {x['r2']:.2f} | "
                     f"{x['residual_lag1_autocorrelation']:+.2f} | {ratio} |")
  return "\n".join(lines)


INTERVALS_NOTE = (
    "Intervals are 95%: *t* is the Student-t interval at n - 2 degrees of freedom (points "
    "taken as independent); *HAC/AR(1)* (points in RL-step order) is the wider of the "
    "Newey-West interval and the AR(1) effective-sample-size interval, which allow for "
    "autocorrelated noise from step to step. The ratio's ± is a delta-method standard error "
    "that treats the two fits as independent; no rule in force decides on it.")


def run(ctx: common.Context) -> list[common.Finding]:
  start = time.perf_counter()
  rescored, units = rescored_points(ctx)
  points = {"rl_steps": rl_step_points(ctx), "rescoring": rescored}
  fit = fits(points, units)
  ranges = entropy_ranges(points)
  figure = plot(points, fit, ctx.out_dir)
  (v1, r1, rule1), (v2, r2, rule2) = verdicts(fit)
  rows = []
  for source, by_mode in points.items():
    for mode, p in by_mode.items():
      for i in range(len(p["entropy"])):
        rows.append({"source": source, "mode": mode,
                     "step": int(p["step"][i]) if "step" in p else "",
                     "temperature": float(p["temperature"][i]) if "temperature" in p else "",
                     "entropy": float(p["entropy"][i]), "acceptance_depth1": float(p["depth1"][i]),
                     "acceptance_mean": float(p["mean"][i])})
  rl_config = ctx.config().rl
  s = ctx.scale
  data = {"points": {src: {m: {k: v.tolist() for k, v in p.items()} for m, p in bm.items()}
                     for src, bm in points.items()},
          "fits": fit, "entropy_ranges": ranges, "temperatures": list(ctx.scale.temperatures),
          "rl_run": {"stage": f"through_rl/{ARM}", "steps": s.rl_steps,
                     "learning_rate": s.rl_learning_rate or rl_config.optim.learning_rate,
                     "clip_low": rl_config.clip_low,
                     "clip_high": s.rl_clip_high or rl_config.clip_high}}
  rej = points["rl_steps"]["rejection"]
  drift = stats.fit_series(rej["step"], rej["entropy"])
  data["rl_run"]["entropy_change"] = stats.change_over_run(drift, rej["step"])
  rl = data["rl_run"]
  span = lambda r: f"{r['x_min']:.3f} to {r['x_max']:.3f} nats ({r['x_range']:.3f})"
  body = (f"Points per RL step: F4's {ARM} arm (`{rl['stage']}/`: {rl['steps']} steps from "
          f"the e2e-TV drafter, drafter frozen, policy learning rate {rl['learning_rate']:g}, clip "
          f"range 1 - {rl['clip_low']:g} to 1 + {rl['clip_high']:g}); "
          f"their batch entropy spans {span(ranges['rl_steps'])}, and its line over the steps "
          f"changes by {rl['entropy_change']['change']:+.3f} nats over the run (95% HAC/AR(1) "
          f"interval {rl['entropy_change']['change_ci95'][0]:+.3f} to "
          f"{rl['entropy_change']['change_ci95'][1]:+.3f}; the span also holds the spread from batch "
          f"to batch). Points per re-scoring "
          f"temperature: held-out rollouts of the SFT policy scored at T in "
          f"{list(ctx.scale.temperatures)}; entropy spans {span(ranges['rescoring'])}.\n\n"
          + table(fit) + "\n\n" + INTERVALS_NOTE)
  seconds = time.perf_counter() - start
  f1 = common.Finding(NAME_F1, TITLE_F1, CLAIM_F1, v1, r1, body, data, rows, [figure], seconds,
                      rule=rule1)
  ratio_rows = [{"source": s, "metric": m, **fit[s][m]["ratio"],
                 "gap_slope": fit[s][m]["difference"]["slope"],
                 "gap_slope_ci95_low": fit[s][m]["difference"]["slope_ci95"][0],
                 "gap_slope_ci95_high": fit[s][m]["difference"]["slope_ci95"][1],
                 "gap_interval": _interval_name(fit[s][m]["difference"]),
                 "gap_r2": fit[s][m]["difference"]["r2"],
                 "gap_residual_lag1_autocorrelation":
                     fit[s][m]["difference"]["residual_lag1_autocorrelation"],
                 "entropy_min": ranges[s]["x_min"], "entropy_max": ranges[s]["x_max"],
                 "entropy_range": ranges[s]["x_range"]} for s in SOURCES for m in METRICS]
  ratio_body = "\n".join(
      ["| points | acceptance | entropy range, nats | greedy_draft slope / rejection slope ± SE "
       "| slope of the gap greedy_draft - rejection per nat [95% interval] | interval | r2 | "
       "residual lag-1 autocorrelation |", "|---|---|---|---|---|---|---|---|"] +
      [f"| {r['source']} | {r['metric']} | {r['entropy_range']:.3f} | {r['ratio']:.2f} ± "
       f"{r['ratio_se']:.2f} | {r['gap_slope']:+.3f} [{r['gap_slope_ci95_low']:+.3f}, "
       f"{r['gap_slope_ci95_high']:+.3f}] | {r['gap_interval']} | {r['gap_r2']:.2f} | "
       f"{r['gap_residual_lag1_autocorrelation']:+.2f} |" for r in ratio_rows]) + (
          "\n\nThe gap is fitted on the same points (paired), which the rule in force uses. "
          + INTERVALS_NOTE + " The points and the figure are F1's.")
  f2 = common.Finding(NAME_F2, TITLE_F2, CLAIM_F2, v2, r2, ratio_body,
                      {"ratios": ratio_rows, "entropy_ranges": ranges}, ratio_rows, [figure],
                      0.0, rule=rule2)
  return [f1, f2]
