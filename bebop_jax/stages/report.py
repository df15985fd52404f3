"""The eval stage's pages: report.md, plots/*.png, the headline and the closing table.

Rendering only: bebop_jax.stages.eval measures the policy the job ends with and assembles the
summary (the dict written to <workdir>/summary.json, keys in docs/main_job.md); the
functions here turn that dict into text and figures and compute nothing of their own.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bebop_jax import evaluation


def teacher_forced(s: dict) -> dict[str, list[float]]:
  """{mode: teacher-forced acceptance per depth} of the measured policy (summaries written
  before the eval stage measured it themselves: the MTP stage's)."""
  return (s.get("decode") or {}).get("acceptance_teacher_forced") or \
      (s.get("mtp") or {}).get("acceptance_teacher_forced_by_mode") or {}


def _measured(s: dict) -> str:
  """Which policy the figures are of, for titles: "after RL" or ""."""
  return "after RL" if (s.get("policy") or {}).get("stage") == "rl" else ""


def headline(s: dict) -> str:
  fmt = lambda xs: "/".join(f"{x:.3f}" for x in xs)
  d, e = s["decode"], s["eval"]
  after = f", {_measured(s)}" if _measured(s) else ""
  lines = [f"pass@1 (T={e['temperature']:g}, speculative{after}): "
           + ", ".join(f"{k} {v:.3f}" for k, v in e["accuracy"].items())]
  if e.get("accuracy_before_rl"):
    lines.append("pass@1 before RL: " + ", ".join(
        f"{k} {v:.3f}" for k, v in e["accuracy_before_rl"].items()))
  tf = teacher_forced(s)
  for mode, acc in d["acceptance_online"].items():
    lines.append(f"{mode}{after}: acceptance online {fmt(acc)}, teacher-forced "
                 f"{fmt(tf[mode])}, "
                 f"{d['tokens_per_target_forward'][mode]:.2f} tokens/target forward")
  lines.append("speedup vs autoregressive (rejection): " + ", ".join(
      f"batch {b}: {v:.2f}x" for b, v in d["speedup_vs_autoregressive"].items()))
  lines.append("acceptance vs entropy slope: " + ", ".join(
      f"{m} {f['slope']:.3f}/nat" for m, f in s["entropy_fit"].items()))
  return "\n".join(lines)


def run_summary(workdir: str, s: dict | None, timing: dict[str, Any]) -> str:
  """The table a main-job run ends with (at most about 12 lines): held-out pass@1 before and
  after RL, the drafter's acceptance per depth and tokens per target forward (before and
  after RL when it ran), the speculative/autoregressive speed ratios of the policy the job
  ends with, seconds per stage and where the report and summary are. Sections whose stage
  did not run are left out."""
  rows = []
  s = s or {}
  rl = s.get("rl") or {}
  if rl.get("pass_at_1_before"):
    before, after = rl["pass_at_1_before"], rl.get("pass_at_1_after") or {}
    delta = rl.get("pass_at_1_delta") or {}
    for task in sorted(before):
      d = delta.get(task, {})
      change = (f" ({d['delta']:+.3f} ± {d['se']:.3f} paired)" if "delta" in d else "")
      rows.append((f"pass@1 {task}", f"{before[task]:.3f} before RL -> "
                   f"{after.get(task, float('nan')):.3f} after{change}"))
  elif (s.get("eval") or {}).get("accuracy"):
    rows.append(("pass@1", ", ".join(f"{k} {v:.3f}"
                                     for k, v in s["eval"]["accuracy"].items())))
  decode = s.get("decode") or {}
  pre = decode.get("before_rl") or {}
  depths = lambda acc: " / ".join(f"{a:.2f}" for a in acc)
  tf = teacher_forced(s)
  mode = "rejection" if "rejection" in tf else next(iter(tf), None)
  acc = tf[mode] if mode else (s.get("mtp") or {}).get("acceptance_teacher_forced")
  if acc:
    was = (pre.get("acceptance_teacher_forced") or {}).get(mode)
    rows.append(("drafter acceptance",
                 (f"{depths(was)} before RL -> " if was else "") + depths(acc)
                 + " per depth (teacher-forced" + (f", {mode})" if mode else ")")))
  if decode.get("tokens_per_target_forward"):
    was = pre.get("tokens_per_target_forward") or {}
    rows.append(("tokens / target forward", ", ".join(
        f"{m} " + (f"{was[m]:.2f} before RL -> " if m in was else "") + f"{v:.2f}"
        for m, v in decode["tokens_per_target_forward"].items())))
  if decode.get("speedup_vs_autoregressive"):
    rows.append(("speculative / AR", ", ".join(
        f"batch {b} {v:.2f}x" for b, v in decode["speedup_vs_autoregressive"].items())))
  stage_s = [(n, timing[f"{n}_s"]) for n in ("sft", "mtp", "rl", "eval")
             if f"{n}_s" in timing]
  if stage_s:
    rows.append(("time", ", ".join(f"{n} {t / 60:.1f} min" for n, t in stage_s)
                 + f" (total {sum(t for _, t in stage_s) / 60:.1f} min)"))
  for name in ("report.md", "summary.json"):
    if os.path.exists(os.path.join(workdir, name)):
      rows.append((name.split(".")[0], os.path.join(workdir, name)))
  width = max((len(k) for k, _ in rows), default=0)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_plots(workdir: str, s: dict, entropy: dict) -> dict[str, str]:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  out = os.path.join(workdir, "plots")
  os.makedirs(out, exist_ok=True)
  paths = {}

  def save(fig, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

  fig, ax = plt.subplots(figsize=(6, 4))
  for mode, acc in s["decode"]["acceptance_online"].items():
    depths = np.arange(1, len(acc) + 1)
    line, = ax.plot(depths, acc, marker="o", label=f"{mode} online")
    ax.plot(depths, teacher_forced(s)[mode], ls="--",
            color=line.get_color(), label=f"{mode} teacher-forced")
  ax.set_xlabel("draft depth k")
  ax.set_ylabel("acceptance")
  ax.set_xticks(depths)
  ax.legend()
  ax.grid(alpha=0.3)
  paths["acceptance_by_depth"] = save(fig, "acceptance_by_depth")

  fig, ax = plt.subplots(figsize=(6, 4))
  for mode, (ent, alpha) in entropy.items():
    edges = np.quantile(ent, np.linspace(0, 1, 16))
    idx = np.clip(np.searchsorted(edges, ent, side="right") - 1, 0, len(edges) - 2)
    centers = [ent[idx == b].mean() for b in range(len(edges) - 1) if (idx == b).any()]
    means = [alpha[idx == b].mean() for b in range(len(edges) - 1) if (idx == b).any()]
    f = s["entropy_fit"][mode]
    dots = ax.scatter(centers, means, label=f"{mode} (binned)")
    xs = np.linspace(0, ent.max(), 50)
    ax.plot(xs, f["intercept"] + f["slope"] * xs, color=dots.get_facecolor()[0],
            label=f"{mode} fit: {f['intercept']:.2f} {f['slope']:+.3f}/nat, r2 {f['r2']:.2f}")
  ax.set_xlabel("target entropy (nats)")
  ax.set_ylabel("depth-1 acceptance (teacher-forced)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  paths["acceptance_vs_entropy"] = save(fig, "acceptance_vs_entropy")

  fig, ax = plt.subplots(figsize=(6, 4))
  rows = s["decode"]["benchmark"]
  batches = sorted({r["batch"] for r in rows})
  label = lambda r: r["mode"] + (" adaptive" if r.get("k") == "adaptive" else "")
  modes = sorted({label(r) for r in rows})
  width = 0.8 / len(modes)
  for i, mode in enumerate(modes):
    vals = [next(r["speedup"] for r in rows if label(r) == mode and r["batch"] == b)
            for b in batches]
    ax.bar(np.arange(len(batches)) + i * width, vals, width, label=mode)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(np.arange(len(batches)) + width * (len(modes) - 1) / 2)
  ax.set_xticklabels([str(b) for b in batches])
  ax.set_xlabel("batch size")
  ax.set_ylabel("speedup vs autoregressive (wall clock)")
  ax.legend()
  paths["speedup_by_batch"] = save(fig, "speedup_by_batch")
  if s["sft"]["entropy"]:
    fig, ax = plt.subplots(figsize=(6, 4))
    edges = np.asarray(evaluation.ENTROPY_BIN_EDGES)
    for task, st in s["sft"]["entropy"].items():
      frac = np.asarray(st["histogram"], float) / max(st["positions"], 1)
      ax.step(edges[:-1], frac, where="post",
              label=f"{task}: mean {st['mean']:.2f}, {st['above_threshold']:.0%} > "
                    f"{evaluation.ENTROPY_THRESHOLD}")
    ax.set_yscale("log")
    ax.set_xlabel("policy entropy at a sampled token (nats; last bin: above)")
    ax.set_ylabel("fraction of positions")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths["entropy_histogram"] = save(fig, "entropy_histogram")
  if "rl" in s:
    paths.update(_rl_plots(s["rl"], save, plt))
  return paths


def _rl_plots(r: dict, save, plt) -> dict[str, str]:
  """Reward and held-out pass@1 over RL steps; entropy and acceptance per depth over steps;
  pass@1 before and after."""
  paths = {}
  steps = r["logged_steps"]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(steps, r["reward_by_step"], color="0.6", lw=1, label="training batch reward")
  evals = sorted(r["eval_by_step"].items(), key=lambda kv: int(kv[0]))
  for task in r["pass_at_1_before"]:
    xs = [int(k) for k, _ in evals]
    ys = np.array([e["pass_at_1"][task] for _, e in evals])
    se = np.array([e["pass_at_1_se"][task] for _, e in evals])
    line, = ax.plot(xs, ys, marker="o", label=f"held-out pass@1 {task}")
    ax.fill_between(xs, ys - se, ys + se, color=line.get_color(), alpha=0.15)
  ax.set_xlabel("RL step")
  ax.set_ylabel("reward")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  paths["rl_reward"] = save(fig, "rl_reward")

  fig, ax1 = plt.subplots(figsize=(6, 4))
  acc = np.array(r["acceptance_by_step"], float)
  for d in range(acc.shape[1] if acc.ndim == 2 else 0):
    ax1.plot(steps, acc[:, d], label=f"depth {d + 1} online ({r['rollout_mode']})")
  for mode, rows in r["tf_acceptance_by_step"].items():
    tf = np.array(rows, float)
    if tf.ndim == 2 and tf.size:
      ax1.plot(steps, tf[:, 0], ls="--", label=f"depth 1 teacher-forced ({mode})")
  ax1.set_xlabel("RL step")
  ax1.set_ylabel("acceptance")
  ax2 = ax1.twinx()
  ax2.plot(steps, r["entropy_by_step"], color="k", lw=1, ls=":", label="policy entropy")
  ax2.set_ylabel("entropy of sampled tokens (nats)")
  h1, l1 = ax1.get_legend_handles_labels()
  h2, l2 = ax2.get_legend_handles_labels()
  ax1.legend(h1 + h2, l1 + l2, fontsize=7)
  ax1.grid(alpha=0.3)
  paths["rl_acceptance"] = save(fig, "rl_acceptance")

  fig, ax = plt.subplots(figsize=(6, 4))
  tasks = list(r["pass_at_1_before"])
  x = np.arange(len(tasks))
  for i, (when, label) in enumerate((("before", "before RL"), ("after", "after RL"))):
    ax.bar(x + 0.4 * i, [r[f"pass_at_1_{when}"][t] for t in tasks], 0.4,
           yerr=[r[f"pass_at_1_se_{when}"][t] for t in tasks], capsize=3, label=label)
  ax.set_xticks(x + 0.2)
  ax.set_xticklabels(tasks)
  ax.set_ylabel("held-out pass@1")
  ax.legend()
  paths["rl_pass_at_1"] = save(fig, "rl_pass_at_1")
  return paths


def _rl_report(r: dict, plots: dict[str, str]) -> list[str]:
  fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
  t = r["timing"]
  lines = ["## RL", "",
           f"GRPO for {r['steps']} steps on {r['rollout_engine']} rollouts "
           f"({r['rollout_mode']} verification), the drafter {r['mtp_strategy']}. The sections "
           "above measure the policy RL ended with and its drafter (the MTP modules in its "
           "final parameters), the figures before RL beside them. Held-out pass@1 at the "
           "rollout temperature, pooled over the evaluation modes (each samples the policy "
           "exactly), with standard errors over prompts; the difference is paired (the same "
           "prompts and keys before and after).", "",
           "| task | before | after | after - before |", "|---|---|---|---|"]
  for task, before in r["pass_at_1_before"].items():
    d = r["pass_at_1_delta"][task]
    lines.append(f"| {task} | {before:.3f} +- {r['pass_at_1_se_before'][task]:.3f} | "
                 f"{r['pass_at_1_after'][task]:.3f} +- {r['pass_at_1_se_after'][task]:.3f} | "
                 f"{d['delta']:+.3f} +- {d['se']:.3f} |")
  lines += ["", "Drafter acceptance per depth on held-out prompts, before and after RL:", "",
            "| mode | before | after | tokens / target forward before -> after |",
            "|---|---|---|---|"]
  for mode, before in r["acceptance_before"].items():
    lines.append(f"| {mode} | {fmt(before)} | {fmt(r['acceptance_after'][mode])} | "
                 f"{r['tokens_per_target_forward_before'][mode]:.2f} -> "
                 f"{r['tokens_per_target_forward_after'][mode]:.2f} |")
  if r.get("entropy_fit"):
    lines += ["", "Depth-1 teacher-forced acceptance of each step's batch against the policy's "
              "mean entropy on it (one point per step):", ""]
    lines += [f"- {m}: acceptance = {f['intercept']:.3f} {f['slope']:+.3f} "
              f"(+- {f['slope_se']:.3f}) x entropy, r2 {f['r2']:.2f}, {f['points']} steps"
              for m, f in r["entropy_fit"].items()]
  lines += ["", f"Time: rollouts {t['rollout_s']:.0f} s, learner {t['learner_s']:.0f} s, "
            f"MTP updates {t['mtp_update_s']:.0f} s (rollout share {t['rollout_share']:.0%}); "
            f"the whole stage, evaluations included, {t['stage_s']:.0f} s.", ""]
  for name in ("rl_pass_at_1", "rl_reward", "rl_acceptance"):
    if name in plots:
      lines += [f"![{name}](plots/{os.path.basename(plots[name])})", ""]
  return lines


def _policy_line(s: dict) -> str:
  """What the report measures, in one sentence."""
  policy = s.get("policy") or {}
  trained = f"trained with `{s['mtp']['loss']}` on the frozen SFT policy's own rollouts"
  if policy.get("stage") == "rl":
    return (f"Policy: the RL stage's final parameters (step {policy['step']}), RL after SFT on "
            f"the synthetic tasks; drafter: the MTP modules in them, {trained} before RL "
            f"({s['rl']['mtp_strategy']} during RL). Everything below was measured in this run "
            "on held-out prompts; \"before RL\" is the policy and drafter that entered RL.")
  return (f"Policy: SFT on the synthetic tasks; drafter: its MTP modules {trained}. "
          "Everything below was measured in this run on held-out prompts.")


def _interval(row: dict) -> str:
  """A benchmark row's 95% interval over passes, " [lo, hi]" (empty for one pass)."""
  ci = row.get("speedup_ci95")
  return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def render_report(s: dict, plots: dict[str, str]) -> str:
  fmt = lambda xs: "-" if xs is None else " / ".join(f"{x:.3f}" for x in xs)
  d, e = s["decode"], s["eval"]
  before_rl = e.get("accuracy_before_rl")
  lines = ["# bebop_jax run report", "", _policy_line(s), "",
           f"## Task accuracy (pass@1, T={e['temperature']:g}, speculative decoding, "
           f"{e['accuracy_mode']} verification)", ""]
  if before_rl:
    se, se_before = e.get("accuracy_se", {}), e.get("accuracy_se_before_rl", {})
    lines += ["| task | before RL | after RL |", "|---|---|---|"]
    lines += [f"| {k} | {before_rl[k]:.3f} +- {se_before.get(k, float('nan')):.3f} | "
              f"{v:.3f} +- {se.get(k, float('nan')):.3f} |" for k, v in e["accuracy"].items()]
  else:
    lines += ["| task | pass@1 |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in e["accuracy"].items()]
  lines += ["", "Speculative decoding samples exactly the policy's distribution, so these "
            "equal what plain sampling would give, up to sampling noise.", "",
            "## Drafter acceptance per depth" + (f" ({_measured(s)})" if _measured(s) else ""),
            "", "| mode | online | teacher-forced | tokens / target forward |",
            "|---|---|---|---|"]
  tf = teacher_forced(s)
  for mode, acc in d["acceptance_online"].items():
    lines.append(f"| {mode} | {fmt(acc)} | {fmt(tf[mode])} | "
                 f"{d['tokens_per_target_forward'][mode]:.2f} |")
  pre = d.get("before_rl")
  if pre:
    lines += ["", "Before RL (online: the RL stage's held-out evaluation at step 0; "
              "teacher-forced: the MTP stage's, on the pre-RL policy's held-out rollouts):", "",
              "| mode | online | teacher-forced | tokens / target forward |",
              "|---|---|---|---|"]
    for mode, acc in pre["acceptance_online"].items():
      was = pre["acceptance_teacher_forced"].get(mode)
      lines.append(f"| {mode} | {fmt(acc)} | {fmt(was) if was else '-'} | "
                   f"{pre['tokens_per_target_forward'][mode]:.2f} |")
  before = s["mtp"].get("before")
  if before:
    lines += ["", "Before the MTP stage (drafter from SFT's joint cross-entropy):", "",
              "| mode | online | tokens / target forward |", "|---|---|---|"]
    for mode, acc in before["acceptance_online"].items():
      lines.append(f"| {mode} | {fmt(acc)} | "
                   f"{before['tokens_per_target_forward'][mode]:.2f} |")
  lines += ["", "Online: accepted / attempted drafts at depth k while decoding held-out "
            "prompts (depth k is attempted when depths < k were accepted). Teacher-forced: "
            "the same acceptance from one training-style forward over held-out rollouts, "
            "averaged over all their positions and weighted by the probability of reaching "
            "the depth. The two differ where acceptance varies along a completion, because "
            "decoding visits frontiers unevenly (every turn starts with one at its first, "
            "often hardest, token). The exact self-consistency check is in the speed table "
            "below: teacher-forced acceptance at the very frontiers visited online; a gap "
            "there beyond sampling noise would mean a cache bug. Tokens per target forward: "
            "the policy tokens verifications emitted per verification (a turn's first token "
            "comes from its prefill).", "",
            f"![acceptance by depth](plots/{os.path.basename(plots['acceptance_by_depth'])})",
            "", "## Speed against autoregressive decoding", "",
            "| batch | prompts | mode | AR tok/s | speculative tok/s | speedup [95% over passes] "
            "| tok/fwd | "
            "online | teacher-forced at visited frontiers |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in d["benchmark"]:
    mode = r["mode"] + (" (adaptive K)" if r.get("k") == "adaptive" else "")
    if r.get("draft_vocab") not in (None, "full"):  # no teacher-forced check on a reduced one
      mode += f" @{r['draft_vocab']}"
    lines.append(f"| {r['batch']} | {r['prompts']} | {mode} | "
                 f"{r['ar_tokens_per_s']:.0f} | {r['spec_tokens_per_s']:.0f} | "
                 f"{r['speedup']:.2f}x{_interval(r)} | {r['tokens_per_target_forward']:.2f} | "
                 f"{fmt(r['acceptance_online'])} | {fmt(r['acceptance_teacher_forced'])} |")
  if "adaptive" in d:
    a = d["adaptive"]
    lines += ["", "Adaptive draft length (decoding.adaptive): decoding iterations run with each "
              "K, per batch size: " + "; ".join(
                  f"batch {b}: " + ", ".join(f"K={k}: {n}" for k, n in hist.items())
                  for b, hist in a["k_iterations"].items()) + ". Its cost table (seconds "
              "per iteration by K and live rows, measured in-process): " + ", ".join(
                  f"K={e['k']} rows={e['rows']}: {e['seconds'] * 1e3:.2f} ms"
                  for e in a["cost_table"]) + "."]
  lines += ["", "Same prompts, same process, both loops compiled and warmed up first; the best "
            "of several passes; both stop at the end of a turn. On a CPU a decode step costs "
            "a fixed per-operation overhead plus arithmetic in proportion to the tokens it "
            "processes, so a speculative iteration (a 4-token verification and K MTP "
            "windows) costs several autoregressive steps and only the overhead is saved; "
            "prefill, the same for both loops, is a large share of a short turn. "
            "`experiments/bench_decode.py` splits that per-call cost off.", "",
            f"![speedup](plots/{os.path.basename(plots['speedup_by_batch'])})", "",
            ""]
  if s["sft"]["entropy"]:
    lines += ["## Policy entropy", "",
              "Per-token entropy of the SFT policy at temperature 1 over the tokens it samples "
              "on held-out prompts (autoregressive):", "",
              f"| task | mean (nats) | positions above {evaluation.ENTROPY_THRESHOLD} nats | "
              "positions |", "|---|---|---|---|"]
    lines += [f"| {t} | {v['mean']:.3f} | {v['above_threshold']:.1%} | {v['positions']} |"
              for t, v in s["sft"]["entropy"].items()]
    lines += ["", f"![entropy histogram](plots/{os.path.basename(plots['entropy_histogram'])})",
              ""]
  lines += ["## Acceptance against policy entropy", ""]
  for mode, f in s["entropy_fit"].items():
    lines.append(f"- {mode}: acceptance = {f['intercept']:.3f} {f['slope']:+.3f} x entropy "
                 f"(nats), r2 {f['r2']:.2f}, {f['points']} positions")
  lines += ["", "Depth-1 teacher-forced acceptance against the entropy of the target "
            "distribution, over held-out rollouts re-scored at several temperatures (higher "
            "temperature, higher entropy). The paper's finding is that acceptance falls with "
            "entropy, far more steeply for greedy drafts than for rejection sampling.", "",
            f"![acceptance vs entropy](plots/{os.path.basename(plots['acceptance_vs_entropy'])})",
            ""]
  if "rl" in s:
    lines += _rl_report(s["rl"], plots)
  compiles = s["timing"].get("compile", {})
  lines += ["## Time", "", "| stage | seconds (this invocation) | of them compiling | "
            "compilation cache hits |", "|---|---|---|---|"]
  for k, v in s["timing"].items():
    if k.endswith("_s"):
      c = compiles.get(k[:-2])
      lines.append(f"| {k[:-2]} | {v:.1f} | " + (f"{c['seconds']:.1f} | {c['cache_hits']} |"
                                                 if c else "| |"))
  return "\n".join(lines) + "\n"
