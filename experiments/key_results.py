r"""The README's key results (and docs/results.md's real-policy section), rendered from
committed artifacts only.

  python experiments/key_results.py --write     # rewrite README.md's generated blocks
  python experiments/key_results.py             # check them (exit 1 when stale)

Every number in the README's generated blocks comes from a json file under docs/:
  docs/results/<finding>.json    written by `python experiments/reproduce.py --scale=laptop
                                 --workdir=runs/reproduce --results=docs/results.md`
  docs/artifacts/main_job.json   the main job's summary.json, copied by
                                 `python experiments/key_results.py --main_job=runs/quickstart`
                                 after `python -m bebop_jax.main --config=configs/quickstart.py
                                 --workdir=runs/quickstart`
  docs/artifacts/smollm2_main_job.json, docs/artifacts/smollm2_bench_decode.json
                                 the real policy (SMOLLM2_COMMAND, copied by
                                 `--main_job=runs/smollm2 --as=smollm2_main_job.json`, and
                                 SMOLLM2_BENCH_COMMAND)
  docs/results_real/<finding>.json
                                 the findings on the real policy (REAL_REPRODUCE_COMMAND),
                                 summarized in docs/results.md's real_findings block
A block sits between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->` lines; the
text around the blocks is written by hand. tests/test_readme.py checks that the README's
blocks are what this script renders, and that every number in them is a number of the
artifacts at the printed precision.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "docs", "results")
MAIN_JOB = os.path.join(REPO, "docs", "artifacts", "main_job.json")
README = os.path.join(REPO, "README.md")
FINDINGS = ("acceptance_entropy", "greedy_vs_rejection", "objectives", "through_rl",
            "speedup")
REPRODUCE_COMMAND = ("python experiments/reproduce.py --scale=laptop --workdir=runs/reproduce "
                     "--results=docs/results.md")
SMOLLM2_JOB = os.path.join(REPO, "docs", "artifacts", "smollm2_main_job.json")
SMOLLM2_BENCH = os.path.join(REPO, "docs", "artifacts", "smollm2_bench_decode.json")
SMOLLM2_COMMAND = ("python -m bebop_jax.main --config=configs/smollm2.py "
                   "--workdir=runs/smollm2")
# Two runs of bench_decode.py (batch 1 and 8 over 16 prompts, batch 64 over 64), their
# result rows joined in SMOLLM2_BENCH by `--join_bench=A.json,B.json`.
SMOLLM2_BENCH_COMMAND = (
    "python experiments/bench_decode.py --config=configs/smollm2.py --workdir=runs/smollm2 "
    "--temperatures=1,0.7 --modes=rejection --max_new_tokens=64 --repeats=1 "
    "--batch_sizes=1,8 --num_prompts=16 (and --batch_sizes=64 --num_prompts=64)")
# The findings on the real policy: their own page, summarized in a section of docs/results.md.
RESULTS_PAGE = os.path.join(REPO, "docs", "results.md")
REAL_RESULTS_DIR = os.path.join(REPO, "docs", "results_real")
REAL_FINDINGS = ("acceptance_entropy", "greedy_vs_rejection", "objectives", "through_rl")
REAL_REPRODUCE_COMMAND = (
    "python experiments/reproduce.py --scale=real --workdir=runs/reproduce_real "
    "--results=docs/results_real.md --only=objectives,through_rl,acceptance_entropy")
REAL_SECTION = """## The real policy: SmolLM2-135M-Instruct

