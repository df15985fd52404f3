"""docs/main_job.md's generated blocks: the main job on the quickstart config
(docs/artifacts/main_job.json), on the laptop config (docs/artifacts/main_job_laptop.json)
and on SmolLM2-135M-Instruct (docs/artifacts/smollm2_main_job.json), each its run's
summary.json. Every number is read from the artifact; the comparisons in words (faster or
slower, goal met or missed, how many standard errors) are computed from the same values."""

from __future__ import annotations

from experiments.doc_numbers import Block, Source

DOCUMENT = "docs/main_job.md"
QUICKSTART = "docs/artifacts/main_job.json"
LAPTOP = "docs/artifacts/main_job_laptop.json"
SMOLLM2 = "docs/artifacts/smollm2_main_job.json"
STAGES = ("sft", "mtp", "rl", "eval")

# The project's goals for the SmolLM2 drafter (held-out online acceptance per depth and tokens
# per target forward, rejection sampling). Not measurements: the page states them in prose,
# in inline code, and the smollm2_goal block says which the measured drafter meets.
SMOLLM2_GOAL_ACCEPTANCE = (0.80, 0.70, 0.60)
SMOLLM2_GOAL_TOKENS_PER_FORWARD = 2.6


# ----------------------------------------------------------------------------- helpers


def _depths(b: Block, values: Source | None, fmt: str = ".3f") -> str:
  if values is None or values.value is None:
    return "—"
  return " / ".join(b.num(v, fmt=fmt) for v in values)


def _num_or_dash(b: Block, node: Source | None, fmt: str) -> str:
  if node is None or node.value is None:
    return "—"
  return b.num(node, fmt=fmt)


def _sigma(b: Block, rl: Source, task: str) -> str:
  d = rl["pass_at_1_delta"][task]
  return b.num(d["delta"], d["se"], fmt=".1f", op="ratio")


def _beyond_two_se(rl: Source) -> tuple[list[str], list[str]]:
  """Tasks whose paired pass@1 difference is beyond two standard errors, and the others."""
  beyond, within = [], []
  for task in rl["pass_at_1_delta"]:
    d = rl["pass_at_1_delta"][task]
    (beyond if abs(d["delta"].value) > 2 * d["se"].value else within).append(task)
  return beyond, within


def _direction(speedup: float) -> str:
  return "faster" if speedup > 1 else ("as fast" if speedup == 1 else "slower")


def _pass_at_1_table(b: Block, rl: Source, prompts: str) -> list[str]:
  tasks = list(rl["pass_at_1_before"])
  lines = [f"| held-out pass@1 (T = 1, {prompts}) | " + " | ".join(tasks) + " |",
           "|---" * (1 + len(tasks)) + "|"]
  pm = lambda v, se, fmt: f"{b.num(v, fmt=fmt)} ± {b.num(se, fmt='.3f')}"
  rows = (("before RL", "pass_at_1_before", "pass_at_1_se_before"),
          (f"after {rl['steps'].value} GRPO steps", "pass_at_1_after", "pass_at_1_se_after"))
  for label, key, se in rows:
    lines.append(f"| {label} | " + " | ".join(pm(rl[key][t], rl[se][t], ".3f") for t in tasks)
                 + " |")
  lines.append("| paired difference | " + " | ".join(
      pm(rl["pass_at_1_delta"][t]["delta"], rl["pass_at_1_delta"][t]["se"], "+.3f")
      for t in tasks) + " |")
  return lines


def _significance(b: Block, rl: Source) -> str:
  """RL's paired differences in standard errors, and which are beyond two."""
  parts = ", ".join(f"{t} {_sigma(b, rl, t)}" for t in rl["pass_at_1_delta"])
  beyond, within = _beyond_two_se(rl)
  if not within:
    verdict = "every task's is beyond two"
  elif not beyond:
    verdict = "none is beyond two"
  else:
    verdict = f"{' and '.join(beyond)} beyond two, {' and '.join(within)} within"
  return (f"The paired differences in standard errors: {parts} ({verdict}; the same prompts "
          "and keys before and after).")


