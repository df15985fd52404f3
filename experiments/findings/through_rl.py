"""F4: does a drafter trained before RL keep its acceptance through RL without updates?

The same RL run (prompts, seeds, budget) from the seed-0 drafters of F3, once per arm of
common.DRAFTER_ARMS: frozen ce, frozen e2e_tv, online ce, online e2e_tv (an MTP-only update on
every batch) and periodic e2e_tv (every `periodic_every` steps). Per RL step, the teacher-
forced acceptance per depth of the drafter that sampled the batch, scored against the policy
that sampled it, in rejection and greedy_draft; at each held-out evaluation, the online
acceptance; per arm, the seconds of the online MTP updates per step.

Every arm draws the same prompt batch and rollout key at step s, so arms are compared by
step (paired): the frozen e2e_tv drafter's drift is set against the frozen ce drafter's as a
difference of differences (`comparison`). Fits over steps are corrected for autocorrelation
(stats.fit_series). The verdict is rules.F4.
"""

from __future__ import annotations

import os
import time

import numpy as np

from experiments.findings import common
from experiments.findings import rules
from experiments.findings import stats
from bebop_jax.stages import lineage

NAME = "through_rl"
TITLE = "F4: MTP acceptance through RL"
CLAIM = ("an MTP drafter trained with e2e-TV before RL keeps its acceptance through RL "
         "without online updates.")
TOLERANCE = rules.MARGIN  # acceptance a "kept" drafter may lose over the run
ARM, CONTROL = "frozen_e2e_tv", "frozen_ce"


def held_out_by_step(eval_by_step: dict) -> dict[str, list]:
  """The held-out evaluations of an RL summary in step order. Its keys are steps written as
  JSON strings (sorted as text: "0", "12", "6"), so they are ordered as integers here."""
  steps = sorted(eval_by_step, key=int)
  evals = [eval_by_step[k] for k in steps]
  return {"eval_steps": [int(k) for k in steps],
          "eval_acceptance": {m: [e["acceptance"][m] for e in evals] for m in common.MODES},
          "eval_pass_at_1": [float(np.mean(list(e["pass_at_1"].values()))) for e in evals]}


def collect(ctx: common.Context) -> dict[str, dict]:
  """Per arm: logged steps, per-step teacher-forced acceptance per mode and depth, entropy,
  held-out acceptance by step, the median seconds per step, and the mean seconds of the MTP
  updates per step (a periodic update lands on one step in `every`)."""
  from bebop_jax.stages import rl as rl_stage  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  out = {}
  for arm in ctx.scale.drafter_arms:
    workdir = ctx.drafter_arm(arm)
    s = lineage.read_summary(workdir, "rl")
    records = sorted(metrics_lib.read_metrics(workdir, rl_stage.STAGE), key=lambda r: r["step"])
    out[arm] = {
        "steps": s["logged_steps"],
        "tf_acceptance": {m: [[np.nan if a is None else a for a in row] for row in rows]
                          for m, rows in s["tf_acceptance_by_step"].items()},
        "entropy": s["entropy_by_step"],
        **held_out_by_step(s["eval_by_step"]),
        "step_s": float(np.median([r["step_s"] for r in records])),
        "mtp_update_s": float(np.mean([r["mtp_update_s"] for r in records])),
        "mtp_update_s_total": float(s["timing"]["mtp_update_s"]),
        "pass_at_1_delta": s["pass_at_1_delta"],
    }
  return out


def mean_acceptance(arm: dict, mode: str = "rejection") -> np.ndarray:
  """Per logged step: the teacher-forced acceptance, mean over depths."""
  return np.nanmean(np.asarray(arm["tf_acceptance"][mode], float), axis=1)


def trend(arm: dict, mode: str = "rejection") -> dict:
  """Line of the mean-over-depths teacher-forced acceptance against the step
  (stats.fit_series), its fitted change over the run with the corrected interval
  (`change_ci95`) and the uncorrected one (`ols_change_ci95`)."""
  acc = mean_acceptance(arm, mode)
  steps = np.asarray(arm["steps"], float)
  fit = stats.fit_series(steps, acc)
  fit.update(stats.change_over_run(fit, steps))
  fit["ols_change_ci95"] = [c * fit["span"] for c in fit["ols_slope_ci95"]]
  fit["first"], fit["last"] = float(acc[0]), float(acc[-1])
  return fit


def difference_of_differences(arm: dict, control: dict, mode: str = "rejection") -> dict:
  """Per step present in both: arm's acceptance - control's (the same prompts and rollout
  key at that step), fitted against the step (stats.fit_series): the change of the
  difference over the run is the arm's change minus the control's, with its interval."""
  a = dict(zip(arm["steps"], mean_acceptance(arm, mode)))
  c = dict(zip(control["steps"], mean_acceptance(control, mode)))
  steps = np.asarray(sorted(set(a) & set(c)), float)
  diff = np.asarray([a[s] - c[s] for s in steps], float)
  fit = stats.fit_series(steps, diff)
  fit.update(stats.change_over_run(fit, steps))
  fit["steps"] = steps.tolist()
  fit["difference"] = diff.tolist()
  return fit


