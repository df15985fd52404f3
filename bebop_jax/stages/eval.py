"""The eval stage: measure the policy the job ends with, then write summary.json and report.md.

The policy measured is the one the job hands on: the RL stage's final parameters (trunk and
MTP modules, read from its last checkpoint) when the RL stage completed in the workdir, else
the MTP stage's policy and drafter. Measured or gathered here:
  - pass@1, online acceptance per depth and tokens per target forward on held-out prompts:
    after RL, the RL stage's own final held-out evaluation, and its step-0 evaluation as
    the "before RL" figures beside it; without RL, the MTP stage's evaluation of its drafter;
  - wall-clock speed of speculative against autoregressive decoding on the same held-out
    prompts at each `report.batch_sizes`, at mtp.temperature, for each mtp.eval_modes
    (bebop_jax.stages.decode_timing, which also checks online against teacher-forced
    acceptance at the visited frontiers);
  - teacher-forced acceptance per depth, and acceptance against target entropy: per-position
    depth-1 acceptance and target entropy over held-out rollouts of the measured policy at
    each `report.entropy_temperatures` (the temperature raises the policy's entropy), with a
    least-squares line per mode. The MTP stage's cached held-out rollouts serve its policy;
    a policy RL changed is sampled afresh on the same prompts and settings.
bebop_jax.stages.report renders the result: <workdir>/summary.json, plots/*.png and report.md.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bebop_jax import multihost
from bebop_jax.stages import report
from bebop_jax.decoding import batching, diagnostics, sampling
from bebop_jax.stages import decode_timing
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import drafter
from bebop_jax.stages import lineage
from bebop_jax.stages import rollouts as rollouts_lib
from bebop_jax.stages import drafter_data

STAGE = "eval"
TIMING_FILE = "timing.json"


def linear_fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
  """Least-squares y = intercept + slope * x, with r2 and the slope's standard error
  (`slope_se`; a 95% interval is about slope +- 2 slope_se)."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  slope, intercept = np.polyfit(x, y, 1)
  resid = y - (intercept + slope * x)
  total = np.sum((y - y.mean()) ** 2)
  spread = np.sum((x - x.mean()) ** 2)
  se = (np.sqrt(np.sum(resid ** 2) / (len(x) - 2) / spread)
        if len(x) > 2 and spread > 0 else float("nan"))
  return {"slope": float(slope), "intercept": float(intercept),
          "r2": float(1 - np.sum(resid ** 2) / total) if total > 0 else 0.0,
          "slope_se": float(se), "points": int(len(x))}


