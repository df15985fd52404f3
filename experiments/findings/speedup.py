"""Speedup: the four RL arms {autoregressive, speculative} x {sync, async} (experiments.rl_benchmark)
from the e2e_tv drafter of F3, on the same prompts and seeds, with the bounds the measured
decode speedup and rollout share allow.

The arms run interleaved and rl_benchmark.run_arms pairs their step times by step: each ratio of
two arms comes with a 95% interval ("pairs"). The page's headline pairs are speculative
against autoregressive at equal scheduling (async vs async, sync vs sync), beside
speculative async against autoregressive sync. The verdict is rules.SPEEDUP; the placement
(colocated or split, real or simulated devices) is stated, and split placement on simulated
devices is a structural check, not a speed result.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from experiments import rl_benchmark
from experiments.findings import common
from experiments.findings import rules
from bebop_jax.stages import lineage

NAME = "speedup"
TITLE = "Speedup: speculative and async RL steps"
CLAIM = "async GRPO-style RL with MTP rollouts runs up to 1.8x faster end to end."
PAPER_SPEEDUP = rules.PAPER_SPEEDUP
PAIRS = (*rules.PAIRS_HEADLINE, rules.PAIR_END_TO_END,
         "autoregressive_async_vs_autoregressive_sync", "speculative_async_vs_speculative_sync")


def measure(ctx: common.Context) -> dict:
  s = ctx.scale
  split = jax.device_count() >= 2
  config = rl_benchmark.bench_config(ctx.config(), ctx.drafter("e2e_tv", 0), steps=s.bench_steps,
                                 eval_every=s.bench_steps, eval_examples=s.bench_eval_examples,
                                 max_staleness=1, split=split)
  workdir = os.path.join(ctx.workdir, "speedup")
  pending = [a for a in rl_benchmark.ARMS if lineage.read_summary(os.path.join(workdir, a), "rl") is None]
  start = time.perf_counter()
  result = rl_benchmark.run_arms(config, workdir, rl_benchmark.ARMS, split=split, warmup=s.bench_warmup,
                             block_steps=s.bench_block_steps)
  if pending:
    ctx.record("speedup", time.perf_counter() - start)
  result["devices"] = {"count": jax.device_count(), "platform": jax.devices()[0].platform,
                       "kind": jax.devices()[0].device_kind, "split": split}
  return result


def plot(result: dict, out_dir: str) -> str:
  plt = common.pyplot()
  arms = [a for a in rl_benchmark.ARMS if a in result["arms"]]
  stats = [result["arms"][a] for a in arms]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  x = np.arange(len(arms))
  axes[0].bar(x - 0.2, [s["rollout_s"] for s in stats], 0.4, label="rollout s")
  axes[0].bar(x + 0.2, [s["learner_s"] for s in stats], 0.4, label="learner s")
  axes[0].plot(x, [s["step_s"] for s in stats], "ko", label="s / step")
  axes[0].set_xticks(x)
  axes[0].set_xticklabels([a.replace("_", "\n") for a in arms], fontsize=8)
  axes[0].set_ylabel("seconds (median over steps)")
  axes[0].legend(fontsize=8)
  axes[0].grid(alpha=0.3, axis="y")
  r = result["ratios"]
  pairs = result.get("pairs") or {}
  # Each pair, with the bound of the matching ratio where bench_rl gives one.
  bounds = {"speculative_sync_vs_autoregressive_sync": ("speculative_sync", "amdahl"),
            "autoregressive_async_vs_autoregressive_sync": ("autoregressive_async",
                                                            "overlap_bound"),
            "speculative_async_vs_speculative_sync": ("speculative_async", "overlap_bound"),
            "speculative_async_vs_autoregressive_sync": ("end_to_end", "bound")}
  names = [p for p in PAIRS if p in pairs and pairs[p].get("measured") is not None]
  x = np.arange(len(names))
  measured = np.asarray([pairs[p]["measured"] for p in names], float)
  ci = np.asarray([pairs[p]["ci95"] or [np.nan, np.nan] for p in names], float).reshape(-1, 2)
  axes[1].bar(x - 0.2, measured, 0.4, yerr=[measured - ci[:, 0], ci[:, 1] - measured],
              capsize=3, label="measured, 95% t interval over blocks of paired steps")
  bound = [r.get(bounds[p][0], {}).get(bounds[p][1], np.nan) if p in bounds else np.nan
           for p in names]
  axes[1].bar(x + 0.2, bound, 0.4, label="bound", alpha=0.6)
  axes[1].axhline(PAPER_SPEEDUP, color="k", ls="--", lw=1, label="paper: up to 1.8x")
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set_xticks(x)
  axes[1].set_xticklabels([p.replace("_vs_", "\nvs\n").replace("autoregressive", "AR")
                           .replace("speculative", "spec.").replace("_", " ") for p in names],
                          fontsize=7)
  axes[1].set_ylabel("step-time ratio (first arm faster > 1)")
  axes[1].legend(fontsize=8)
  axes[1].grid(alpha=0.3, axis="y")
  return common.save_figure(fig, out_dir, f"{NAME}.png")


def run(ctx: common.Context) -> common.Finding:
  start = time.perf_counter()
  result = measure(ctx)
  figure = plot(result, ctx.out_dir)
  v, reason, rule = rules.decide(NAME, result)
  rows = [{"arm": a, **{k: v for k, v in s.items() if not isinstance(v, (list, dict))}}
          for a, s in result["arms"].items()]
  body = (f"{ctx.scale.bench_steps} RL steps per arm, max_staleness 1.\n\n" +
          rl_benchmark.markdown(result["arms"], result["ratios"], result["target"],
                            pairs=result.get("pairs"), placement=result.get("placement"),
                            schedule=result.get("schedule")))
  f = common.Finding(NAME, TITLE, CLAIM, v, reason, body, result, rows, [figure], rule=rule)
  f.seconds = time.perf_counter() - start
  return f