The same findings on a real pretrained model, SmolLM2-135M-Instruct (`configs/smollm2.py`:
SFT on math and code in its chat format, drafters from a copy of its last block), at the
`real` scale (docs/reproduce.md: 2 seeds per MTP loss, short drafter and RL runs sized for
two CPU cores). Every table, figure and rule is on its own page,
[results_real.md](results_real.md); this section is rendered from its data
(`docs/results_real/*.json`) by `python experiments/key_results.py --write`.
"""
MAIN_JOB_COMMAND = ("python -m bebop_jax.main --config=configs/quickstart.py "
                    "--workdir=runs/quickstart")
# The paper's findings as the paper states them, with the findings here that test each.
CLAIMS = (
    ("Acceptance falls linearly as policy entropy rises during RL, and far more with greedy "
     "drafts than with probabilistic rejection-sampling verification.",
     ("acceptance_entropy", "greedy_vs_rejection")),
    ("The MTP drafter should be trained with per-step TV or, best, the end-to-end TV loss "
     "(the expected multi-step accepted length), not with cross-entropy or KL.",
     ("objectives",)),
    ("MTP trained before RL with e2e-TV keeps its acceptance through RL without online "
     "updates, and async GRPO-style RL with MTP rollouts runs up to 1.8x faster end to end.",
     ("through_rl", "speedup")),
)


def load_findings(results_dir: str = RESULTS_DIR, names: tuple[str, ...] = FINDINGS
                  ) -> dict[str, dict]:
  out = {}
  for name in names:
    with open(os.path.join(results_dir, f"{name}.json")) as f:
      out[name] = json.load(f)
  return out


def load_main_job(path: str = MAIN_JOB) -> dict:
  with open(path) as f:
    return json.load(f)


def _label(finding: dict) -> str:
  return finding["title"].split(":")[0]


def _ci(ci, fmt: str = "+.3f") -> str:
  return f"[{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


# ----------------------------------------------------------------------------- the blocks


def claims_block(findings: dict[str, dict]) -> str:
  """The paper's findings, each with the verdicts here."""
  lines = []
  for i, (claim, names) in enumerate(CLAIMS, start=1):
    verdicts = "; ".join(f"{_label(findings[n])} **{findings[n]['verdict']}**" for n in names)
    lines.append(f"{i}. *The paper:* {claim} *Here:* {verdicts}.")
  reproduced = sum(f["verdict"] == "reproduced" for f in findings.values())
  lines += ["", f"{reproduced} of {len(findings)} findings reproduced at laptop scale "
            f"([docs/results.md](docs/results.md))."]
  return "\n".join(lines)


def _f1(f: dict) -> str:
  fits = f["data"]["fits"]
  parts = []
  for source, label in (("rl_steps", "RL steps"), ("rescoring", "re-scoring temperatures")):
    fit = fits[source]["depth1"]["rejection"]
    parts.append(f"{label}: {fit['slope']:+.3f} per nat {_ci(fit['slope_ci95'])} over "
                 f"{fit['x_range']:.2f} nats of entropy")
  return "depth-1 acceptance against entropy, rejection sampling; " + "; ".join(parts)


def _f2(f: dict) -> str:
  parts = []
  for r in f["data"]["ratios"]:
    if r["metric"] != "depth1":
      continue
    label = "RL steps" if r["source"] == "rl_steps" else "re-scoring"
    parts.append(f"{label} {r['gap_slope']:+.3f} per nat "
                 f"{_ci([r['gap_slope_ci95_low'], r['gap_slope_ci95_high']])}")
  return "slope of the gap greedy − rejection (depth 1): " + "; ".join(parts)


def _f3(f: dict) -> str:
  d = f["data"]
  comp = d["comparison"]
  g = lambda c, loss: (f"{c['paired'][loss]['mean']:+.1%} "
                       f"{_ci(c['paired'][loss]['ci95'], '+.1%')}")
  text = (f"acceptance over CE, paired by seed ({comp['seeds']} seeds, 95% t): e2e-TV "
          f"{g(comp, 'e2e_tv')}, per-step TV {g(comp, 'tv')}, KL {g(comp, 'kl')}")
  if d.get("scratch"):
    text += f"; from scratch e2e-TV {g(d['scratch'], 'e2e_tv')}, TV {g(d['scratch'], 'tv')}"
  return text


