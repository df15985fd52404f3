r"""The generated blocks of README.md and docs/, rendered from committed artifacts only, and
the manifest that binds each of their numbers to its artifact and key (docs/numbers.json).

  python experiments/key_results.py --write     # rewrite the blocks and the manifest
  python experiments/key_results.py             # check them (exit 1 when stale)

README.md's numbers come from json files under docs/:
  docs/results/<finding>.json    written by `python experiments/reproduce.py --scale=laptop
                                 --workdir=runs/reproduce --results=docs/results.md`
  docs/artifacts/main_job.json   the main job's summary.json, copied by
                                 `python experiments/key_results.py --main_job=runs/quickstart`
                                 after `python -m bebop_jax.main --config=configs/quickstart.py
                                 --workdir=runs/quickstart`
  docs/artifacts/smollm2_main_job.json
                                 the real policy (SMOLLM2_COMMAND, copied by
                                 `--main_job=runs/smollm2 --as=smollm2_main_job.json`)
  docs/results_real/<finding>.json
                                 the findings on the real policy (REAL_REPRODUCE_COMMAND),
                                 summarized in docs/results.md's real_findings block
The blocks of other docs/ pages are rendered by experiments/doc_blocks/<page>.py. A block sits
between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->` lines; the text around the
blocks is written by hand and holds no measured number. Every printed number is cited
(experiments/doc_numbers.py): tests/test_doc_numbers.py recomputes each from its artifact
key at the printed precision.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

if __package__ in (None, ""):  # run as a script
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import doc_blocks, doc_numbers  # pylint: disable=g-import-not-at-top
from bebop_jax.stages import decode_timing  # pylint: disable=g-import-not-at-top
from experiments.doc_numbers import Block, Source  # pylint: disable=g-import-not-at-top

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
# One run of bench_decode.py under the protocol (stages/decode_timing: interleaved passes, a
# 95% interval over them), with the adaptive arm.
SMOLLM2_BENCH_COMMAND = (
    "python experiments/bench_decode.py --config=configs/smollm2.py --workdir=runs/smollm2 "
    "--policy=mtp --temperatures=1 --modes=rejection --draft_vocab=2048 --max_new_tokens=64 "
    "--batch_sizes=1,8,64 --num_prompts=128 --repeats=3 --split_fixed_cost=false --adaptive "
    "--out=runs/smollm2/bench_decode_128.json")  # copied to docs/artifacts/ (SMOLLM2_BENCH)
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
                  ) -> dict[str, Source]:
  return {name: Source(os.path.relpath(os.path.join(results_dir, f"{name}.json"), REPO))
          for name in names}


def load_main_job(path: str = MAIN_JOB) -> Source:
  return Source(os.path.relpath(path, REPO))


def _label(finding: Source) -> str:
  return finding["title"].value.split(":")[0]


def _ci(b: Block, ci: Source, fmt: str = "+.3f") -> str:
  return f"[{b.num(ci[0], fmt=fmt)}, {b.num(ci[1], fmt=fmt)}]"


# ----------------------------------------------------------------------------- the blocks


SMOLLM2_RL = os.path.join(REPO, "docs", "artifacts", "bench_rl_smollm2.json")


def claims_block(b: Block, findings: dict[str, Source],
                 real: dict[str, Source] | None = None, rl_bench: Source | None = None) -> str:
  """The paper's findings, each with the verdict, the number and its interval here: on the
  real policy first (its results page, and the RL benchmark's SmolLM2 sync arms for the
  speed claim, which has no finding there), then on the laptop testbed."""
  real = real or {}
  lines = ["| the paper | finding | real policy (SmolLM2-135M-Instruct) | laptop testbed |",
           "|---|---|---|---|"]
  for claim, names in CLAIMS:
    claim = claim.replace("1.8x", b.quote("1.8x", "the paper's abstract"))
    for i, name in enumerate(names):
      lab = findings[name]
      cell = lambda f: (f"**{f['verdict'].value}** ({f['rule']['label'].value} "
                        f"v{f['rule']['current'].value}): {SUMMARIES[name](b, f)}")
      if name in real:
        here = cell(real[name])
      elif name == "speedup" and rl_bench is not None:
        p = rl_bench["pairs"]["speculative_sync_vs_autoregressive_sync"]
        here = (f"no finding; the RL benchmark's sync arms: spec./AR "
                f"{b.num(p['measured'], fmt='.2f')}x {_ci(b, p['ci95'], '.2f')} per step "
                f"(95% t over {p['blocks'].value} blocks, docs/rl.md)")
      else:
        here = "not run"
      lines.append(f"| {claim if i == 0 else ''} | {_label(lab)} | {here} | {cell(lab)} |")
  n_real = sum(f["verdict"].value == "reproduced" for f in real.values())
  n_lap = sum(f["verdict"].value == "reproduced" for f in findings.values())
  lines += ["", f"{n_real} of {len(real)} findings reproduced on the real policy "
            f"([docs/results_real.md](docs/results_real.md)), {n_lap} of {len(findings)} on "
            f"the laptop testbed ([docs/results.md](docs/results.md)). Each verdict is that of "
            "the rule version named (`experiments/findings/rules.py`); each page gives every "
            "version's verdict on the same data and says whether it was written before or "
            "after them."]
  return "\n".join(lines)


def _f1(b: Block, f: Source) -> str:
  fits = f["data"]["fits"]
  parts = []
  for source, label in (("rl_steps", "RL steps"), ("rescoring", "re-scoring temperatures")):
    fit = fits[source]["depth1"]["rejection"]
    parts.append(f"{label}: {b.num(fit['slope'], fmt='+.3f')} per nat "
                 f"{_ci(b, fit['slope_ci95'])} over {b.num(fit['x_range'], fmt='.2f')} nats "
                 "of entropy")
  return "depth-1 acceptance against entropy, rejection sampling; " + "; ".join(parts)


def _f2(b: Block, f: Source) -> str:
  parts = []
  for r in f["data"]["ratios"]:
    if r["metric"].value != "depth1":
      continue
    label = "RL steps" if r["source"].value == "rl_steps" else "re-scoring"
    parts.append(f"{label} {b.num(r['gap_slope'], fmt='+.3f')} per nat "
                 f"[{b.num(r['gap_slope_ci95_low'], fmt='+.3f')}, "
                 f"{b.num(r['gap_slope_ci95_high'], fmt='+.3f')}]")
  return "slope of the gap greedy − rejection (depth 1): " + "; ".join(parts)


def _f3(b: Block, f: Source) -> str:
  d = f["data"]
  comp = d["comparison"]
  g = lambda c, loss: (f"{b.num(c['paired'][loss]['mean'], fmt='+.1%')} "
                       f"{_ci(b, c['paired'][loss]['ci95'], '+.1%')}")
  text = (f"acceptance over CE, paired by seed ({comp['seeds'].value} seeds, 95% t): e2e-TV "
          f"{g(comp, 'e2e_tv')}, per-step TV {g(comp, 'tv')}, KL {g(comp, 'kl')}")
  if d.get("scratch"):
    text += f"; from scratch e2e-TV {g(d['scratch'], 'e2e_tv')}, TV {g(d['scratch'], 'tv')}"
  return text


def _f4(b: Block, f: Source) -> str:
  d = f["data"]
  t, c = d["trends"]["frozen_e2e_tv"], d["control"]
  return (f"frozen e2e-TV drafter over {d['steps'].value} RL steps: acceptance change "
          f"{b.num(t['change'], fmt='+.3f')} {_ci(b, t['change_ci95'])}; minus the frozen CE "
          f"drafter's {b.num(c['change'], fmt='+.3f')} {_ci(b, c['change_ci95'])}; policy "
          f"entropy change {b.num(d['policy']['entropy_change'], fmt='+.3f')} nats")


def _speedup(b: Block, f: Source) -> str:
  d = f["data"]
  names = (("speculative_async_vs_autoregressive_async", "spec./AR async"),
           ("speculative_sync_vs_autoregressive_sync", "spec./AR sync"),
           ("speculative_async_vs_autoregressive_sync", "spec. async / AR sync"))
  parts = []
  for key, label in names:
    p = d["pairs"][key]
    ci = "" if p["ci95"].value is None else " " + _ci(b, p["ci95"], ".2f")
    parts.append(f"{label} {b.num(p['measured'], fmt='.2f')}x{ci}")
  place = d["placement"]
  where = (f"{place['devices'].value} {place['platform'].value} device(s), "
           f"{place['mode'].value}")
  return "per RL step, 95% t over blocks: " + ", ".join(parts) + f" ({where})"


SUMMARIES = {"acceptance_entropy": _f1, "greedy_vs_rejection": _f2, "objectives": _f3,
             "through_rl": _f4, "speedup": _speedup}


def findings_block(b: Block, findings: dict[str, Source]) -> str:
  """One row per finding: what was measured, the verdict, the rule version."""
  lines = ["| finding | measured here | verdict (rule) |", "|---|---|---|"]
  for name, f in findings.items():
    lines.append(f"| {f['title'].value} | {SUMMARIES[name](b, f)} | **{f['verdict'].value}** "
                 f"({f['rule']['label'].value} v{f['rule']['current'].value}) |")
  return "\n".join(lines)


def real_findings_block(b: Block, findings: dict[str, Source]) -> str:
  """docs/results.md's section on the real policy: the verdicts of its page, one row each."""
  reproduced = sum(f["verdict"].value == "reproduced" for f in findings.values())
  return "\n".join([f"{reproduced} of {len(findings)} findings reproduced on the real policy, "
                    f"by `{REAL_REPRODUCE_COMMAND}`:", "", findings_block(b, findings)])


