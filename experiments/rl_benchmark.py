"""The four-arm RL speed benchmark: {autoregressive, speculative} x {sync, async} rollouts on
the same prompts and seeds (experiments/bench_rl.py runs it), and two more arms on request:
speculative rollouts with an adaptive draft length (decoding.adaptive), sync and async.

Each arm is the `rl` stage from the same SFT/MTP workdir with `rl.rollout.engine` and
`rl.asynchronous.enabled` set, in its own workdir.

Interleaving. The arms run in alternating blocks of `block_steps` steps: block b runs steps
b*m + 1 .. (b + 1)*m of every arm (steps counted from 1, as logged), the arms in the given
order in even blocks and in reverse in odd ones (ABCD, DCBA, ABCD, ...), so slow drift of
the machine lands on every arm alike instead of on whole arms. Each block stops the stage at
its last step (`rl.train.stop_at_step`: a checkpoint) and the next block of that arm resumes
it; the rollout key of step s is fold_in(seed, s) and the prompt stream is checkpointed, so a
sync arm's trajectory does not depend on where it was cut (an async arm's first batch after a
resume is sampled with the current weights, so it has no overlap and no staleness). Held-out
evaluations land at the same steps in every arm. A stage start reloads the programs (the
persistent compilation cache makes that a load: compilation.enable_compilation_cache), so the first
`warmup` steps after each start (of each block) are left out of the statistics below. The
segments run are logged in `<workdir>/bench_rl_schedule.json`, so a rerun resumes the
schedule.

From each arm's metrics:
  step_s        median seconds per RL step on the learner side, over its steady steps (the
                steps after the first `warmup` ones of each block)
  rollout_s, learner_s
                medians of the rollout side's and the learner's (policy + drafter) seconds
  rollout_share f = rollout_s / (rollout_s + learner_s), the share of a synchronous step
  time_to_target
                training seconds (summed step_s, every step) until a held-out evaluation after
                step 0 first reaches the target mean pass@1 (None if none does); the default
                target is halfway from the starting value to the best value any arm reached
Paired speedups (`paired_ratio`): the arms share prompts and rollout keys at every step, so
for a pair (A, B) each steady step both arms have gives the log ratio log(t_B / t_A) of its
seconds. The paired unit is the block: the mean log ratio of a block's steps. Steps of one
block are not independent draws: the two arms ran that block minutes apart, and whatever
differed between those two windows (load from other processes, thermal state) is shared by
all of the block's pairs, and an async arm's consecutive steps are coupled through its queue.
A t interval over steps would be too narrow; over blocks the shared part is one draw per unit.
The speedup is exp(mean over blocks), with the Student-t 95% interval at (blocks - 1) degrees
of freedom, exponentiated; > 1 means A is faster. Arms that were not interleaved (run in one
go) form a single unit: a ratio without an interval.
Across arms (`compare`, from the medians):
  decode speedup s = rollout_s(autoregressive, sync) / rollout_s(speculative, sync)
  Amdahl bound of speculative rollouts on a synchronous step: 1 / (1 - f + f / s), f of the
  autoregressive sync arm, against the measured step-time ratio;
  overlap bound of async on the same engine: (rollout_s + learner_s) / max(rollout_s,
  learner_s) of its sync arm, against the measured ratio;
  the end-to-end ratio of speculative async against autoregressive sync, with the bound
  (R + L) / max(R / s, L) of both effects together.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np

from experiments.findings.stats import t_critical
from bebop_jax.stages import lineage

ARMS = ("autoregressive_sync", "autoregressive_async", "speculative_sync", "speculative_async")
# Speculative rollouts with the draft length chosen by decoding.adaptive (--arms adds them).
ADAPTIVE_ARMS = ("adaptive_sync", "adaptive_async")
ALL_ARMS = ARMS + ADAPTIVE_ARMS
BLOCK_STEPS = 8
SCHEDULE_FILE = "bench_rl_schedule.json"
# (A, B): A's speedup over B. The first three compare like with like (or both effects).
HEADLINE_PAIRS = (("speculative_async", "autoregressive_async"),
                  ("speculative_sync", "autoregressive_sync"),
                  ("speculative_async", "autoregressive_sync"))
OTHER_PAIRS = (("autoregressive_async", "autoregressive_sync"),
               ("speculative_async", "speculative_sync"))
# The adaptive draft length against both fixed choices (K = 0 and the drafter's K), at
# equal scheduling.
ADAPTIVE_PAIRS = (("adaptive_sync", "autoregressive_sync"), ("adaptive_sync", "speculative_sync"),
                  ("adaptive_async", "autoregressive_async"),
                  ("adaptive_async", "speculative_async"))
# The rollout side alone: speculative against autoregressive rollout seconds (sync arms).
DECODE_PAIR = ("decode_speedup", "speculative_sync", "autoregressive_sync", "rollout_s")


def pair_name(a: str, b: str) -> str:
  return f"{a}_vs_{b}"


def arm_overrides(arm: str, *, split: bool) -> dict[str, Any]:
  """`config.rl` overrides (dotted keys) of one arm; on split sub-meshes when `split` (else
  colocated, an async arm's rollout thread sharing the devices)."""
  if arm not in ALL_ARMS:
    raise ValueError(f"arm={arm!r} is not allowed: one of {ALL_ARMS}")
  engine, mode = arm.split("_")
  out: dict[str, Any] = {"rollout.engine": "speculative" if engine == "adaptive" else engine,
                         "asynchronous.enabled": mode == "async",
                         "/decoding.adaptive.enabled": engine == "adaptive"}
  if split:
    out.update({"placement.mode": "split"})
  return out


def amdahl(f: float, s: float) -> float:
  """The end-to-end speedup when a share f of the time speeds up s times."""
  return 1.0 / (1.0 - f + f / s)


def _median(records: Sequence[Mapping[str, Any]], key: str) -> float:
  return float(np.median([r[key] for r in records]))


def warmup_steps(steps: Sequence[int], segment_starts: Sequence[int], warmup: int) -> set[int]:
  """The steps among `steps` that are one of the first `warmup` steps of a segment (a stage
  start; `segment_starts` are their first steps)."""
  return {s for s in steps for start in segment_starts if start <= s < start + warmup}


def arm_stats(records: Sequence[Mapping[str, Any]], evals: Mapping[str, Any], *,
              warmup: int, target: float | None,
              segment_starts: Sequence[int] = (1,)) -> dict[str, Any]:
  """The per-arm numbers (module docstring) from its logged RL steps and held-out evals.

  Args:
    records: the arm's logged RL steps (metrics.jsonl records of stage "rl").
    evals: its held-out evaluations by step (rl/evals.json).
    warmup: steps after each stage start left out of the medians.
    target: held-out mean pass@1 to time, or None.
    segment_starts: the first step of each stage start (one per block the arm ran in);
      (1,) for an arm run in one go.

  Returns:
    The medians and means of the module docstring, "steady_steps" (the steps the medians
    count; every step when none is past its warm-up), "warmup_steps", "first_steps_s" (their
    summed seconds), the held-out curve and the time to target.
  """
  records = sorted(records, key=lambda r: r["step"])
  skipped = warmup_steps([r["step"] for r in records], segment_starts, warmup)
  steady = [r for r in records if r["step"] not in skipped] or records
  learner = [r["learner_s"] + r["mtp_update_s"] for r in steady]
  out = {"steps": len(records), "step_s": _median(steady, "step_s"),
         "steady_steps": [int(r["step"]) for r in steady],
         "warmup_steps": sorted(int(s) for s in skipped),
         "first_steps_s": float(sum(r["step_s"] for r in records if r["step"] in skipped)),
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


def paired_ratio(a: Mapping[int, float], b: Mapping[int, float], *,
                 block_steps: int | None) -> dict[str, Any]:
  """A's speedup over B from their paired steps (module docstring).

  Args:
    a, b: steady step -> seconds of arm A and of arm B; steps only one arm has are left out.
    block_steps: the block size the arms were interleaved with (step s is in block
      (s - 1) // block_steps); None when they were not interleaved (one unit).

  Returns:
    {"measured": exp(mean over blocks of the block's mean log(t_B / t_A)), "ci95": [lo, hi]
    (the exponentiated Student-t 95% interval over blocks; None with fewer than two blocks),
    "steps": paired steps, "blocks": paired blocks (units), "df": blocks - 1,
    "median_ratio": median(t_B) / median(t_A) over each arm's steps given}; "measured" and
    "median_ratio" are None when the arms share no step.
  """
  steps = sorted(set(a) & set(b))
  median_ratio = (float(np.median(list(b.values())) / np.median(list(a.values())))
                  if a and b else None)
  units: dict[int, list[float]] = {}
  for s in steps:
    unit = 0 if block_steps is None else (s - 1) // block_steps
    units.setdefault(unit, []).append(math.log(b[s] / a[s]))
  means = np.array([np.mean(v) for _, v in sorted(units.items())])
  out: dict[str, Any] = {"measured": float(np.exp(means.mean())) if len(means) else None,
                         "ci95": None, "steps": len(steps), "blocks": len(means),
                         "df": max(len(means) - 1, 0), "median_ratio": median_ratio}
  if len(means) >= 2:
    half = t_critical(len(means) - 1) * means.std(ddof=1) / math.sqrt(len(means))
    out["ci95"] = [float(np.exp(means.mean() - half)), float(np.exp(means.mean() + half))]
  return out


def paired_ratios(records: Mapping[str, Sequence[Mapping[str, Any]]],
                  steady_steps: Mapping[str, Sequence[int]], *, block_steps: int | None,
                  interleaved: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
  """Every pair of HEADLINE_PAIRS, OTHER_PAIRS and ADAPTIVE_PAIRS whose arms are both present (step seconds,
  "of": "step_s"), and "decode_speedup" (rollout seconds of the sync arms, "of":
  "rollout_s"): paired_ratio over the steady steps of both arms, with "arms": [A, B].

  Args:
    records: per arm, its logged RL steps.
    steady_steps: per arm, the steps its statistics count.
    block_steps: the block size of the schedule (None: no arm was interleaved).
    interleaved: the arms that ran in every block (None: all); a pair with another arm is
      one unit (no interval).
  """
  def seconds(arm: str, key: str) -> dict[int, float]:
    keep = set(steady_steps[arm])
    return {int(r["step"]): float(r[key]) for r in records[arm] if r["step"] in keep}

  blocked = set(records if interleaved is None else interleaved)
  pairs = [(pair_name(a, b), a, b, "step_s")
           for a, b in HEADLINE_PAIRS + OTHER_PAIRS + ADAPTIVE_PAIRS]
  out = {}
  for name, a, b, key in pairs + [DECODE_PAIR]:
    if a in records and b in records:
      size = block_steps if a in blocked and b in blocked else None
      out[name] = {**paired_ratio(seconds(a, key), seconds(b, key), block_steps=size),
                   "arms": [a, b], "of": key}
  return out


def compare(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Speedups and their bounds across the arms present, from their medians (module
  docstring)."""
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


# ----------------------------------------------------------------------------- schedule


def block_size(steps: int, block_steps: int) -> int:
  """The block size used for `steps` steps: `block_steps`, or `steps` (one block, the arms one
  after the other) when it is 0 or at least `steps`."""
  return block_steps if 0 < block_steps < steps else steps


def schedule(arms: Sequence[str], steps: int, block_steps: int) -> list[dict[str, Any]]:
  """The interleaved plan: per block b (block_size steps), every arm's steps b*m + 1 .. (b +
  1)*m (the last block may be shorter), arms in the given order in even blocks and reversed
  in odd ones. Entries {"block", "position" (place in the block's order), "arm",
  "first_step", "last_step"} in the order they run."""
  m = block_size(steps, block_steps)
  plan = []
  for block in range(-(-steps // m)):
    order = list(arms) if block % 2 == 0 else list(reversed(arms))
    for position, arm in enumerate(order):
      plan.append({"block": block, "position": position, "arm": arm,
                   "first_step": block * m + 1, "last_step": min((block + 1) * m, steps)})
  return plan


# ----------------------------------------------------------------------------- placement


def placement(split: bool) -> dict[str, Any]:
  """Where the arms ran: {"mode": "split" or "colocated", "devices", "platform", "simulated"
  (simulated host devices: a CPU platform with more than one device), "cpu_cores"}."""
  import jax  # pylint: disable=g-import-not-at-top
  platform, count = jax.devices()[0].platform, jax.device_count()
  return {"mode": "split" if split else "colocated", "devices": count, "platform": platform,
          "simulated": platform == "cpu" and count > 1, "cpu_cores": os.cpu_count()}


def placement_line(p: Mapping[str, Any]) -> str:
  """One sentence on the placement; for split sub-meshes of simulated CPU devices it says the
  run checks the split path's structure and is no speed result."""
  where = ("the learner and the rollouts on split sub-meshes (disjoint devices)"
           if p["mode"] == "split" else
           "colocated (the learner on the mesh, the rollouts on the first device)")
  devices = "simulated host devices" if p["simulated"] else f"{p['platform']} device(s)"
  line = (f"Placement: {where}, on {p['devices']} {devices}; {p['cpu_cores']} CPU cores.")
  if p["mode"] == "split" and p["simulated"]:
    line += (f" The simulated devices share the machine's {p['cpu_cores']} CPU cores, so the "
             "two sub-meshes compete for the same cores: this run is a structural check of the "
             "split path, not a speed result.")
  return line


# ----------------------------------------------------------------------------- markdown


def _interval(p: Mapping[str, Any]) -> str:
  if p["ci95"] is None:
    return "none (one block)" if p["blocks"] == 1 else "none"
  lo, hi = p["ci95"]
  return f"{lo:.2f}-{hi:.2f}"


def _pair_rows(pairs: Mapping[str, Mapping[str, Any]], names: Sequence[str], *,
               bold: bool = False) -> list[str]:
  rows = []
  for name in names:
    if name in pairs and pairs[name]["measured"] is not None:
      p = pairs[name]
      what = " (rollout s)" if p["of"] == "rollout_s" else ""
      label = f"{p['arms'][0]} vs {p['arms'][1]}{what}"
      rows.append(f"| {f'**{label}**' if bold else label} | {p['measured']:.2f}x | "
                  f"{_interval(p)} | {p['blocks']} | {p['steps']} | {p['median_ratio']:.2f}x |")
  return rows


def schedule_line(sched: Mapping[str, Any]) -> str:
  """How the arms were run: the blocks, their orders and the warm-up left out."""
  orders = []
  for order in sched["order"][:2]:
    orders.append("".join(chr(ord("A") + sched["arms"].index(a)) for a in order))
  key = ", ".join(f"{chr(ord('A') + i)} = {a}" for i, a in enumerate(sched["arms"]))
  if sched["blocks"] > 1:
    more = ", ..." if sched["blocks"] > 2 else ""
    return (f"Arms interleaved in {sched['blocks']} blocks of {sched['block_steps']} steps, "
            f"the order alternating {', '.join(orders)}{more} ({key}); the first "
            f"{sched['warmup']} step(s) of each block (a stage start) are left out of the "
            "medians and pairs.")
  return (f"Arms run one after the other ({key}), one block of {sched['block_steps']} steps: "
          f"the pairs have no interval; the first {sched['warmup']} step(s) are left out.")


def markdown(arms: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, Any],
             target: float | None, *, pairs: Mapping[str, Mapping[str, Any]] | None = None,
             placement: Mapping[str, Any] | None = None,  # pylint: disable=redefined-outer-name
             schedule: Mapping[str, Any] | None = None  # pylint: disable=redefined-outer-name
             ) -> str:
  """The placement and schedule, the per-arm table, the paired speedups with their intervals
  (the three headline pairs first, then the others and the decode speedup) and the ratios of
  medians with their bounds, as markdown."""
  lines = []
  if placement is not None:
    lines += [placement_line(placement), ""]
  if schedule is not None:
    lines += [schedule_line(schedule), ""]
  lines += ["| arm | s/step | rollout s | learner s | rollout share | tokens/forward | "
            "staleness | learner idle s | time to target s |", "|---" * 9 + "|"]
  for name in ALL_ARMS:
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
  if pairs:
    headline = _pair_rows(pairs, [pair_name(a, b) for a, b in HEADLINE_PAIRS], bold=True)
    other = _pair_rows(pairs, [pair_name(a, b) for a, b in OTHER_PAIRS] + [DECODE_PAIR[0]] +
                       [pair_name(a, b) for a, b in ADAPTIVE_PAIRS])
    lines += ["", "Paired speedups: per step the log ratio of the two arms' seconds on the "
              "same prompts and seeds, averaged per block; exp(mean over blocks) with its "
              "Student-t 95% interval over blocks (> 1: the first arm is faster); the three "
              "headline pairs in bold. The last column is the ratio of the arms' medians.", "",
              "| pair | speedup | 95% interval | blocks | steps | ratio of medians |",
              "|---" * 6 + "|"]
    lines += headline + other
  lines.append("")
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


# ----------------------------------------------------------------------------- running


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


def _steps_done(arm_dir: str) -> int:
  """RL steps an arm's workdir holds: all when complete, else its latest checkpoint's step."""
  from bebop_jax.train import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  summary = lineage.read_summary(arm_dir, "rl")
  if summary is not None:
    return int(summary["steps"])
  ckpt_dir = os.path.join(lineage.stage_dir(arm_dir, "rl"), "checkpoints")
  if not os.path.isdir(ckpt_dir):
    return 0
  with checkpoint_lib.Checkpointer(ckpt_dir) as ckpt:
    return ckpt.latest_step() or 0


def run_arms(config: Any, workdir: str, arms: Sequence[str], *, split: bool,
             warmup: int = 2, target: float | None = None,
             block_steps: int = BLOCK_STEPS) -> dict[str, Any]:
  """Runs (or resumes) the arms' RL stages under `workdir/<arm>`, interleaved in blocks.

  Args:
    config: the bench config (bench_config), whose rl.init_from holds the SFT/MTP stages.
    workdir: one subdirectory per arm, and the schedule log (SCHEDULE_FILE).
    arms: names from ARMS; their order is the order of even blocks.
    split: the arms on split sub-meshes (else colocated).
    warmup: steps after each stage start (the first of every block) left out of the
      statistics.
    target: held-out mean pass@1 to time (None: default_target).
    block_steps: steps per block (module docstring); 0 or >= rl.train.num_steps: one block,
      each arm in one go. Stage restarts recompile or reload programs: enable the persistent
      compilation cache (compilation.enable_compilation_cache) first.

  Returns:
    {"arms": per arm arm_stats (with "learner_compile_s" and "interleaved"), "ratios":
    compare, "pairs": paired_ratios, "target", "placement": placement(split), "schedule":
    {"arms", "block_steps", "blocks", "warmup", "order" (the arm order of each block),
    "segments" (the stage starts, in the order they ran: block, position, arm, first_step,
    last_step, started (unix time), seconds)}}.

  Raises:
    ValueError: for blocks with no step past the warm-up, or a workdir scheduled with another
      block size.
    RuntimeError: when an arm did not reach the end of its block.
  """
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import rl as stage  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  steps = config.rl.train.num_steps
  m = block_size(steps, block_steps)
  plan = schedule(arms, steps, m)
  blocks = plan[-1]["block"] + 1
  if blocks > 1 and m <= warmup:
    raise ValueError(f"block_steps={block_steps} is not allowed with warmup={warmup}: every "
                     "block would be all warm-up")
  log_path = os.path.join(workdir, SCHEDULE_FILE)
  log = metrics_lib.read_json(log_path) or {"block_steps": m, "segments": []}
  if log["block_steps"] != m:
    raise ValueError(f"block_steps={block_steps} is not allowed for {workdir}: its arms were "
                     f"scheduled in blocks of {log['block_steps']} steps (pass that, or use "
                     "a new workdir)")
  os.makedirs(workdir, exist_ok=True)
  for entry in plan:
    arm_dir = os.path.join(workdir, entry["arm"])
    done = _steps_done(arm_dir)
    if done >= entry["last_step"]:
      continue
    segment = {**entry, "first_step": done + 1, "started": time.time(), "seconds": None}
    log["segments"].append(segment)
    metrics_lib.write_json_atomic(log_path, log)  # a crash mid-block still shows the start
    overrides = {**arm_overrides(entry["arm"], split=split),
                 "train.stop_at_step": entry["last_step"]}
    cfg = config_lib.validate(apply_overrides(config, overrides))
    start = time.perf_counter()
    summary = stage.run(cfg, arm_dir)
    segment["seconds"] = time.perf_counter() - start
    metrics_lib.write_json_atomic(log_path, log)
    if summary["steps"] != entry["last_step"]:
      raise RuntimeError(f"arm {entry['arm']} stopped at step {summary['steps']}, not at the "
                         f"end of block {entry['block']} (step {entry['last_step']})")
  raw, compile_s, starts, interleaved = {}, {}, {}, []
  for arm in arms:
    arm_dir = os.path.join(workdir, arm)
    summary = lineage.read_summary(arm_dir, "rl")
    if summary is None:
      raise RuntimeError(f"arm {arm} is not complete in {arm_dir}; rerun to resume")
    compile_s[arm] = summary["timing"]["compile_s"]
    evals = metrics_lib.read_json(os.path.join(lineage.stage_dir(arm_dir, "rl"), "evals.json")) or {}
    raw[arm] = (metrics_lib.read_metrics(arm_dir, "rl"), evals)
    segments = [s for s in log["segments"] if s["arm"] == arm]
    # Step 1 always starts a segment (one run before this schedule's log, if none is logged).
    starts[arm] = sorted({1} | {s["first_step"] for s in segments})
    if blocks > 1 and {s["block"] for s in segments} == set(range(blocks)):
      interleaved.append(arm)
  stats = {a: arm_stats(r, e, warmup=warmup, target=None, segment_starts=starts[a])
           for a, (r, e) in raw.items()}
  target = default_target(stats) if target is None else target
  stats = {a: arm_stats(r, e, warmup=warmup, target=target, segment_starts=starts[a])
           for a, (r, e) in raw.items()}
  for a in stats:
    stats[a]["learner_compile_s"] = compile_s[a]
    stats[a]["interleaved"] = a in interleaved
  pairs = paired_ratios({a: r for a, (r, _) in raw.items()},
                        {a: s["steady_steps"] for a, s in stats.items()}, block_steps=m,
                        interleaved=interleaved)
  return {"arms": stats, "ratios": compare(stats), "pairs": pairs, "target": target,
          "placement": placement(split),
          "schedule": {"arms": list(arms), "block_steps": m, "blocks": blocks, "warmup": warmup,
                       "order": [[e["arm"] for e in plan if e["block"] == b]
                                 for b in range(blocks)],
                       "segments": log["segments"]}}


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
  """A copy of `config` with `config.rl` overrides by dotted key (e.g. "rollout.engine"; a
  key starting with "/" is from the config's root, e.g. "/decoding.adaptive.enabled")."""
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.apply_overrides(
      config, {k[1:] if k.startswith("/") else f"rl.{k}": v for k, v in overrides.items()})
