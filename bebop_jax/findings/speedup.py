"""Speedup: the four RL arms {autoregressive, speculative} x {sync, async} (bebop_jax.bench_rl)
from the e2e_tv drafter of F3, on the same prompts and seeds, with the bounds the measured
decode speedup and rollout share allow."""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from bebop_jax import bench_rl
from bebop_jax.findings import common

NAME = "speedup"
TITLE = "Speedup: speculative and async RL steps"
CLAIM = "async GRPO-style RL with MTP rollouts runs up to 1.8x faster end to end."
PAPER_SPEEDUP = 1.8


def measure(ctx: common.Context) -> dict:
  s = ctx.scale
  split = jax.device_count() >= 2
  config = bench_rl.bench_config(ctx.config(), ctx.drafter("e2e_tv", 0), steps=s.bench_steps,
                                 eval_every=s.bench_steps, eval_examples=s.bench_eval_examples,
                                 max_staleness=1, split=split)
  workdir = os.path.join(ctx.workdir, "speedup")
  from bebop_jax.rl import stage as rl_stage  # pylint: disable=g-import-not-at-top
  pending = [a for a in bench_rl.ARMS if rl_stage.read_summary(os.path.join(workdir, a)) is None]
  start = time.perf_counter()
  result = bench_rl.run_arms(config, workdir, bench_rl.ARMS, split=split, warmup=s.bench_warmup)
  if pending:
    ctx.record("speedup", time.perf_counter() - start)
  result["devices"] = {"count": jax.device_count(), "platform": jax.devices()[0].platform,
                       "kind": jax.devices()[0].device_kind, "split": split}
  return result


def verdict(result: dict) -> tuple[str, str]:
  r = result["ratios"]
  e2e, dev = r["end_to_end"], result["devices"]
  text = (f"Speculative async against autoregressive sync: {e2e['measured']:.2f}x per RL step "
          f"(bound {e2e['bound']:.2f}x from the measured decode speedup "
          f"{r['decode_speedup']:.2f}x and rollout share "
          f"{r['speculative_sync']['rollout_share']:.2f}; the paper: up to "
          f"{PAPER_SPEEDUP:.1f}x), on {dev['count']} {dev['platform']} device(s)"
          f"{', learner and rollouts on split sub-meshes' if dev['split'] else ', colocated'}.")
  sp, asy = r["speculative_sync"], r["speculative_async"]
  text += (f" Its parts: speculative against autoregressive rollouts (sync) {sp['measured']:.2f}x"
           f" (Amdahl bound {sp['amdahl']:.2f}x), async against sync (speculative) "
           f"{asy['measured']:.2f}x (overlap bound {asy['overlap_bound']:.2f}x).")
  shared = (" On CPU the learner and the rollout thread share the same cores, so async "
            "overlaps little of the two sides, and one speculative iteration costs several "
            "autoregressive steps." if dev["platform"] == "cpu" else "")
  if e2e["measured"] >= 0.8 * PAPER_SPEEDUP:
    return "reproduced", text
  if e2e["measured"] <= 1.1:
    return "not reproduced", text + shared
  return "inconclusive", text + " Faster, but well short of the paper's figure." + shared


def plot(result: dict, out_dir: str) -> str:
  plt = common.pyplot()
  arms = [a for a in bench_rl.ARMS if a in result["arms"]]
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
  names, measured, bound = [], [], []
  for key, label, b in (("speculative_sync", "speculative\nsync", "amdahl"),
                        ("autoregressive_async", "autoregr.\nasync", "overlap_bound"),
                        ("speculative_async", "speculative\nasync", "overlap_bound"),
                        ("end_to_end", "spec. async vs\nautoregr. sync", "bound")):
    if key in r:
      names.append(label)
      measured.append(r[key]["measured"])
      bound.append(r[key][b])
  x = np.arange(len(names))
  axes[1].bar(x - 0.2, measured, 0.4, label="measured")
  axes[1].bar(x + 0.2, bound, 0.4, label="bound", alpha=0.6)
  axes[1].axhline(PAPER_SPEEDUP, color="k", ls="--", lw=1, label="paper: up to 1.8x")
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set_xticks(x)
  axes[1].set_xticklabels(names, fontsize=8)
  axes[1].set_ylabel("speedup per RL step")
  axes[1].legend(fontsize=8)
  axes[1].grid(alpha=0.3, axis="y")
  return common.save_figure(fig, out_dir, f"{NAME}.png")


def run(ctx: common.Context) -> common.Finding:
  start = time.perf_counter()
  result = measure(ctx)
  figure = plot(result, ctx.out_dir)
  v, reason = verdict(result)
  rows = [{"arm": a, **{k: v for k, v in s.items() if not isinstance(v, (list, dict))}}
          for a, s in result["arms"].items()]
  body = (f"{ctx.scale.bench_steps} RL steps per arm (medians after the first "
          f"{ctx.scale.bench_warmup}), max_staleness 1.\n\n" +
          bench_rl.markdown(result["arms"], result["ratios"], result["target"]))
  f = common.Finding(NAME, TITLE, CLAIM, v, reason, body, result, rows, [figure])
  f.seconds = time.perf_counter() - start
  return f