def main_job_block(b: Block, s: Source) -> str:
  """The main job: held-out pass@1 before and after RL, the drafter, decode speed, time."""
  rl = s["rl"]
  lines = _pass_at_1_rows(b, rl)
  tpf = rl["tokens_per_target_forward_before"]["rejection"]
  tpf_after = rl["tokens_per_target_forward_after"]["rejection"]
  speed = s["decode"]["speedup_vs_autoregressive"]
  lines += ["", f"Its e2e-TV drafter earns {b.num(tpf, fmt='.2f')} tokens per target forward "
            f"before RL and {b.num(tpf_after, fmt='.2f')} after (rejection sampling, at most "
            "4); speculative against autoregressive decoding, wall clock: " +
            ", ".join(f"{b.num(speed[k], fmt='.2f')}x at batch {k}" for k in speed) +
            f". The job took {b.num(s['timing']['total_s'], fmt='.1f', op='minutes')} minutes "
            f"(summary.json `timing`)."]
  return "\n".join(lines)


def _pass_at_1_rows(b: Block, rl: Source) -> list[str]:
  """The pass@1 table of an RL stage summary: before, after and the paired difference."""
  tasks = list(rl["pass_at_1_before"])
  lines = ["| held-out pass@1 (T = 1) | " + " | ".join(tasks) + " |",
           "|---" * (1 + len(tasks)) + "|"]
  row = lambda label, cells: lines.append(f"| {label} | " + " | ".join(cells) + " |")
  pm = lambda v, se, fmt: f"{b.num(v, fmt=fmt)} ± {b.num(se, fmt='.3f')}"
  row("before RL", [pm(rl["pass_at_1_before"][t], rl["pass_at_1_se_before"][t], ".3f")
                    for t in tasks])
  row(f"after {rl['steps'].value} GRPO steps",
      [pm(rl["pass_at_1_after"][t], rl["pass_at_1_se_after"][t], ".3f") for t in tasks])
  row("paired difference", [pm(rl["pass_at_1_delta"][t]["delta"],
                               rl["pass_at_1_delta"][t]["se"], "+.3f") for t in tasks])
  return lines