def _stage_table(b: Block, s: Source, notes: dict[str, str] | None = None) -> list[str]:
  """Seconds per stage, compile seconds and cache hits (summary.json `timing`)."""
  t, notes = s["timing"], notes or {}
  lines = ["| stage | seconds | of them compiling | compilation cache hits |",
           "|---|---|---|---|"]
  for stage in STAGES:
    c = t["compile"][stage]
    label = stage + (f" ({notes[stage]})" if stage in notes else "")
    lines.append(f"| {label} | {b.num(t[f'{stage}_s'], fmt='.0f')} | "
                 f"{b.num(c['seconds'], fmt='.0f')} | {c['cache_hits'].value} |")
  compile_total = b.num(*(t["compile"][st]["seconds"] for st in STAGES), fmt=".0f", op="sum")
  lines.append(f"| the job (`timing.total_s`) | {b.num(t['total_s'], fmt='.0f')} "
               f"({b.num(t['total_s'], fmt='.1f', op='minutes')} minutes) | "
               f"{compile_total} | |")
  return lines


def _rl_timing(b: Block, rl: Source) -> str:
  t = rl["timing"]
  return (f"{rl['steps'].value} steps in {b.num(t['step_s'], fmt='.0f')} s: rollouts "
          f"{b.num(t['rollout_s'], fmt='.0f')} s, policy updates "
          f"{b.num(t['learner_s'], fmt='.0f')} s, weight sync {b.num(t['sync_s'], fmt='.1f')} s")


def _speed_table(b: Block, rows: Source) -> list[str]:
  lines = ["| batch | mode | prompts | AR tok/s | spec tok/s | spec / AR | tok/fwd | online "
           "acceptance | teacher-forced at visited frontiers |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['batch'].value} | {r['mode'].value} | {b.num(r['prompts'], fmt='.0f')} | "
        f"{b.num(r['ar_tokens_per_s'], fmt='.1f')} | {b.num(r['spec_tokens_per_s'], fmt='.1f')} | "
        f"{b.num(r['speedup'], fmt='.2f')}x | {b.num(r['tokens_per_target_forward'], fmt='.2f')} | "
        f"{_depths(b, r['acceptance_online'], '.2f')} | "
        f"{_depths(b, r.get('acceptance_teacher_forced'), '.2f')} |")
  return lines


def _speed_verdict(rows: Source, mode: str = "rejection") -> str:
  """Speculative against autoregressive decoding in words, per batch size (one mode)."""
  by_word: dict[str, list[str]] = {}
  for r in rows:
    if r["mode"].value == mode:
      by_word.setdefault(_direction(r["speedup"].value), []).append(str(r["batch"].value))
  parts = [f"{word} at batch {batches[0]}" if len(batches) == 1 else
           f"{word} at batches {', '.join(batches[:-1])} and {batches[-1]}"
           for word, batches in by_word.items()]
  return (f"Against autoregressive decoding, speculative decoding ({mode}) ran " +
          " and ".join(parts))


def _entropy(b: Block, fit: Source) -> str:
  """Depth-1 teacher-forced acceptance against target entropy (summary.json `entropy_fit`)."""
  parts = []
  for mode in fit:
    f = fit[mode]
    parts.append(f"{mode} slope {b.num(f['slope'], fmt='+.3f')} per nat (intercept "
                 f"{b.num(f['intercept'], fmt='.3f')}, r² {b.num(f['r2'], fmt='.2f')})")
  modes = list(fit)
  text = (f"Depth-1 teacher-forced acceptance against the target's entropy, over "
          f"{b.num(fit[modes[0]]['points'], fmt=',.0f')} positions: " + "; ".join(parts) + ".")
  if {"rejection", "greedy_draft"} <= set(modes):
    g, r = fit["greedy_draft"]["slope"].value, fit["rejection"]["slope"].value
    if g < 0 and r < 0:
      text += (" Acceptance falls as entropy rises, more steeply with " +
               ("greedy drafts." if g < r else "rejection sampling."))
    else:
      text += " The fitted slopes do not both fall with entropy."
  return text


# ----------------------------------------------------------------------------- the blocks


def durations_block(b: Block) -> str:
  q, l, s = Source(QUICKSTART), Source(LAPTOP), Source(SMOLLM2)
  m = lambda src: b.num(src["timing"]["total_s"], fmt=".1f", op="minutes")
  return (f"The committed runs took, in `summary.json` `timing.total_s` on two CPU cores: the "
          f"quickstart {m(q)} minutes, the laptop run {m(l)} minutes, SmolLM2 {m(s)} minutes "
          "(the pip install of a fresh clone comes on top).")


