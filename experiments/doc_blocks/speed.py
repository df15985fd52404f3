"""docs/speed.md's generated blocks: the learner step (docs/artifacts/bench_train.json and
bench_train_rl_packing.json, `experiments/bench_train.py`), the laptop main job's stage
times (docs/artifacts/main_job_laptop.json) and the cost of a speculative iteration
(docs/artifacts/profile_speculative.json, `experiments/profile_speculative.py`). Every number
is read from the artifact. FLOP/s and bytes are printed in e-notation (2.59e+11 FLOP/s)."""

from __future__ import annotations

from experiments.doc_blocks import main_job
from experiments.doc_numbers import Block, Source

DOCUMENT = "docs/speed.md"
BENCH_TRAIN = "docs/artifacts/bench_train.json"
RL_PACKING = "docs/artifacts/bench_train_rl_packing.json"
LAPTOP = "docs/artifacts/main_job_laptop.json"
PROFILE = "docs/artifacts/profile_speculative.json"
SMOLLM2_PROFILE = "docs/artifacts/smollm2_profile_speculative.json"
MATMUL_ROWS = "docs/artifacts/matmul_rows.json"


def learner_step_block(b: Block) -> str:
  src = Source(BENCH_TRAIN)
  res = src["results"]
  lines = ["| stage | path | step (s), median | min | model FLOP/s | of matmul | temp bytes |",
           "|---|---|---|---|---|---|---|"]
  labels = (("old", "dense reference"), ("new", "blockwise + remat"))
  for stage in ("sft", "mtp"):
    r = res[stage]
    for key, label in labels:
      p = r[key]
      lines.append(f"| {stage} | {label} | {b.num(p['step_s_median'], fmt='.3f')} | "
                   f"{b.num(p['step_s_min'], fmt='.3f')} | "
                   f"{b.num(p['model_flops_per_s'], fmt='.2e')} | "
                   f"{b.num(p['flops_utilization'], fmt='.1%')} | "
                   f"{b.num(p['temp_bytes'], fmt='.2e')} |")
    lines.append(f"| {stage} | reference / blockwise | {b.num(r['speedup'], fmt='.2f')}x | "
                 f"{b.num(r['speedup_of_min'], fmt='.2f')}x | | | "
                 f"{b.num(r['temp_memory_ratio'], fmt='.3f')} of the reference |")
  lines += ["", f"The matmul calibration of this run (`matmul_flops_per_s`, the \"of matmul\" "
            f"denominator): {b.num(src['matmul_flops_per_s'], fmt='.2e')} FLOP/s. The SFT step "
            f"keeps {b.num(res['sft']['temp_memory_ratio'], fmt='.0%')} of the reference's "
            f"temporary memory, the MTP step {b.num(res['mtp']['temp_memory_ratio'], fmt='.0%')}."]
  return "\n".join(lines)


def rl_learner_block(b: Block) -> str:
  runs = (("default baseline (`bench_train.json`)", Source(BENCH_TRAIN),
           "a row per rollout, dense reference"),
          ("`--baseline=` (`bench_train_rl_packing.json`)", Source(RL_PACKING),
           "a row per rollout, blockwise + remat"))
  lines = ["| run | path | update call (s), median | min | positions filled | temp bytes |",
           "|---|---|---|---|---|---|"]
  diffs = []
  for label, src, baseline in runs:
    r = src["results"]["rl"]
    for i, (key, path) in enumerate((("old", baseline), ("new", "packed, blockwise + remat"))):
      p = r[key]
      lines.append(f"| {label if i == 0 else ''} | {path} | "
                   f"{b.num(p['step_s_median'], fmt='.3f')} | {b.num(p['step_s_min'], fmt='.3f')}"
                   f" | {b.num(p['fill'], fmt='.0%')} | {b.num(p['temp_bytes'], fmt='.2e')} |")
    lines.append(f"| | unpacked / packed | {b.num(r['speedup'], fmt='.2f')}x | "
                 f"{b.num(r['speedup_of_min'], fmt='.2f')}x | | "
                 f"{b.num(r['temp_memory_ratio'], fmt='.3f')} of the unpacked |")
    diffs.append(b.num(r["first_loss_abs_diff"], fmt=".1e"))
  lines += ["", f"The two paths' first losses agree to {diffs[0]} in the first run and "
            f"{diffs[1]} in the second (`first_loss_abs_diff`, float32)."]
  return "\n".join(lines)


def main_job_time_block(b: Block) -> str:
  s = Source(LAPTOP)
  rl = s["rl"]
  notes = {
      "sft": f"{s['sft']['steps'].value} steps at "
             f"{b.num(s['sft']['steady_step_time_s'], fmt='.2f')} s per steady-state step, "
             "with dataset preparation",
      "rl": f"{rl['steps'].value} steps in {b.num(rl['timing']['step_s'], fmt='.0f')} s: "
            f"rollouts {b.num(rl['timing']['rollout_s'], fmt='.0f')} s, policy updates "
            f"{b.num(rl['timing']['learner_s'], fmt='.0f')} s"}
  lines = [f"The matmul calibration of that run (`sft.matmul_flops_per_s`) was "
           f"{b.num(s['sft']['matmul_flops_per_s'], fmt='.2e')} FLOP/s.", "",
           *main_job._stage_table(b, s, notes)]
  return "\n".join(lines)