def drafter_block(b: Block, mtp: Source) -> list[str]:
  """The MTP stage's drafter on held-out prompts of the policy it was trained for: online
  acceptance per depth (rejection sampling, reach-weighted: a depth's drafts counted when
  verified) with its draft events and Wilson 95% interval, and the teacher-forced rates
  (reach-weighted and unweighted) over the held-out rollouts."""
  schedule = " then ".join(f"{loss} to step {end}" for loss, end in mtp["schedule"].value)
  vocab = mtp.get("draft_vocab")
  head = (f"a reduced vocabulary of {vocab['size'].value} tokens, which covers "
          f"{b.num(vocab['coverage_heldout'], fmt='.2%')} of the held-out policy tokens"
          if vocab and vocab.get("size") else "the whole vocabulary")
  online, tf = mtp["online"]["rejection"], mtp["teacher_forced"]["rejection"]
  lines = [f"Its drafter (one MTP module, K = 3 drafts; {schedule}; drafting from {head}), "
           "on held-out prompts of the SFT policy (the MTP stage's evaluation, T = 1). Online "
           "acceptance counts a depth's drafts when they are verified, so it is the "
           "reach-weighted rate; the teacher-forced columns score every held-out position "
           "(the reach-weighted rate weights each by the chance of drafting that deep):", "",
           "| depth | online acceptance, rejection sampling [Wilson 95%] | drafts verified | "
           "teacher-forced, reach-weighted | teacher-forced, unweighted | positions |",
           "|---|---|---|---|---|---|"]
  for k in range(len(online["acceptance"])):
    lo, hi = online["interval"][k]
    lines.append(f"| {k + 1} | {b.num(online['acceptance'][k], fmt='.3f')} "
                 f"[{b.num(lo, fmt='.3f')}, {b.num(hi, fmt='.3f')}] | "
                 f"{b.num(online['attempted'][k], fmt='.0f')} | "
                 f"{b.num(tf['alpha'][k], fmt='.3f')} | "
                 f"{b.num(tf['alpha_unweighted'][k], fmt='.3f')} | "
                 f"{b.num(tf['positions'][k], fmt='.0f')} |")
  tpf = ", ".join(f"{mode} {b.num(ev['tokens_per_target_forward'], fmt='.2f')}"
                  for mode, ev in mtp["online"].items())
  return lines + ["", f"Tokens per target forward (at most 4): {tpf}."]


