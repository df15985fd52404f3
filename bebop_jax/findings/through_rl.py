"""F4: does a drafter trained before RL keep its acceptance through RL without updates?

The same RL run (prompts, seeds, budget) from the seed-0 drafters of F3, once per arm of
common.DRAFTER_ARMS: frozen ce, frozen e2e_tv, online ce, online e2e_tv (an MTP-only update on
every batch) and periodic e2e_tv (every `periodic_every` steps). Per RL step, the teacher-
forced acceptance per depth of the drafter that sampled the batch, scored against the policy
that sampled it, in rejection and greedy_draft; at each held-out evaluation, the online
acceptance; per arm, the seconds of the online MTP updates per step.
"""

from __future__ import annotations

import os
import time

import numpy as np

from bebop_jax.findings import common

NAME = "through_rl"
TITLE = "F4: MTP acceptance through RL"
CLAIM = ("an MTP drafter trained with e2e-TV before RL keeps its acceptance through RL "
         "without online updates.")
TOLERANCE = 0.02  # acceptance points a "kept" drafter may lose over the run


def collect(ctx: common.Context) -> dict[str, dict]:
  """Per arm: logged steps, per-step teacher-forced acceptance per mode and depth, entropy,
  held-out acceptance by step, the median seconds per step, and the mean seconds of the MTP
  updates per step (a periodic update lands on one step in `every`)."""
  from bebop_jax.rl import stage as rl_stage  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  out = {}
  for arm in common.DRAFTER_ARMS:
    workdir = ctx.drafter_arm(arm)
    s = rl_stage.read_summary(workdir)
    records = sorted(metrics_lib.read_metrics(workdir, rl_stage.STAGE), key=lambda r: r["step"])
    out[arm] = {
        "steps": s["logged_steps"],
        "tf_acceptance": {m: [[np.nan if a is None else a for a in row] for row in rows]
                          for m, rows in s["tf_acceptance_by_step"].items()},
        "entropy": s["entropy_by_step"],
        "eval_steps": [int(k) for k in s["eval_by_step"]],
        "eval_acceptance": {m: [e["acceptance"][m] for e in s["eval_by_step"].values()]
                            for m in common.MODES},
        "eval_pass_at_1": [float(np.mean(list(e["pass_at_1"].values())))
                           for e in s["eval_by_step"].values()],
        "step_s": float(np.median([r["step_s"] for r in records])),
        "mtp_update_s": float(np.mean([r["mtp_update_s"] for r in records])),
        "mtp_update_s_total": float(s["timing"]["mtp_update_s"]),
    }
  return out


def trend(arm: dict, mode: str = "rejection") -> dict:
  """Line fit of the mean-over-depths teacher-forced acceptance against the step, and the
  fitted change over the run with its 95% interval."""
  acc = np.nanmean(np.asarray(arm["tf_acceptance"][mode], float), axis=1)
  steps = np.asarray(arm["steps"], float)
  fit = common.fit_line(steps, acc)
  span = float(steps[-1] - steps[0]) if len(steps) else 0.0
  fit["change"] = fit["slope"] * span
  fit["change_ci95"] = [c * span for c in fit["slope_ci95"]]
  fit["first"], fit["last"] = float(acc[0]), float(acc[-1])
  return fit


def _ends(values, n: int = 3) -> str:
  """"a -> b": the means of the first and last n values."""
  v = np.asarray(values, float)
  return f"{v[:n].mean():.3f} -> {v[-n:].mean():.3f}"


def verdict(arms: dict, trends: dict) -> tuple[str, str]:
  t = trends["frozen_e2e_tv"]
  held = arms["frozen_e2e_tv"]["eval_acceptance"]["rejection"]
  held_change = float(np.mean(held[-1]) - np.mean(held[0]))
  online = arms["online_e2e_tv"]["eval_acceptance"]["rejection"]
  text = (f"Frozen e2e-TV drafter, rejection, mean acceptance over depths: fitted change over "
          f"{len(arms['frozen_e2e_tv']['steps'])} RL steps {t['change']:+.3f} (95% CI "
          f"{t['change_ci95'][0]:+.3f} to {t['change_ci95'][1]:+.3f}); held-out "
          f"{np.mean(held[0]):.3f} -> {np.mean(held[-1]):.3f} ({held_change:+.3f}), online "
          f"updates end at {np.mean(online[-1]):.3f}. Over the run the policy's entropy on its "
          f"batches went {_ends(arms['frozen_e2e_tv']['entropy'])} nats per token.")
  lo, hi = t["change_ci95"]
  if not np.isfinite(lo):
    return "inconclusive", text + " Too few steps for an interval."
  if lo > -TOLERANCE and held_change > -TOLERANCE:
    return "reproduced", text + (f" It loses less than {TOLERANCE:.2f} (the CI's lower end), "
                                 "without online updates.")
  if hi < -TOLERANCE:
    return "not reproduced", text + f" It loses more than {TOLERANCE:.2f}."
  return "inconclusive", text + f" The interval straddles a loss of {TOLERANCE:.2f}."