def quickstart_time_block(b: Block) -> str:
  s = Source(QUICKSTART)
  notes = {"sft": f"{s['sft']['steps'].value} steps at "
                  f"{b.num(s['sft']['steady_step_time_s'], fmt='.2f')} s per steady-state step",
           "rl": _rl_timing(b, s["rl"])}
  return "\n".join(_stage_table(b, s, notes))


def quickstart_rl_block(b: Block) -> str:
  rl = Source(QUICKSTART)["rl"]
  return "\n".join(_pass_at_1_table(b, rl, "the same prompts and keys") +
                   ["", _significance(b, rl)])


def quickstart_drafter_block(b: Block) -> str:
  s = Source(QUICKSTART)
  mtp, rl, dec = s["mtp"], s["rl"], s["decode"]
  before = mtp["before"]
  lines = ["| rejection sampling, held out | online acceptance per depth | teacher-forced per "
           "depth | tokens per target forward |", "|---|---|---|---|",
           f"| MTP stage, before its {mtp['steps'].value} {mtp['loss'].value} steps | "
           f"{_depths(b, before['acceptance_online']['rejection'])} | "
           f"{_depths(b, before['acceptance_teacher_forced']['rejection'])} | "
           f"{b.num(before['tokens_per_target_forward']['rejection'], fmt='.2f')} |",
           f"| MTP stage, after | — | "
           f"{_depths(b, mtp['acceptance_teacher_forced_by_mode']['rejection'])} | — |",
           f"| RL stage, step 0 (before RL) | {_depths(b, rl['acceptance_before']['rejection'])}"
           f" | — | {b.num(rl['tokens_per_target_forward_before']['rejection'], fmt='.2f')} |",
           f"| RL stage, step {rl['steps'].value} (after RL) | "
           f"{_depths(b, rl['acceptance_after']['rejection'])} | "
           f"{_depths(b, dec['acceptance_teacher_forced']['rejection'])} | "
           f"{b.num(rl['tokens_per_target_forward_after']['rejection'], fmt='.2f')} |"]
  return "\n".join(lines)


def quickstart_speed_block(b: Block) -> str:
  rows = Source(QUICKSTART)["decode"]["benchmark"]
  return "\n".join(_speed_table(b, rows) + ["", _speed_verdict(rows) + " in this run."])


def quickstart_entropy_block(b: Block) -> str:
  return _entropy(b, Source(QUICKSTART)["entropy_fit"])


def laptop_rl_block(b: Block) -> str:
  s = Source(LAPTOP)
  rl = s["rl"]
  ent = [s["sft"]["entropy"][t]["mean"] for t in s["sft"]["entropy"]]
  tpf_b, tpf_a = rl["tokens_per_target_forward_before"], rl["tokens_per_target_forward_after"]
  lines = _pass_at_1_table(b, rl, "256 prompts per task") + [
      "", _significance(b, rl), "",
      "The frozen e2e-TV drafter's held-out online acceptance per depth (rejection sampling) "
      f"went from {_depths(b, rl['acceptance_before']['rejection'])} before RL to "
      f"{_depths(b, rl['acceptance_after']['rejection'])} after, its tokens per target "
      f"forward from {b.num(tpf_b['rejection'], fmt='.2f')} to "
      f"{b.num(tpf_a['rejection'], fmt='.2f')} (greedy drafts "
      f"{b.num(tpf_b['greedy_draft'], fmt='.2f')} to {b.num(tpf_a['greedy_draft'], fmt='.2f')}"
      "). The SFT policy's mean entropy at temperature 1 is "
      f"{b.num(*ent, fmt='.2f', op='min')}–{b.num(*ent, fmt='.2f', op='max')} nats per token "
      f"on the three tasks (`sft.entropy`). The stage ran {_rl_timing(b, rl)} (`rl.timing`)."]
  return "\n".join(lines)


def laptop_pass_before_block(b: Block) -> str:
  s = Source(LAPTOP)
  tasks = list(s["eval"]["accuracy"])
  lines = ["| pass@1, T = 1, 64 prompts per task | " + " | ".join(tasks) + " |",
           "|---" * (1 + len(tasks)) + "|",
           "| SFT stage, autoregressive (`sft.accuracy`) | " + " | ".join(
               b.num(s["sft"]["accuracy"][f"{t}/t1"], fmt=".3f") for t in tasks) + " |",
           "| MTP stage's policy, speculative (`eval.accuracy`) | " + " | ".join(
               b.num(s["eval"]["accuracy"][t], fmt=".3f") for t in tasks) + " |"]
  return "\n".join(lines)


