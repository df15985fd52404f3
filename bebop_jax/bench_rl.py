"""The four-arm RL speed benchmark: {autoregressive, speculative} x {sync, async} rollouts on
the same prompts and seeds (experiments/bench_rl.py runs it).

Each arm is the `rl` stage from the same SFT/MTP workdir with `rl.rollout.engine` and
`rl.asynchronous.enabled` set, in its own workdir. From each arm's metrics:
  step_s        median seconds per RL step on the learner side (steps after the first
                `warmup` ones; the first steps compile the length buckets and prompt shapes)
  rollout_s, learner_s
                medians of the rollout side's and the learner's (policy + drafter) seconds
  rollout_share f = rollout_s / (rollout_s + learner_s), the share of a synchronous step
  time_to_target
                training seconds (summed step_s) until a held-out evaluation after step 0
                first reaches the target mean pass@1 (None if none does); the default target
                is halfway from the starting value to the best value any arm reached
Across arms:
  decode speedup s = rollout_s(autoregressive, sync) / rollout_s(speculative, sync)
  Amdahl bound of speculative rollouts on a synchronous step: 1 / (1 - f + f / s), f of the
  autoregressive sync arm, against the measured step-time ratio;
  overlap bound of async on the same engine: (rollout_s + learner_s) / max(rollout_s,
  learner_s) of its sync arm, against the measured ratio;
  the end-to-end ratio of speculative async against autoregressive sync, with the bound
  (R + L) / max(R / s, L) of both effects together.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

ARMS = ("autoregressive_sync", "autoregressive_async", "speculative_sync", "speculative_async")


def arm_overrides(arm: str, *, split: bool) -> dict[str, Any]:
  """`config.rl` overrides (dotted keys) of one arm; async arms on split sub-meshes when
  `split` (else colocated, the rollout thread sharing the devices)."""
  if arm not in ARMS:
    raise ValueError(f"arm={arm!r} is not allowed: one of {ARMS}")
  engine, mode = arm.split("_")
  out: dict[str, Any] = {"rollout.engine": engine, "asynchronous.enabled": mode == "async"}
  if split:
    out.update({"placement.mode": "split"})
  return out


def amdahl(f: float, s: float) -> float:
  """The end-to-end speedup when a share f of the time speeds up s times."""
  return 1.0 / (1.0 - f + f / s)


def _median(records: Sequence[Mapping[str, Any]], key: str) -> float:
  return float(np.median([r[key] for r in records]))


def arm_stats(records: Sequence[Mapping[str, Any]], evals: Mapping[str, Any], *,
              warmup: int, target: float | None) -> dict[str, Any]:
  """The per-arm numbers (module docstring) from its logged RL steps and held-out evals."""
  records = sorted(records, key=lambda r: r["step"])
  steady = [r for r in records if r["step"] > warmup] or records
  learner = [r["learner_s"] + r["mtp_update_s"] for r in steady]
  out = {"steps": len(records), "step_s": _median(steady, "step_s"),
         "first_steps_s": float(sum(r["step_s"] for r in records[:warmup])),
         "rollout_s": _median(steady, "rollout_s"), "learner_s": float(np.median(learner)),
         "sync_s": _median(steady, "sync_s"),
         "learner_idle_s": _median(steady, "learner_idle_s"),
         "rollout_idle_s": _median(steady, "rollout_idle_s"),
         "staleness_mean": float(np.mean([r["staleness_mean"] for r in records])),
         "tokens_per_target_forward": float(np.mean([r["tokens_per_target_forward"]
                                                     for r in records])),
         "completion_length": float(np.mean([r["completion_length"] for r in records]))}
  out["rollout_share"] = out["rollout_s"] / (out["rollout_s"] + out["learner_s"])
  elapsed = np.cumsum([r["step_s"] for r in records])
  by_step = {r["step"]: t for r, t in zip(records, elapsed)}
  curve = [(int(step), float(np.mean(list(e["pass_at_1"].values()))))
           for step, e in sorted(evals.items(), key=lambda kv: int(kv[0]))]
  out["held_out"] = curve
  out["time_to_target_s"] = None
  if target is not None:
    for step, value in curve:
      if step > 0 and value >= target:
        out["time_to_target_s"] = float(by_step.get(step, 0.0))
        break
  return out


def compare(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Speedups and their bounds across the arms present (module docstring)."""
  out: dict[str, Any] = {}
  ar, sp = arms.get("autoregressive_sync"), arms.get("speculative_sync")
  if ar and sp:
    s = ar["rollout_s"] / sp["rollout_s"]
    f = ar["rollout_share"]
    out["decode_speedup"] = s
    out["speculative_sync"] = {"measured": ar["step_s"] / sp["step_s"], "amdahl": amdahl(f, s),
                               "rollout_share": f}
  for engine in ("autoregressive", "speculative"):
    sync, asy = arms.get(f"{engine}_sync"), arms.get(f"{engine}_async")
    if sync and asy:
      r, l = sync["rollout_s"], sync["learner_s"]
      out[f"{engine}_async"] = {"measured": sync["step_s"] / asy["step_s"],
                                "overlap_bound": (r + l) / max(r, l)}
  best = arms.get("speculative_async")
  if ar and best and "decode_speedup" in out:
    r, l, s = ar["rollout_s"], ar["learner_s"], out["decode_speedup"]
    out["end_to_end"] = {"measured": ar["step_s"] / best["step_s"],
                         "bound": (r + l) / max(r / s, l)}
  return out