def iteration_block(b: Block, path: str = PROFILE) -> str:
  src = Source(path)
  loops, parts, steps = src["loops"], src["parts"], src["parts_in_ar_steps"]
  vocab = src.get("draft_vocab")
  drafts = ("" if vocab is None or vocab.value is None
            else f", from a reduced vocabulary of {vocab.value} tokens")
  lines = [
      f"The policy: {src['model'].value} (the artifact's `model`); prompts padded to "
      f"{src['prompt_len'].value} tokens, generations of at most {src['max_new_tokens'].value} "
      "tokens; seconds per step or per call:", "",
      "| measurement | seconds | autoregressive steps |", "|---|---|---|",
      f"| an autoregressive step, in the loop | {b.num(loops['ar_step_s'], fmt='.6f')} | 1 |",
      f"| the iteration, in the loop | {b.num(loops['iteration_s'], fmt='.6f')} | "
      f"{b.num(loops['iteration_in_ar_steps'], fmt='.2f')} |",
      f"| verify forward over K + 1 = 4 tokens | {b.num(parts['verify_forward_s'], fmt='.6f')} | "
      f"{b.num(steps['verify_forward_in_ar_steps'], fmt='.2f')} |",
      f"| the K = 3 draft depths over their windows, with sampling{drafts} | "
      f"{b.num(parts['drafts_s'], fmt='.6f')} | {b.num(steps['drafts_in_ar_steps'], fmt='.2f')} |",
      f"| the rest (verification, commit, gathers, scatters) | | "
      f"{b.num(src['rest_of_iteration_in_ar_steps'], fmt='.2f')} |",
      f"| prefill of the prompt bucket ({src['prompt_len'].value} tokens), per call | "
      f"{b.num(parts['prefill_s'], fmt='.6f')} | "
      f"{b.num(steps['prefill_in_ar_steps'], fmt='.2f')} |",
      *([f"| one sample over the whole vocabulary: `sampling.sample` (inverse CDF) | "
         f"{b.num(parts['sample_s'], fmt='.6f')} | "
         f"{b.num(steps['sample_in_ar_steps'], fmt='.3f')} |",
         f"| the same by Gumbel-max (`jax.random.categorical`) | "
         f"{b.num(parts['sample_gumbel_max_s'], fmt='.6f')} | "
         f"{b.num(steps['sample_gumbel_max_in_ar_steps'], fmt='.3f')} |"]
        if "sample_s" in parts else []),
      "",
      f"With {b.num(loops['tokens_per_target_forward'], fmt='.2f')} tokens per target forward, "
      f"the decoding phase runs at {b.num(loops['decode_phase_ratio'], fmt='.2f')}x the "
      f"autoregressive loop and the whole call at {b.num(loops['end_to_end_ratio'], fmt='.2f')}x,"
      f" since the per-call fixed cost is {b.num(loops['fixed_share_of_ar'], fmt='.0%')} of the "
      "autoregressive time."]
  return "\n".join(lines)


def matmul_rows_block(b: Block, path: str = MATMUL_ROWS) -> str:
  """What a product of a few rows costs on XLA:CPU (experiments/bench_matmul_rows.py)."""
  src = Source(path)
  per = src["seconds_per_pass"]
  rows = sorted(per.value, key=int)
  one = per[rows[0]]["x_at_w"]
  names = {"x_at_w": "x @ w (the model)", "rows": "one row at a time",
           "out_major_arg": "w held [out, in], passed so", "out_major_jit":
           "w transposed inside the call"}
  lines = [f"{src['layers'].value} SwiGLU-shaped pairs ({src['d_model'].value} -> "
           f"{src['mlp_dim'].value} -> {src['d_model'].value}, float32, "
           f"{b.num(src['weight_mb'], fmt='.0f')} MB of weights) in a jitted loop; "
           "seconds per pass, and (in parentheses) in passes of one row by x @ w:", "",
           "| rows | " + " | ".join(names.values()) + " |",
           "|---" * (len(names) + 1) + "|"]
  for r in rows:
    cells = [f"{b.num(per[r][k], fmt='.4f')} s ({b.num(per[r][k], one, fmt='.2f', op='ratio')})"
             for k in names]
    lines.append(f"| {r} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def render() -> dict[str, tuple[str, list]]:
  blocks = {"learner_step": learner_step_block, "rl_learner": rl_learner_block,
            "main_job_time": main_job_time_block, "iteration": iteration_block,
            "iteration_smollm2": lambda b: iteration_block(b, SMOLLM2_PROFILE),
            "matmul_rows": matmul_rows_block}
  out = {}
  for name, fn in blocks.items():
    b = Block()
    out[name] = b.text(fn(b))
  return out