def entropy_points(graphdef, params, sequences, *, temperatures, modes: tuple[str, ...],
                   batch_size=64, buckets=batching.PROMPT_BUCKETS, progress=None,
                   draft_vocab=None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{mode: (entropy, depth-1 acceptance)} per counted position, pooled over temperatures
  (one forward per batch and temperature for all modes); `progress.update()` after each;
  the drafts from `draft_vocab` when given (the drafter's reduced vocabulary)."""
  vocab = None if draft_vocab is None else jnp.asarray(draft_vocab)
  longest = batching.bucket(max(len(t) for t, _ in sequences), buckets)
  ents, alphas = [], {mode: [] for mode in modes}
  for t in temperatures:
    params_s = sampling.SamplingParams(temperature=t)
    for seq, gen in diagnostics.padded_batches(sequences, batch_size, longest):
      out = jax.device_get(diagnostics.acceptance_by_position(
          graphdef, params, jnp.asarray(seq), jnp.asarray(gen), vocab, params=params_s,
          modes=tuple(modes)))
      m = out["mask"][0]
      ents.append(out["entropy"][0][m])
      for mode in modes:
        alphas[mode].append(out["alpha"][mode][0][m])
      if progress is not None:
        progress.update(1)
  ent = np.concatenate(ents)
  return {mode: (ent, np.concatenate(a)) for mode, a in alphas.items()}


def policy_to_measure(config: ml_collections.ConfigDict, workdir: str
                      ) -> tuple[Any, Any, dict[str, Any]]:
  """(graphdef, parameters, {"stage", "step"}) of the policy the job ends with: the RL
  stage's final checkpoint when that stage completed in `workdir` (its drafter is the MTP
  modules in those parameters, frozen or updated), else the MTP stage's policy."""
  rl_summary = lineage.read_summary(workdir, "rl")
  if rl_summary is not None:
    step = int(rl_summary["steps"])
    graphdef, params = lineage.restore_policy(config, workdir, stage="rl", step=step)
    return graphdef, params, {"stage": "rl", "step": step}
  mtp_summary = lineage.read_summary(workdir, "mtp")
  if mtp_summary is None:
    raise FileNotFoundError(f"the eval stage needs a completed MTP stage in {workdir}")
  graphdef, params = lineage.restore_policy(config, workdir, stage="mtp")
  return graphdef, params, {"stage": "mtp", "step": int(mtp_summary["steps"])}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Measures, writes summary.json, plots and report.md; skipped when summary.json exists."""
  done = lineage.read_summary(workdir, "eval")
  if done is not None:
    print(f"[eval] complete: {os.path.join(workdir, 'summary.json')} (report.md): skipping")
    return done
  start, compiles = time.perf_counter(), metrics_lib.compile_stats()
  sft_summary = lineage.read_summary(workdir, "sft") or lineage.read_summary(
      lineage.sft_workdir(config, workdir), "sft")
  mtp_summary = lineage.read_summary(workdir, "mtp")
  if mtp_summary is None:
    raise FileNotFoundError(f"the eval stage needs a completed MTP stage in {workdir}")
  graphdef, params, policy = policy_to_measure(config, workdir)
  rl_summary = lineage.read_summary(workdir, "rl") if policy["stage"] == "rl" else None
  print(f"[eval] measuring the {policy['stage']} stage's policy (step {policy['step']})")
  r, m = config.report, config.mtp
  modes = tuple(m.eval_modes)
  bar = lambda total, desc, unit: metrics_lib.Progress(
      total, 0, f"[eval] {desc}", disable=not r.progress, unit=unit)

  # Decode speed against autoregressive decoding, same prompts, same process.
  progress = bar(len(r.batch_sizes), "decode speed", "batch size")
  vocab = lineage.stored_draft_vocabulary(workdir)  # the drafter drafts from its vocabulary
  rows = decode_timing.run_benchmark(
      config, graphdef, params, batch_sizes=tuple(r.batch_sizes), temperatures=[m.temperature],
      modes=list(modes), max_new=config.eval.max_new_tokens, repeats=r.repeats,
      num_prompts=r.num_prompts,
      draft_vocabs=None if vocab is None else {str(len(vocab)): vocab},
      adaptive_settings=(rollouts_lib.adaptive_settings(config)
                         if config.decoding.adaptive.enabled else None),
      on_measured=progress.update)
  progress.close()

  # Held-out rollouts of the measured policy: teacher-forced acceptance, acceptance against
  # target entropy.
  after = mtp_summary["after"]
  if rl_summary is None:
    sequences = drafter_data.heldout_sequences(config, workdir, graphdef, params)  # stored by mtp
  else:
    # This policy's own rollouts, with the MTP stage's held-out prompts and settings.
    rollouts = drafter_data.policy_rollouts(config, graphdef, params, "test", drafter_data.heldout_tasks(config),
                                   progress=r.progress, desc="[eval] held-out rollouts")
    sequences = [seq for ro in rollouts.values() for seq in ro.sequences()]
  progress = bar(len(r.entropy_temperatures) * -(-len(sequences) // config.eval.batch_size),
                 "acceptance vs entropy", "batch")
  entropy = entropy_points(graphdef, params, sequences,
                           temperatures=tuple(r.entropy_temperatures),
                           modes=("rejection", "greedy_draft"),
                           batch_size=config.eval.batch_size,
                           buckets=tuple(config.eval.prompt_buckets), progress=progress,
                           draft_vocab=vocab)
  progress.close()
  fits = {mode: linear_fit(*pts) for mode, pts in entropy.items()}

  main_mode = "rejection" if "rejection" in modes else modes[0]
  mtp_figures = {
      "acceptance_online": {mode: after["online"][mode]["acceptance"] for mode in modes},
      "tokens_per_target_forward": {mode: after["online"][mode]["tokens_per_target_forward"]
                                    for mode in modes},
      "acceptance_teacher_forced": {mode: after["teacher_forced"][mode]["alpha"]
                                    for mode in modes}}
  if rl_summary is None:
    measured = {"accuracy": after["online"][main_mode]["accuracy"],
                "accuracy_mode": main_mode, "temperature": m.temperature}
    figures, before_rl = mtp_figures, None
  else:
    # The RL stage evaluated its final policy on held-out prompts (every rl.eval.modes
    # samples the policy exactly; pass@1 pools them), and the same prompts and keys at step
    # 0: the policy that entered RL.
    rl_modes = tuple(rl_summary["acceptance_after"])
    measured = {"accuracy": rl_summary["pass_at_1_after"],
                "accuracy_se": rl_summary["pass_at_1_se_after"],
                "accuracy_mode": "pooled over " + ", ".join(rl_modes),
                "temperature": config.rl.rollout.temperature,
                "accuracy_before_rl": rl_summary["pass_at_1_before"],
                "accuracy_se_before_rl": rl_summary["pass_at_1_se_before"]}
    teacher_forced = drafter.teacher_forced_acceptance(
        graphdef, params, sequences, temperature=m.temperature, modes=rl_modes,
        batch_size=config.eval.batch_size, buckets=tuple(config.eval.prompt_buckets),
        draft_vocab=vocab)
    figures = {"acceptance_online": rl_summary["acceptance_after"],
               "tokens_per_target_forward": rl_summary["tokens_per_target_forward_after"],
               "acceptance_teacher_forced": {mode: teacher_forced[mode]["alpha"]
                                             for mode in rl_modes}}
    before_rl = {"acceptance_online": rl_summary["acceptance_before"],
                 "tokens_per_target_forward": rl_summary["tokens_per_target_forward_before"],
                 # The MTP stage's, on the held-out rollouts of the policy before RL.
                 "acceptance_teacher_forced": mtp_figures["acceptance_teacher_forced"]}
  summary = {
      "policy": policy,
      "eval": measured,
      "sft": {"accuracy": (sft_summary or {}).get("eval", {}),
              "steps": (sft_summary or {}).get("steps"),
              "entropy": (sft_summary or {}).get("entropy", {}),
              **throughput(sft_summary or {})},
      "mtp": {"loss": mtp_summary["loss"],
              "acceptance_teacher_forced": after["teacher_forced"][main_mode]["alpha"],
              "acceptance_teacher_forced_by_mode": mtp_figures["acceptance_teacher_forced"],
              "steps": mtp_summary["steps"],
              "schedule": mtp_summary.get("schedule"),
              "draft_vocab": mtp_summary.get("draft_vocab"),
              # per depth: drafts verified and accepted, the rate, its Wilson 95% interval
              "online": {mode: {k: v for k, v in ev.items() if k != "per_task"}
                         for mode, ev in after.get("online", {}).items()},
              "teacher_forced": after["teacher_forced"],
              "before": _compact(mtp_summary.get("before"), modes),
              **throughput(mtp_summary)},
      "decode": {
          **figures,
          **({"before_rl": before_rl} if before_rl else {}),
          "speedup_vs_autoregressive": {str(row["batch"]): row["speedup"] for row in rows
                                        if row["mode"] == main_mode and "k" not in row},
          **_adaptive_summary(rows, main_mode),
          "benchmark": rows},
      "entropy_fit": fits,
  }
  if rl_summary is not None:
    summary["rl"] = rl_section(rl_summary)
  timing = read_timing(workdir)
  started_at = timing.pop("started_at", None)
  timing["eval_s"] = time.perf_counter() - start
  earlier = timing.pop("earlier_s", 0.0)  # stages run by earlier invocations (stages.run)
  timing["total_s"] = (time.time() - started_at + earlier if started_at else
                       sum(v for k, v in timing.items() if k.endswith("_s")))
  timing.setdefault("compile", {})["eval"] = metrics_lib.compile_stats(since=compiles)
  summary["timing"] = timing
  if multihost.is_primary():  # process 0 of a run over several writes the files
    plots = report.write_plots(workdir, summary, entropy)
    metrics_lib.write_json_atomic(os.path.join(workdir, "summary.json"), summary)
    with open(os.path.join(workdir, "report.md"), "w") as f:
      f.write(report.render_report(summary, plots))
  print(f"[eval] wrote {workdir}/summary.json, report.md and plots/ "
        f"({timing['eval_s']:.0f}s)")
  print(report.headline(summary))
  return summary


def _adaptive_summary(rows: list[dict], mode: str) -> dict[str, Any]:
  """The adaptive rows of `mode` (decode_timing.run_benchmark with adaptive settings): their
  speed ratio, the iterations run with each K per batch size and the cost table; {} when
  there are none."""
  rows = [r for r in rows if r.get("k") == "adaptive" and r["mode"] == mode]
  if not rows:
    return {}
  return {"adaptive": {
      "speedup_vs_autoregressive": {str(r["batch"]): r["speedup"] for r in rows},
      "k_iterations": {str(r["batch"]): r["k_iterations"] for r in rows},
      "cost_table": [e for r in rows for e in r["cost_table"]]}}


def rl_entropy_fit(r: dict) -> dict[str, dict[str, float]]:
  """Per mode: depth-1 teacher-forced acceptance of each RL step's batch against the
  policy's mean entropy on it, one point per logged step."""
  fits = {}
  for mode, rows in r["tf_acceptance_by_step"].items():
    pts = [(e, a[0]) for e, a in zip(r["entropy_by_step"], rows) if a and a[0] is not None]
    if len(pts) > 2:
      fits[mode] = linear_fit(*np.array(pts).T)
  return fits


def rl_section(r: dict) -> dict:
  """summary.json's "rl": pass@1 before/after per task (with standard errors and the paired
  difference), steps, per-step online acceptance per depth (and teacher-forced per mode),
  held-out evaluations by step, timing."""
  keys = ("steps", "mtp_strategy", "rollout_engine", "rollout_mode", "pass_at_1_before",
          "pass_at_1_after", "pass_at_1_se_before", "pass_at_1_se_after", "pass_at_1_delta",
          "acceptance_before", "acceptance_after", "tokens_per_target_forward_before",
          "tokens_per_target_forward_after", "logged_steps", "acceptance_by_step",
          "tf_acceptance_by_step", "reward_by_step", "entropy_by_step", "eval_by_step",
          "timing")
  out = {k: r[k] for k in keys}
  out["entropy_fit"] = rl_entropy_fit(r)
  return out


def _compact(ev: dict | None, modes) -> dict | None:
  if not ev:
    return None
  out = {"acceptance_teacher_forced": {m: ev["teacher_forced"][m]["alpha"] for m in modes}}
  if "online" in ev:  # the initial drafter may be measured teacher-forced only
    out.update(acceptance_online={m: ev["online"][m]["acceptance"] for m in modes},
               tokens_per_target_forward={m: ev["online"][m]["tokens_per_target_forward"]
                                          for m in modes})
  return out


THROUGHPUT_KEYS = ("steady_step_time_s", "model_flops_per_s", "matmul_flops_per_s",
                   "flops_utilization", "temp_bytes")


def throughput(stage_summary: dict[str, Any]) -> dict[str, Any]:
  """A training stage's step time, model FLOP/s, their ratio to the matmul calibration and
  the step's temporary memory (trainer.train_loop's summary), where recorded."""
  return {k: stage_summary[k] for k in THROUGHPUT_KEYS if stage_summary.get(k) is not None}


def write_timing(workdir: str, timing: dict[str, float]):
  """This invocation's seconds per stage so far, in <workdir>/timing.json (stages.run)."""
  metrics_lib.write_json_atomic(os.path.join(workdir, TIMING_FILE), timing)


def read_timing(workdir: str) -> dict[str, float]:
  return metrics_lib.read_json(os.path.join(workdir, TIMING_FILE)) or {}