def default_target(arms: Mapping[str, Mapping[str, Any]]) -> float | None:
  """Halfway from the starting held-out mean pass@1 (every arm starts from the same policy
  and evaluation) to the best any arm reached after step 0; None when no arm improved on
  its start (then no time to target is measured)."""
  curves = [a["held_out"] for a in arms.values() if len(a["held_out"]) > 1]
  if not curves:
    return None
  start = curves[0][0][1]
  best = max(value for curve in curves for step, value in curve if step > 0)
  return start + (best - start) / 2 if best > start else None


def markdown(arms: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, Any],
             target: float | None) -> str:
  """The table and the ratios as markdown."""
  lines = ["| arm | s/step | rollout s | learner s | rollout share | tokens/forward | "
           "staleness | learner idle s | time to target s |", "|---" * 9 + "|"]
  for name in ARMS:
    if name not in arms:
      continue
    a = arms[name]
    ttt = "never" if a["time_to_target_s"] is None else f"{a['time_to_target_s']:.0f}"
    lines.append(f"| {name} | {a['step_s']:.2f} | {a['rollout_s']:.2f} | {a['learner_s']:.2f} |"
                 f" {a['rollout_share']:.2f} | {a['tokens_per_target_forward']:.2f} | "
                 f"{a['staleness_mean']:.2f} | {a['learner_idle_s']:.2f} | {ttt} |")
  lines.append("")
  if target is not None:
    lines.append(f"Target held-out mean pass@1: {target:.3f}.")
  else:
    lines.append("No arm's held-out mean pass@1 rose above its start: no time to target.")
  if "decode_speedup" in ratios:
    r = ratios["speculative_sync"]
    lines.append(f"Decode speedup s = {ratios['decode_speedup']:.2f}; speculative sync vs "
                 f"autoregressive sync: measured {r['measured']:.2f}x, Amdahl bound "
                 f"{r['amdahl']:.2f}x (f = {r['rollout_share']:.2f}).")
  for engine in ("autoregressive", "speculative"):
    if f"{engine}_async" in ratios:
      r = ratios[f"{engine}_async"]
      lines.append(f"{engine} async vs sync: measured {r['measured']:.2f}x, overlap bound "
                   f"{r['overlap_bound']:.2f}x.")
  if "end_to_end" in ratios:
    r = ratios["end_to_end"]
    lines.append(f"Speculative async vs autoregressive sync: measured {r['measured']:.2f}x, "
                 f"bound {r['bound']:.2f}x.")
  return "\n".join(lines) + "\n"


def bench_config(config: Any, init_from: str, *, steps: int, eval_every: int,
                 eval_examples: int, max_staleness: int, split: bool) -> Any:
  """A copy of `config` set up for the arms: the rl stage alone from `init_from`, every step
  logged, held-out evaluation in rejection mode only, no teacher-forced scoring (it would
  add to the learner's time), the async bound, and half the devices per side when `split`."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.stages = ("rl",)
    config.rl.init_from = os.path.abspath(os.path.expanduser(init_from))
    config.rl.train.num_steps = steps
    config.rl.train.eval_every = eval_every
    config.rl.train.checkpoint_every = min(config.rl.train.checkpoint_every, steps)
    config.rl.train.log_every = 1
    config.rl.eval.num_examples = eval_examples
    config.rl.eval.modes = ("rejection",)
    config.rl.acceptance_modes = ()
    config.rl.asynchronous.max_staleness = max_staleness
    if split:
      config.rl.placement.learner_devices = 0.5
  return config


def run_arms(config: Any, workdir: str, arms: Sequence[str], *, split: bool,
             warmup: int = 2, target: float | None = None) -> dict[str, Any]:
  """Runs (or resumes) each arm's RL stage under `workdir/<arm>` from `config` (whose
  rl.init_from holds the SFT/MTP stages); returns {"arms", "ratios", "target", "compile_s"}."""
  from bebop_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.rl import stage  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  raw, compile_s = {}, {}
  for arm in arms:
    cfg = config_lib.validate(apply_overrides(config, arm_overrides(arm, split=split)))
    arm_dir = os.path.join(workdir, arm)
    summary = stage.run(cfg, arm_dir)
    if not summary.get("complete"):
      raise RuntimeError(f"arm {arm} stopped at step {summary['steps']}; rerun to resume")
    compile_s[arm] = summary["timing"]["compile_s"]
    evals = metrics_lib.read_json(os.path.join(stage.stage_dir(arm_dir), "evals.json")) or {}
    raw[arm] = (metrics_lib.read_metrics(arm_dir, "rl"), evals)
  stats = {a: arm_stats(r, e, warmup=warmup, target=None) for a, (r, e) in raw.items()}
  target = default_target(stats) if target is None else target
  stats = {a: arm_stats(r, e, warmup=warmup, target=target) for a, (r, e) in raw.items()}
  for a in stats:
    stats[a]["learner_compile_s"] = compile_s[a]
  return {"arms": stats, "ratios": compare(stats), "target": target}


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
  """A copy of `config` with `config.rl` overrides by dotted key (e.g. "rollout.engine")."""
  from bebop_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.apply_overrides(config, {f"rl.{k}": v for k, v in overrides.items()})