def plot(arms: dict, out_dir: str) -> str:
  plt = common.pyplot()
  k = max(len(r) for a in arms.values() for r in a["tf_acceptance"]["rejection"])
  fig, axes = plt.subplots(2, k + 1, figsize=(3.6 * (k + 1), 6.5), squeeze=False)
  for i, mode in enumerate(common.MODES):
    for arm, a in arms.items():
      acc = np.asarray(a["tf_acceptance"][mode], float)
      for d in range(acc.shape[1]):
        axes[i, d].plot(a["steps"], acc[:, d], marker=".", lw=1, label=arm)
      axes[i, k].plot(a["eval_steps"], [np.mean(x) for x in a["eval_acceptance"][mode]],
                      marker="o", label=arm)
    for d in range(k):
      axes[i, d].set_title(f"{mode}: depth {d + 1}, per batch")
      axes[i, d].set_xlabel("RL step")
      axes[i, d].grid(alpha=0.3)
    axes[i, k].set_title(f"{mode}: held-out, mean over depths")
    axes[i, k].set_xlabel("RL step")
    axes[i, k].grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  fig.suptitle("Drafter acceptance through RL (teacher-forced on each RL batch; held-out "
               "online)")
  return common.save_figure(fig, out_dir, f"{NAME}.png")


def table(arms: dict, trends: dict) -> str:
  fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
  lines = ["| arm | held-out acceptance before (rejection) | after (rejection) | before "
           "(greedy_draft) | after (greedy_draft) | change per run (rejection, fit, 95% CI) "
           "| s/step (median) | MTP update s/step (mean) |", "|---" * 8 + "|"]
  for arm, a in arms.items():
    t = trends[arm]
    ev = a["eval_acceptance"]
    lines.append(f"| {arm} | {fmt(ev['rejection'][0])} | {fmt(ev['rejection'][-1])} | "
                 f"{fmt(ev['greedy_draft'][0])} | {fmt(ev['greedy_draft'][-1])} | "
                 f"{t['change']:+.3f} [{t['change_ci95'][0]:+.3f}, {t['change_ci95'][1]:+.3f}]"
                 f" | {a['step_s']:.2f} | {a['mtp_update_s']:.3f} |")
  return "\n".join(lines)


def run(ctx: common.Context) -> common.Finding:
  start = time.perf_counter()
  arms = collect(ctx)
  trends = {arm: trend(a) for arm, a in arms.items()}
  figures = [plot(arms, ctx.out_dir)]
  v, reason = verdict(arms, trends)
  rows = []
  for arm, a in arms.items():
    for i, step in enumerate(a["steps"]):
      row = {"arm": arm, "step": step, "entropy": a["entropy"][i]}
      for mode in common.MODES:
        for d, x in enumerate(a["tf_acceptance"][mode][i], 1):
          row[f"tf_acceptance_{mode}_{d}"] = x
      rows.append(row)
  first = next(iter(arms.values()))
  body = (f"{len(first['steps'])} RL steps per arm from the same start, prompts and seeds "
          f"(config {os.path.relpath(ctx.config_file, common.REPO)}); held-out "
          f"acceptance on {ctx.scale.rl_eval_examples} prompts per task at steps "
          f"{first['eval_steps']}.\n\n"
          + table(arms, trends))
  f = common.Finding(NAME, TITLE, CLAIM, v, reason, body,
                     {"arms": arms, "trends": trends, "tolerance": TOLERANCE}, rows, figures)
  f.seconds = time.perf_counter() - start
  return f