def policy_movement(arm: dict) -> dict:
  """How far the policy moved in `arm`: the fitted change of its batch entropy over the run
  (stats.fit_series, nats per token, with its corrected 95% interval) and its held-out mean
  pass@1 change (the mean over tasks of after - before on the same prompts, with a normal
  95% interval from the tasks' paired standard errors)."""
  steps = np.asarray(arm["steps"], float)
  ent = np.asarray(arm["entropy"], float)
  fit = stats.fit_series(steps, ent)
  change = stats.change_over_run(fit, steps)
  deltas = {t: d["delta"] for t, d in arm["pass_at_1_delta"].items()}
  ses = [d.get("se", float("nan")) for d in arm["pass_at_1_delta"].values()]
  mean = float(np.mean(list(deltas.values()))) if deltas else 0.0
  # The mean over tasks of paired per-task differences (independent prompts per task): its
  # standard error and normal 95% interval.
  se = float(np.sqrt(np.sum(np.square(ses))) / len(ses)) if ses else float("nan")
  return {"entropy_change": change["change"], "entropy_change_ci95": change["change_ci95"],
          "entropy_first_last": [float(ent[0]), float(ent[-1])] if ent.size else [],
          **{f"entropy_{k}": v for k, v in stats.x_range(ent).items()},
          "pass_at_1_change": mean, "pass_at_1_change_se": se,
          "pass_at_1_change_ci95": [mean - 1.96 * se, mean + 1.96 * se],
          "pass_at_1_change_per_task": deltas}


def comparison(arms: dict) -> dict:
  """What rules.F4 decides on: per-arm trends, held-out changes, the difference of
  differences of ARM against CONTROL, how far ARM's policy moved, the margin and steps."""
  trends = {arm: trend(a) for arm, a in arms.items()}
  held = {arm: float(np.mean(a["eval_acceptance"]["rejection"][-1]) -
                     np.mean(a["eval_acceptance"]["rejection"][0])) for arm, a in arms.items()}
  return {"trends": trends, "held_out_change": held,
          "control": {"arm": CONTROL, **difference_of_differences(arms[ARM], arms[CONTROL])},
          "policy": policy_movement(arms[ARM]), "margin": TOLERANCE,
          "steps": len(arms[ARM]["steps"])}


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


def table(arms: dict, comp: dict) -> str:
  fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
  trends = comp["trends"]
  lines = ["| arm | held-out acceptance before (rejection) | after (rejection) | before "
           "(greedy_draft) | after (greedy_draft) | change per run (rejection, fit) [95% "
           "HAC/AR(1) t interval] | residual lag-1 autocorrelation | s/step (median) | MTP "
           "update s/step (mean) |", "|---" * 9 + "|"]
  for arm, a in arms.items():
    t = trends[arm]
    ev = a["eval_acceptance"]
    lines.append(f"| {arm} | {fmt(ev['rejection'][0])} | {fmt(ev['rejection'][-1])} | "
                 f"{fmt(ev['greedy_draft'][0])} | {fmt(ev['greedy_draft'][-1])} | "
                 f"{t['change']:+.3f} [{t['change_ci95'][0]:+.3f}, {t['change_ci95'][1]:+.3f}]"
                 f" | {t['residual_lag1_autocorrelation']:+.2f} | {a['step_s']:.2f} | "
                 f"{a['mtp_update_s']:.3f} |")
  c, p = comp["control"], comp["policy"]
  lines += ["", f"Difference of differences, paired by step ({len(c['steps'])} steps, the same "
            f"prompts and rollout key in both arms): {ARM} - {CONTROL} per step, fitted over "
            f"steps: change over the run {c['change']:+.3f} [{c['change_ci95'][0]:+.3f}, "
            f"{c['change_ci95'][1]:+.3f}] (95% HAC/AR(1) t interval; residual lag-1 "
            f"autocorrelation {c['residual_lag1_autocorrelation']:+.2f}).", "",
            f"The policy in {ARM}: batch entropy {p['entropy_x_min']:.3f} to "
            f"{p['entropy_x_max']:.3f} nats (fitted change {p['entropy_change']:+.3f} "
            f"[{p['entropy_change_ci95'][0]:+.3f}, {p['entropy_change_ci95'][1]:+.3f}]); "
            f"held-out mean pass@1 change {p['pass_at_1_change']:+.3f} ("
            + ", ".join(f"{t} {d:+.3f}" for t, d in p["pass_at_1_change_per_task"].items()) +
            f"). Rule F4 counts the policy as moved at {rules.MOVED_ENTROPY} nats of entropy "
            f"or {rules.MOVED_PASS_AT_1} of pass@1."]
  return "\n".join(lines)


def run(ctx: common.Context) -> common.Finding:
  start = time.perf_counter()
  arms = collect(ctx)
  comp = comparison(arms)
  figures = [plot(arms, ctx.out_dir)]
  v, reason, rule = rules.decide(NAME, comp)
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
          + table(arms, comp))
  f = common.Finding(NAME, TITLE, CLAIM, v, reason, body,
                     {"arms": arms, **comp, "tolerance": TOLERANCE}, rows, figures, rule=rule)
  f.seconds = time.perf_counter() - start
  return f
