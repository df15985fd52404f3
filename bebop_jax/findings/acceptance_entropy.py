"""F1/F2: acceptance against policy entropy, for rejection sampling and greedy drafts.

Two sets of points, each a (mean target entropy, acceptance) pair:
  RL steps     one per step of the frozen e2e_tv arm of F4 (the drafter fixed, the policy
               moving): the batch's mean entropy at the rollout temperature and its
               teacher-forced acceptance, scored against the policy that sampled it;
  re-scoring   one per temperature: the held-out rollouts of the SFT policy scored by the
               e2e_tv drafter with target and draft both at temperature T (a higher T
               raises the policy's entropy, as RL's drift to more diverse outputs does).
Acceptance is depth 1's, and the mean over depths. Each set gets a least-squares line per
mode (slope, intercept, r2, 95% interval of the slope) and the slope ratio greedy_draft /
rejection with its delta-method standard error.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bebop_jax.findings import common

NAME_F1, NAME_F2 = "acceptance_entropy", "greedy_vs_rejection"
TITLE_F1 = "F1: acceptance falls as policy entropy rises"
TITLE_F2 = "F2: greedy drafts lose acceptance faster than rejection sampling"
CLAIM_F1 = "MTP acceptance falls linearly as the policy's entropy rises during RL."
CLAIM_F2 = ("the fall is far steeper with greedy drafts than with probabilistic "
            "rejection-sampling verification.")
SOURCES = ("rl_steps", "rescoring")
METRICS = ("depth1", "mean")
ARM = "frozen_e2e_tv"


def rl_step_points(ctx: common.Context) -> dict[str, dict[str, np.ndarray]]:
  """{mode: {"entropy", "depth1", "mean"}} from the RL steps of the frozen e2e_tv arm."""
  from bebop_jax.rl import stage as rl_stage  # pylint: disable=g-import-not-at-top
  s = rl_stage.read_summary(ctx.drafter_arm(ARM))
  out = {}
  for mode in common.MODES:
    acc = np.asarray([[np.nan if a is None else a for a in row]
                      for row in s["tf_acceptance_by_step"][mode]], float)
    ok = np.isfinite(acc[:, 0])
    out[mode] = {"entropy": np.asarray(s["entropy_by_step"], float)[ok],
                 "depth1": acc[ok, 0], "mean": np.nanmean(acc[ok], axis=1),
                 "step": np.asarray(s["logged_steps"])[ok]}
  return out


def rescored_points(ctx: common.Context) -> dict[str, dict[str, np.ndarray]]:
  """{mode: {"temperature", "entropy", "depth1", "mean"}}: one point per temperature."""
  from bebop_jax.decoding import batching, diagnostics, sampling  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import mtp  # pylint: disable=g-import-not-at-top
  config = ctx.drafter_config("e2e_tv", 0)
  workdir = ctx.drafter("e2e_tv", 0)
  graphdef, params = mtp.load_policy(config, workdir)
  heldout = mtp.self_distillation_data(  # cached by the MTP stage
      config, graphdef, params, os.path.join(mtp.sft_workdir(config, workdir), "mtp_data"),
      "test", {n: config.eval.num_examples for n in mtp._per_task(config, 1)})  # pylint: disable=protected-access
  sequences = heldout["sequences"]
  length = batching.bucket(max(len(t) for t, _ in sequences), tuple(config.eval.prompt_buckets))
  out = {mode: {"temperature": [], "entropy": [], "depth1": [], "mean": []}
         for mode in common.MODES}
  for t in ctx.scale.temperatures:
    sp = sampling.SamplingParams(temperature=float(t))
    ent_sum = ent_n = 0.0
    alpha_sum = {mode: 0.0 for mode in common.MODES}
    alpha_n = 0.0
    for seq, gen in diagnostics.padded_batches(sequences, config.eval.batch_size, length):
      r = jax.device_get(diagnostics.acceptance_by_position(  # one forward for all modes
          graphdef, params, jnp.asarray(seq), jnp.asarray(gen), params=sp,
          modes=common.MODES))
      m = np.asarray(r["mask"], float)                                      # [K, B, T]
      ent_sum += float(np.sum(r["entropy"][0] * m[0]))
      ent_n += float(m[0].sum())
      for mode in common.MODES:
        alpha_sum[mode] = alpha_sum[mode] + np.sum(r["alpha"][mode] * m, axis=(1, 2))
      alpha_n = alpha_n + m.sum(axis=(1, 2))
    for mode in common.MODES:
      per_depth = alpha_sum[mode] / np.maximum(alpha_n, 1)
      o = out[mode]
      o["temperature"].append(float(t))
      o["entropy"].append(ent_sum / max(ent_n, 1))
      o["depth1"].append(float(per_depth[0]))
      o["mean"].append(float(np.mean(per_depth)))
  return {mode: {k: np.asarray(v) for k, v in o.items()} for mode, o in out.items()}


def slope_ratio(greedy: dict, rejection: dict) -> dict[str, float]:
  """greedy slope / rejection slope, with the delta-method standard error (the two fits
  treated as independent)."""
  a, b = greedy["slope"], rejection["slope"]
  ratio = a / b if b else float("nan")
  se = abs(ratio) * float(np.hypot(greedy["slope_se"] / a, rejection["slope_se"] / b)) \
      if a and b else float("nan")
  return {"ratio": float(ratio), "ratio_se": se}


def fits(points: dict[str, dict[str, dict[str, np.ndarray]]]) -> dict:
  out = {}
  for source, by_mode in points.items():
    out[source] = {}
    for metric in METRICS:
      f = {mode: common.fit_line(by_mode[mode]["entropy"], by_mode[mode][metric])
           for mode in common.MODES}
      f["ratio"] = slope_ratio(f["greedy_draft"], f["rejection"])
      # Paired: both modes score the same points, so their gap against entropy tests
      # "greedy falls faster" without treating two correlated fits as independent.
      f["difference"] = common.fit_line(
          by_mode["rejection"]["entropy"],
          by_mode["greedy_draft"][metric] - by_mode["rejection"][metric])
      out[source][metric] = f
  return out


def verdicts(fit: dict) -> tuple[tuple[str, str], tuple[str, str]]:
  """(F1, F2) verdicts from the depth-1 fits of both point sets. F1: reproduced when the
  slope's 95% interval lies below 0 in both modes of every set, not reproduced when it lies
  above 0 somewhere and below nowhere. F2 (paired): the gap greedy_draft - rejection fitted
  against entropy; reproduced when its slope's 95% interval lies below 0 in every set (the
  gap widens as entropy rises), not reproduced when it lies above 0 in every set. Anything
  else is inconclusive."""
  lines, f1, f2 = [], [], []
  for source in SOURCES:
    f = fit[source]["depth1"]
    rej, gr, ratio, diff = f["rejection"], f["greedy_draft"], f["ratio"], f["difference"]
    lines.append(f"{source}: depth-1 slope {rej['slope']:+.3f} per nat (95% CI "
                 f"{rej['slope_ci95'][0]:+.3f} to {rej['slope_ci95'][1]:+.3f}, r2 "
                 f"{rej['r2']:.2f}) for rejection, {gr['slope']:+.3f} ({gr['slope_ci95'][0]:+.3f}"
                 f" to {gr['slope_ci95'][1]:+.3f}, r2 {gr['r2']:.2f}) for greedy_draft; ratio "
                 f"{ratio['ratio']:.2f} ± {ratio['ratio_se']:.2f}; slope of the gap "
                 f"{diff['slope']:+.3f} ({diff['slope_ci95'][0]:+.3f} to "
                 f"{diff['slope_ci95'][1]:+.3f})")
    for x in (rej, gr):
      lo, hi = x["slope_ci95"]
      f1.append("falls" if hi < 0 else "rises" if lo > 0 else "unclear")
    lo, hi = diff["slope_ci95"]
    f2.append("steeper" if hi < 0 else "not steeper" if lo > 0 else "unclear")
  text = "; ".join(lines) + "."
  if all(x == "falls" for x in f1):
    v1 = ("reproduced", "Acceptance falls with entropy in both modes and both point sets: ")
  elif "rises" in f1 and "falls" not in f1:
    v1 = ("not reproduced", "Acceptance rises with entropy: ")
  else:
    v1 = ("inconclusive", "Not every slope's interval lies below zero: ")
  if all(x == "steeper" for x in f2):
    v2 = ("reproduced", "The gap between greedy drafts and rejection sampling widens with "
          "entropy (95% interval of its slope below zero) in both point sets: ")
  elif all(x == "not steeper" for x in f2):
    v2 = ("not reproduced", "Greedy drafts fall less steeply in both point sets: ")
  else:
    v2 = ("inconclusive", "The gap's slope is not below zero beyond its 95% interval in "
          "every point set: ")
  return (v1[0], v1[1] + text), (v2[0], v2[1] + text)


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


def table(fit: dict) -> str:
  lines = ["| points | acceptance | mode | n | slope per nat [95% CI] | intercept | r2 | "
           "greedy / rejection slope |", "|---" * 8 + "|"]
  for source in SOURCES:
    for metric in METRICS:
      f = fit[source][metric]
      for mode in common.MODES:
        x = f[mode]
        ratio = (f"{f['ratio']['ratio']:.2f} ± {f['ratio']['ratio_se']:.2f}"
                 if mode == "greedy_draft" else "")
        lines.append(f"| {source} | {metric} | {mode} | {x['points']} | {x['slope']:+.3f} "
                     f"[{x['slope_ci95'][0]:+.3f}, {x['slope_ci95'][1]:+.3f}] | "
                     f"{x['intercept']:.3f} | {x['r2']:.2f} | {ratio} |")
  return "\n".join(lines)


def run(ctx: common.Context) -> list[common.Finding]:
  start = time.perf_counter()
  points = {"rl_steps": rl_step_points(ctx), "rescoring": rescored_points(ctx)}
  fit = fits(points)
  figure = plot(points, fit, ctx.out_dir)
  (v1, r1), (v2, r2) = verdicts(fit)
  rows = []
  for source, by_mode in points.items():
    for mode, p in by_mode.items():
      for i in range(len(p["entropy"])):
        rows.append({"source": source, "mode": mode,
                     "step": int(p["step"][i]) if "step" in p else "",
                     "temperature": float(p["temperature"][i]) if "temperature" in p else "",
                     "entropy": float(p["entropy"][i]), "acceptance_depth1": float(p["depth1"][i]),
                     "acceptance_mean": float(p["mean"][i])})
  data = {"points": {s: {m: {k: v.tolist() for k, v in p.items()} for m, p in bm.items()}
                     for s, bm in points.items()},
          "fits": fit, "temperatures": list(ctx.scale.temperatures), "rl_arm": ARM}
  body = (f"Points per RL step: the {ARM} arm of F4 ({len(points['rl_steps']['rejection']['entropy'])} steps). Points per re-scoring temperature: held-out rollouts of the SFT policy "
          f"scored at T in {list(ctx.scale.temperatures)}.\n\n" + table(fit))
  seconds = time.perf_counter() - start
  f1 = common.Finding(NAME_F1, TITLE_F1, CLAIM_F1, v1, r1, body, data, rows, [figure], seconds)
  ratio_rows = [{"source": s, "metric": m, **fit[s][m]["ratio"],
                 "gap_slope": fit[s][m]["difference"]["slope"],
                 "gap_slope_ci95_low": fit[s][m]["difference"]["slope_ci95"][0],
                 "gap_slope_ci95_high": fit[s][m]["difference"]["slope_ci95"][1],
                 "gap_r2": fit[s][m]["difference"]["r2"]} for s in SOURCES for m in METRICS]
  ratio_body = "\n".join(
      ["| points | acceptance | greedy_draft slope / rejection slope | slope of the gap "
       "greedy_draft - rejection per nat [95% CI] | r2 |", "|---|---|---|---|---|"] +
      [f"| {r['source']} | {r['metric']} | {r['ratio']:.2f} ± {r['ratio_se']:.2f} | "
       f"{r['gap_slope']:+.3f} [{r['gap_slope_ci95_low']:+.3f}, {r['gap_slope_ci95_high']:+.3f}]"
       f" | {r['gap_r2']:.2f} |" for r in ratio_rows]) + (
          "\n\nThe ratio's standard error treats the two fits as independent; the gap is "
          "fitted on the same points (paired), which the verdict uses. The fits and the "
          "figure are F1's.")
  f2 = common.Finding(NAME_F2, TITLE_F2, CLAIM_F2, v2, r2, ratio_body,
                      {"ratios": ratio_rows}, ratio_rows, [figure], 0.0)
  return [f1, f2]