def _f4(f: dict) -> str:
  d = f["data"]
  t, c = d["trends"]["frozen_e2e_tv"], d["control"]
  return (f"frozen e2e-TV drafter over {d['steps']} RL steps: acceptance change "
          f"{t['change']:+.3f} {_ci(t['change_ci95'])}; minus the frozen CE drafter's "
          f"{c['change']:+.3f} {_ci(c['change_ci95'])}; policy entropy change "
          f"{d['policy']['entropy_change']:+.3f} nats")


def _speedup(f: dict) -> str:
  d = f["data"]
  names = (("speculative_async_vs_autoregressive_async", "spec./AR async"),
           ("speculative_sync_vs_autoregressive_sync", "spec./AR sync"),
           ("speculative_async_vs_autoregressive_sync", "spec. async / AR sync"))
  parts = []
  for key, label in names:
    p = d["pairs"][key]
    ci = "" if p["ci95"] is None else " " + _ci(p["ci95"], ".2f")
    parts.append(f"{label} {p['measured']:.2f}x{ci}")
  place = d["placement"]
  where = (f"{place['devices']} {place['platform']} device(s), {place['mode']}")
  return "per RL step, 95% t over blocks: " + ", ".join(parts) + f" ({where})"


SUMMARIES = {"acceptance_entropy": _f1, "greedy_vs_rejection": _f2, "objectives": _f3,
             "through_rl": _f4, "speedup": _speedup}


def findings_block(findings: dict[str, dict]) -> str:
  """One row per finding: what was measured, the verdict, the rule version."""
  lines = ["| finding | measured here | verdict (rule) |", "|---|---|---|"]
  for name in findings:
    f = findings[name]
    lines.append(f"| {f['title']} | {SUMMARIES[name](f)} | **{f['verdict']}** "
                 f"({f['rule']['label']} v{f['rule']['current']}) |")
  return "\n".join(lines)


def real_findings_block(findings: dict[str, dict]) -> str:
  """docs/results.md's section on the real policy: the verdicts of its page, one row each."""
  reproduced = sum(f["verdict"] == "reproduced" for f in findings.values())
  return "\n".join([f"{reproduced} of {len(findings)} findings reproduced on the real policy, "
                    f"by `{REAL_REPRODUCE_COMMAND}`:", "", findings_block(findings)])


def main_job_block(s: dict) -> str:
  """The main job: held-out pass@1 before and after RL, the drafter, decode speed, time."""
  rl = s["rl"]
  lines = _pass_at_1_rows(rl)
  tpf = rl["tokens_per_target_forward_before"]["rejection"]
  tpf_after = rl["tokens_per_target_forward_after"]["rejection"]
  speed = s["decode"]["speedup_vs_autoregressive"]
  lines += ["", f"Its e2e-TV drafter earns {tpf:.2f} tokens per target forward before RL and "
            f"{tpf_after:.2f} after (rejection sampling, at most 4); speculative against "
            f"autoregressive decoding, wall clock: " +
            ", ".join(f"{v:.2f}x at batch {b}" for b, v in speed.items()) +
            f". The job took {s['timing']['total_s'] / 60:.1f} minutes "
            f"(summary.json `timing`)."]
  return "\n".join(lines)


def _pass_at_1_rows(rl: dict) -> list[str]:
  """The pass@1 table of an RL stage summary: before, after and the paired difference."""
  tasks = list(rl["pass_at_1_before"])
  lines = ["| held-out pass@1 (T = 1) | " + " | ".join(tasks) + " |",
           "|---" * (1 + len(tasks)) + "|"]
  row = lambda label, cells: lines.append(f"| {label} | " + " | ".join(cells) + " |")
  row("before RL", [f"{rl['pass_at_1_before'][t]:.3f} ± {rl['pass_at_1_se_before'][t]:.3f}"
                    for t in tasks])
  row(f"after {rl['steps']} GRPO steps",
      [f"{rl['pass_at_1_after'][t]:.3f} ± {rl['pass_at_1_se_after'][t]:.3f}" for t in tasks])
  row("paired difference", [f"{rl['pass_at_1_delta'][t]['delta']:+.3f} ± "
                            f"{rl['pass_at_1_delta'][t]['se']:.3f}" for t in tasks])
  return lines