def laptop_acceptance_block(b: Block) -> str:
  s = Source(LAPTOP)
  before, dec, mtp = s["mtp"]["before"], s["decode"], s["mtp"]
  lines = ["| mode | before: online | before: tok/fwd | after: online | after: teacher-forced "
           "| after: tok/fwd |", "|---|---|---|---|---|---|"]
  for mode in dec["acceptance_online"]:
    lines.append(
        f"| {mode} | {_depths(b, before['acceptance_online'][mode])} | "
        f"{b.num(before['tokens_per_target_forward'][mode], fmt='.2f')} | "
        f"{_depths(b, dec['acceptance_online'][mode])} | "
        f"{_depths(b, mtp['acceptance_teacher_forced_by_mode'][mode])} | "
        f"{b.num(dec['tokens_per_target_forward'][mode], fmt='.2f')} |")
  return "\n".join(lines)


def laptop_speed_block(b: Block) -> str:
  rows = Source(LAPTOP)["decode"]["benchmark"]
  tpf = [r["tokens_per_target_forward"] for r in rows]
  return "\n".join(_speed_table(b, rows) + [
      "", _speed_verdict(rows) + ", with "
      f"{b.num(*tpf, fmt='.2f', op='min')}–{b.num(*tpf, fmt='.2f', op='max')} of at most 4 "
      "tokens per target forward."])


def laptop_entropy_block(b: Block) -> str:
  return _entropy(b, Source(LAPTOP)["entropy_fit"])


def laptop_time_block(b: Block) -> str:
  s = Source(LAPTOP)
  notes = {"sft": f"{s['sft']['steps'].value} steps at "
                  f"{b.num(s['sft']['steady_step_time_s'], fmt='.2f')} s per steady-state step,"
                  " with compiling, evaluation and preparing the datasets",
           "rl": _rl_timing(b, s["rl"])}
  return "\n".join(_stage_table(b, s, notes))


def smollm2_stages_block(b: Block) -> str:
  s = Source(SMOLLM2)
  t, sft, mtp, rl = s["timing"], s["sft"], s["mtp"], s["rl"]
  acc = ", ".join(f"{k.split('/')[0]} {b.num(v, fmt='.3f')}"
                  for k, v in sft["accuracy"].items() if k.endswith("/t1"))
  ent = ", ".join(f"{k} {b.num(sft['entropy'][k]['mean'], fmt='.2f')}" for k in sft["entropy"])
  schedule = ", then ".join(f"{loss} to step {end}" for loss, end in mtp["schedule"].value)
  vocab = mtp.get("draft_vocab")
  vocab_text = (f" Its heads draft from the {vocab['size'].value} most frequent policy tokens, "
                f"which cover {b.num(vocab['coverage_train'], fmt='.2%')} of the training and "
                f"{b.num(vocab['coverage_heldout'], fmt='.2%')} of the held-out policy tokens."
                if vocab and vocab.get("size") else "")
  on = mtp["online"]["rejection"]
  intervals = ", ".join(f"[{b.num(lo, fmt='.3f')}, {b.num(hi, fmt='.3f')}]"
                        for lo, hi in on["interval"])
  tf = mtp["teacher_forced"]["rejection"]
  stage = lambda name: b.num(t[f"{name}_s"], fmt=".0f")
  bench = [r for r in s["decode"]["benchmark"] if r["mode"].value == "rejection"]
  speed = ", ".join(f"{b.num(r['speedup'], fmt='.2f')}x at batch {r['batch'].value}"
                    for r in bench)
  tokens = b.num(*(r["spec_tokens"] for r in bench), fmt=".0f", op="mean")
  lines = [
      f"The run took {b.num(t['total_s'], fmt='.1f', op='minutes')} minutes "
      "(`timing.total_s`); its stages:", "",
      f"1. **sft** ({stage('sft')} s): {sft['steps'].value} steps "
      f"({b.num(sft['steady_step_time_s'], fmt='.2f')} s per steady-state step). Held-out "
      f"pass@1 at T = 1: {acc}. The fine-tuned policy's mean entropy at T = 1 is {ent} nats "
      "per token (`sft.entropy`).",
      f"2. **mtp** ({stage('mtp')} s): a fresh MTP module trained {schedule} "
      f"({b.num(mtp['steady_step_time_s'], fmt='.2f')} s per steady-state step), the trunk "
      f"frozen.{vocab_text} Held-out teacher-forced acceptance per depth at its last step "
      f"(reach-weighted, rejection sampling): {_depths(b, tf['alpha'])}. Online, by "
      "speculative decoding of the held-out prompts (rejection sampling, T = 1): "
      f"{_depths(b, on['acceptance'])} over "
      f"{' / '.join(b.num(a, fmt='.0f') for a in on['attempted'])} verified drafts (Wilson "
      f"95% intervals {intervals}), {b.num(on['tokens_per_target_forward'], fmt='.2f')} "
      "tokens per target forward.",
      f"3. **rl** ({stage('rl')} s): GRPO on speculative rollouts (rejection sampling, "
      f"T = 1), the drafter frozen, {_rl_timing(b, rl)}, plus the "
      "held-out evaluations before and after (table below). Online acceptance per depth "
      f"(rejection sampling, held out) {_depths(b, rl['acceptance_before']['rejection'])} "
      f"before RL and {_depths(b, rl['acceptance_after']['rejection'])} after; tokens per "
      f"target forward {b.num(rl['tokens_per_target_forward_before']['rejection'], fmt='.2f')}"
      f" before, {b.num(rl['tokens_per_target_forward_after']['rejection'], fmt='.2f')} after.",
      f"4. **eval** ({stage('eval')} s): decode speed of the final policy, speculative "
      f"(rejection sampling) against autoregressive wall clock: {speed} "
      f"({b.num(bench[0]['prompts'], fmt='.0f')} prompts, one timed pass of about {tokens} "
      "tokens per arm, too few to resolve a few percent; all rows below); acceptance against "
      "entropy; `report.md`. " + _entropy(b, s["entropy_fit"])]
  return "\n".join(lines)