def real_policy_block(b: Block, s: Source, bench: Source | None) -> str:
  """The real policy: pass@1 before and after RL, its drafter, and wall clock by batch and
  temperature (speculative with rejection sampling against autoregressive decoding)."""
  rl = s["rl"]
  lines = _pass_at_1_rows(b, rl) + [""] + drafter_block(b, s["mtp"])
  tpf = rl["tokens_per_target_forward_before"]["rejection"]
  tpf_after = rl["tokens_per_target_forward_after"]["rejection"]
  lines += ["", f"Through RL (the drafter frozen) it earns {b.num(tpf, fmt='.2f')} tokens per "
            f"target forward before RL and {b.num(tpf_after, fmt='.2f')} after (the RL stage's "
            f"held-out evaluations, rejection sampling; `{SMOLLM2_COMMAND}`, its stages' times "
            "in docs/main_job.md)."]
  if bench is None:
    lines[-1] += (" Its wall clock against autoregressive decoding is measured by "
                  f"`{SMOLLM2_BENCH_COMMAND}` (the protocol of docs/decoding.md: interleaved "
                  "passes, a 95% interval over them); the job's own eval-stage timing, one pass "
                  "over 8 prompts (summary.json `decode.benchmark`), cannot resolve it and is "
                  "not shown.")
    return "\n".join(lines)
  lines[-1] += (" Speculative (rejection sampling) against autoregressive decoding, one "
                "process: the SFT policy with its trained drafter (the MTP stage's checkpoint), "
                "the arms' timed passes interleaved in alternating order, the ratio the "
                "geometric mean of the passes' ratios with its Student-t 95% interval over "
                f"passes, `{SMOLLM2_BENCH_COMMAND}` (its output is "
                f"`{os.path.relpath(SMOLLM2_BENCH, REPO)}`):")
  lines += ["", "| batch | T | draft length | prompts | passes | tokens per arm (all passes) "
            "| wall clock spec. / AR [95%] | tokens per target forward | acceptance per depth "
            "| protocol |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in bench["results"]:
    if r["mode"].value != "rejection":
      continue
    # An adaptive row's depths beyond the largest K it ran were never attempted: no rate.
    ran = [int(k) for k, n in (r.value.get("k_iterations") or {}).items() if n]
    deepest = max(ran) if ran else len(r["acceptance_online"])
    acc = ", ".join(b.num(a, fmt=".2f") if d < deepest else "- (K never reached it)"
                    for d, a in enumerate(r["acceptance_online"]))
    k = r.value.get("k", "3 (the drafter's)")
    short = decode_timing.MIN_TOKENS - min(r["ar_tokens"].value, r["spec_tokens"].value)
    protocol = ("met" if decode_timing.meets_protocol(r.value) else
                f"missed: under {decode_timing.MIN_TOKENS} tokens per arm" if short > 0 else
                "missed")
    lines.append(f"| {r['batch'].value} | {r['temperature'].value:g} | {k} | "
                 f"{b.num(r['prompts'], fmt='.0f')} | {r['repeats'].value} | "
                 f"{b.num(r['spec_tokens'], fmt='.0f')} | {b.num(r['speedup'], fmt='.2f')}x "
                 f"{_ci(b, r['speedup_ci95'], '.2f')} | "
                 f"{b.num(r['tokens_per_target_forward'], fmt='.2f')} | {acc} | {protocol} |")
  return "\n".join(lines)


def _block(fn, *args) -> tuple[str, list]:
  b = Block()
  return b.text(fn(b, *args))


def render_readme(results_dir: str = RESULTS_DIR, main_job: str = MAIN_JOB) -> dict:
  """README.md's blocks: {name: (text, citations)}."""
  findings = load_findings(results_dir)
  bench = load_main_job(SMOLLM2_BENCH) if os.path.exists(SMOLLM2_BENCH) else None
  real = (load_findings(REAL_RESULTS_DIR, REAL_FINDINGS)
          if all(os.path.exists(os.path.join(REAL_RESULTS_DIR, f"{n}.json"))
                 for n in REAL_FINDINGS) else {})
  rl_bench = load_main_job(SMOLLM2_RL) if os.path.exists(SMOLLM2_RL) else None
  return {"claims": _block(claims_block, findings, real, rl_bench),
          "findings": _block(findings_block, findings),
          "main_job": _block(main_job_block, load_main_job(main_job)),
          "real_policy": _block(real_policy_block, load_main_job(SMOLLM2_JOB), bench)}


def render_results_page() -> dict:
  """docs/results.md's generated blocks."""
  return {"real_findings": _block(real_findings_block,
                                  load_findings(REAL_RESULTS_DIR, REAL_FINDINGS))}


def render() -> dict[str, str]:
  """README.md's blocks, text only."""
  return {name: text for name, (text, _) in render_readme().items()}


# Every document with generated blocks, and its renderer (docs/ pages: experiments/doc_blocks).
DOCUMENTS = {"README.md": render_readme, "docs/results.md": render_results_page,
             **doc_blocks.renderers()}


# ----------------------------------------------------------------------------- the CLI


def _manifest_text(manifest: dict) -> str:
  """docs/numbers.json: one line per cited number."""
  lines = ["{"]
  for i, (doc, blocks) in enumerate(manifest.items()):
    lines.append(f" {json.dumps(doc)}: {{")
    for j, (name, cited) in enumerate(blocks.items()):
      lines.append(f"  {json.dumps(name)}: [")
      lines += [f"   {json.dumps(c, ensure_ascii=False)}" + ("," if k < len(cited) - 1 else "")
                for k, c in enumerate(cited)]
      lines.append("  ]" + ("," if j < len(blocks) - 1 else ""))
    lines.append(" }" + ("," if i < len(manifest) - 1 else ""))
  return "\n".join(lines + ["}"]) + "\n"


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
  texts, manifest = doc_numbers.render_all(DOCUMENTS)
  stale = 0
  for doc, blocks in texts.items():
    path = os.path.join(REPO, doc)
    with open(path) as f:
      text = f.read()
    if doc == "docs/results.md" and "<!-- generated:real_findings -->" not in text:
      # reproduce.py --scale=laptop rewrites the page whole: the section goes back at its end.
      text = (text.rstrip("\n") + "\n\n" + REAL_SECTION +
              "\n<!-- generated:real_findings -->\n<!-- /generated:real_findings -->\n")
    new = doc_numbers.with_blocks(text, blocks, doc)
    if "--write" in argv:
      with open(path, "w") as f:
        f.write(new)
      print(f"{doc}: generated blocks written")
    elif new != text:
      print(f"{doc}'s generated blocks are stale: python experiments/key_results.py --write")
      stale = 1
    else:
      print(f"{doc}'s generated blocks are current")
  manifest_text = _manifest_text(manifest)
  old = open(doc_numbers.MANIFEST).read() if os.path.exists(doc_numbers.MANIFEST) else None
  if "--write" in argv:
    with open(doc_numbers.MANIFEST, "w") as f:
      f.write(manifest_text)
    n = sum(len(c) for blocks in manifest.values() for c in blocks.values())
    print(f"{os.path.relpath(doc_numbers.MANIFEST, REPO)}: {n} cited numbers")
  elif old != manifest_text:
    print("docs/numbers.json is stale: python experiments/key_results.py --write")
    stale = 1
  return stale


if __name__ == "__main__":
  sys.exit(main(sys.argv))