def drafter_block(mtp: dict) -> list[str]:
  """The MTP stage's drafter on held-out prompts of the policy it was trained for: online
  acceptance per depth (rejection sampling, reach-weighted: a depth's drafts counted when
  verified) with its draft events and Wilson 95% interval, and the teacher-forced rates
  (reach-weighted and unweighted) over the held-out rollouts."""
  schedule = " then ".join(f"{loss} to step {end}" for loss, end in mtp["schedule"])
  vocab = mtp.get("draft_vocab") or {}
  head = (f"a reduced vocabulary of {vocab['size']} tokens, which covers "
          f"{vocab['coverage_heldout']:.2%} of the held-out policy tokens"
          if vocab.get("size") else "the whole vocabulary")
  online, tf = mtp["online"]["rejection"], mtp["teacher_forced"]["rejection"]
  lines = [f"Its drafter (one MTP module, K = 3 drafts; {schedule}; drafting from {head}), "
           "on held-out prompts of the SFT policy (the MTP stage's evaluation, T = 1). Online "
           "acceptance counts a depth's drafts when they are verified, so it is the "
           "reach-weighted rate; the teacher-forced columns score every held-out position "
           "(the reach-weighted rate weights each by the chance of drafting that deep):", "",
           "| depth | online acceptance, rejection sampling [Wilson 95%] | drafts verified | "
           "teacher-forced, reach-weighted | teacher-forced, unweighted | positions |",
           "|---|---|---|---|---|---|"]
  for k, (a, n, (lo, hi)) in enumerate(zip(online["acceptance"], online["attempted"],
                                          online["interval"]), 1):
    lines.append(f"| {k} | {a:.3f} [{lo:.3f}, {hi:.3f}] | {n} | {tf['alpha'][k - 1]:.3f} | "
                 f"{tf['alpha_unweighted'][k - 1]:.3f} | {int(tf['positions'][k - 1])} |")
  tpf = ", ".join(f"{mode} {ev['tokens_per_target_forward']:.2f}"
                  for mode, ev in mtp["online"].items())
  return lines + ["", f"Tokens per target forward (at most 4): {tpf}."]


def real_policy_block(s: dict, bench: dict | None) -> str:
  """The real policy: pass@1 before and after RL, its drafter, and wall clock by batch and
  temperature (speculative with rejection sampling against autoregressive decoding)."""
  rl = s["rl"]
  lines = _pass_at_1_rows(rl) + [""] + drafter_block(s["mtp"])
  tpf = rl["tokens_per_target_forward_before"]["rejection"]
  tpf_after = rl["tokens_per_target_forward_after"]["rejection"]
  lines += ["", f"Through RL (the drafter frozen) it earns {tpf:.2f} tokens per target forward "
            f"before RL and {tpf_after:.2f} after (the RL stage's held-out evaluations, "
            f"rejection sampling; `{SMOLLM2_COMMAND}`, its stages' times in docs/main_job.md). "
            "Speculative "
            "(rejection sampling) against autoregressive decoding, one process: " + (
                "the SFT policy with its trained drafter (the MTP stage's checkpoint), "
                f"`{SMOLLM2_BENCH_COMMAND}`:" if bench else
                "the job's eval stage, on the RL stage's final policy with its drafter, one "
                "timed pass per arm (summary.json `decode.benchmark`; too few tokens to resolve "
                "a few percent):"), "",
            "| batch | T | prompts | tokens per arm | wall clock spec. / AR | tokens per "
            "target forward | acceptance per depth |", "|---|---|---|---|---|---|---|"]
  for r in (bench or s["decode"])["results" if bench else "benchmark"]:
    if r["mode"] != "rejection":
      continue
    acc = ", ".join(f"{a:.2f}" for a in r["acceptance_online"])
    lines.append(f"| {r['batch']} | {r['temperature']:g} | {r['prompts']} | "
                 f"{r['spec_tokens']} | {r['speedup']:.2f}x | "
                 f"{r['tokens_per_target_forward']:.2f} | {acc} |")
  return "\n".join(lines)