def smollm2_goal_block(b: Block) -> str:
  """The drafter against the project's goals, at each held-out measurement of it."""
  s = Source(SMOLLM2)
  mtp, rl = s["mtp"], s["rl"]
  rows = (("MTP stage (its held-out evaluation)", mtp["online"]["rejection"]["acceptance"],
           mtp["online"]["rejection"]["tokens_per_target_forward"]),
          ("RL stage, step 0 (before RL)", rl["acceptance_before"]["rejection"],
           rl["tokens_per_target_forward_before"]["rejection"]),
          (f"RL stage, step {rl['steps'].value} (after RL)", rl["acceptance_after"]["rejection"],
           rl["tokens_per_target_forward_after"]["rejection"]))
  lines = ["| online, rejection sampling, held out | acceptance per depth | tokens per target "
           "forward | goal |", "|---|---|---|---|"]
  for label, acc, tpf in rows:
    depths = [str(k + 1) for k, a in enumerate(acc)
              if k < len(SMOLLM2_GOAL_ACCEPTANCE) and a.value < SMOLLM2_GOAL_ACCEPTANCE[k]]
    missed = [("depth " if len(depths) == 1 else "depths ") + ", ".join(depths)] if depths else []
    if tpf.value < SMOLLM2_GOAL_TOKENS_PER_FORWARD:
      missed.append("tokens per target forward")
    verdict = "met" if not missed else "missed: " + "; ".join(missed)
    lines.append(f"| {label} | {_depths(b, acc)} | {b.num(tpf, fmt='.2f')} | {verdict} |")
  return "\n".join(lines)


def smollm2_pass_block(b: Block) -> str:
  rl = Source(SMOLLM2)["rl"]
  return "\n".join(_pass_at_1_table(b, rl, "64 prompts per task") + ["", _significance(b, rl)])


def render() -> dict[str, tuple[str, list]]:
  blocks = {"durations": durations_block, "quickstart_time": quickstart_time_block,
            "quickstart_rl": quickstart_rl_block, "quickstart_drafter": quickstart_drafter_block,
            "quickstart_speed": quickstart_speed_block,
            "quickstart_entropy": quickstart_entropy_block, "laptop_rl": laptop_rl_block,
            "laptop_pass_before": laptop_pass_before_block,
            "laptop_acceptance": laptop_acceptance_block, "laptop_speed": laptop_speed_block,
            "laptop_entropy": laptop_entropy_block, "laptop_time": laptop_time_block,
            "smollm2_stages": smollm2_stages_block, "smollm2_goal": smollm2_goal_block,
            "smollm2_pass": smollm2_pass_block}
  out = {}
  for name, fn in blocks.items():
    b = Block()
    out[name] = b.text(fn(b))
  return out