def render(results_dir: str = RESULTS_DIR, main_job: str = MAIN_JOB) -> dict[str, str]:
  findings = load_findings(results_dir)
  return {"claims": claims_block(findings), "findings": findings_block(findings),
          "main_job": main_job_block(load_main_job(main_job)),
          "real_policy": real_policy_block(
              load_main_job(SMOLLM2_JOB),
              load_main_job(SMOLLM2_BENCH) if os.path.exists(SMOLLM2_BENCH) else None)}


def render_results_page() -> dict[str, str]:
  """docs/results.md's generated blocks."""
  return {"real_findings": real_findings_block(load_findings(REAL_RESULTS_DIR, REAL_FINDINGS))}


# ----------------------------------------------------------------------------- README


def _pattern(name: str) -> re.Pattern:
  return re.compile(rf"(<!-- generated:{name} -->\n)(?:(.*?)\n)?(<!-- /generated:{name} -->)",
                    re.S)


def blocks_of(text: str) -> dict[str, str]:
  """{name: the block's text} of every generated block in `text`."""
  return {m.group(1): m.group(2) or "" for m in re.finditer(
      r"<!-- generated:(\w+) -->\n(?:(.*?)\n)?<!-- /generated:\1 -->", text, re.S)}


def with_blocks(text: str, blocks: dict[str, str], what: str = "README.md") -> str:
  for name, body in blocks.items():
    pattern = _pattern(name)
    if not pattern.search(text):
      raise ValueError(f"{what} has no <!-- generated:{name} --> block")
    text = pattern.sub(
        lambda m, body=body: m.group(1) + (body + "\n" if body else "") + m.group(3), text)
  return text


def main(argv: list[str]) -> int:
  if len(argv) > 1 and argv[1].startswith("--join_bench="):
    parts = [json.load(open(p)) for p in argv[1].split("=", 1)[1].split(",")]
    joined = {**parts[0], "results": [r for p in parts for r in p["results"]]}
    with open(SMOLLM2_BENCH, "w") as f:
      json.dump(joined, f, indent=1)
    print(f"joined {len(joined['results'])} rows into {os.path.relpath(SMOLLM2_BENCH, REPO)}")
    return 0
  if len(argv) > 1 and argv[1].startswith("--main_job="):
    workdir = argv[1].split("=", 1)[1]
    target = MAIN_JOB
    if len(argv) > 2 and argv[2].startswith("--as="):
      target = os.path.join(os.path.dirname(MAIN_JOB), argv[2].split("=", 1)[1])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(os.path.join(workdir, "summary.json"), target)
    print(f"copied {workdir}/summary.json to {os.path.relpath(target, REPO)}")
    return 0
  stale = 0
  for path, blocks in ((README, render()), (RESULTS_PAGE, render_results_page())):
    name = os.path.relpath(path, REPO)
    with open(path) as f:
      text = f.read()
    if path == RESULTS_PAGE and "<!-- generated:real_findings -->" not in text:
      # reproduce.py --scale=laptop rewrites the page whole: the section goes back at its end.
      text = (text.rstrip("\n") + "\n\n" + REAL_SECTION +
              "\n<!-- generated:real_findings -->\n<!-- /generated:real_findings -->\n")
    new = with_blocks(text, blocks, name)
    if "--write" in argv:
      with open(path, "w") as f:
        f.write(new)
      print(f"{name}: generated blocks written")
    elif new != text:
      print(f"{name}'s generated blocks are stale: python experiments/key_results.py --write")
      stale = 1
    else:
      print(f"{name}'s generated blocks are current")
  return stale


if __name__ == "__main__":
  sys.exit(main(sys.argv))
