"""docs/mtp.md's generated blocks: the drafter recipe's measurements on SmolLM2-135M-Instruct.

  sft_drafter         the MTP stage of the SmolLM2 main job (docs/artifacts/smollm2_main_job.json,
                      `mtp` and `timing.mtp_s`), against the project's goals for that drafter
  learning_curve      each objective from a fresh drafter and after KL steps
                      (docs/artifacts/smollm2_drafter_curve.json)
  drafter_init        where the drafter starts
                      (docs/artifacts/smollm2_drafter_init_{fresh,copy_last_block,identity}.json)
  pretrained_drafter  a drafter for the pretrained policy alone, at two budgets
                      (docs/artifacts/smollm2_pretrained_drafter{_small,}.json)
"""
from __future__ import annotations

from experiments.doc_numbers import Block, Source

DOCUMENT = "docs/mtp.md"

MAIN_JOB = "docs/artifacts/smollm2_main_job.json"
CURVE = "docs/artifacts/smollm2_drafter_curve.json"
INITS = (("`fresh`", "docs/artifacts/smollm2_drafter_init_fresh.json"),
         ("`copy_last_block`, random projection",
          "docs/artifacts/smollm2_drafter_init_copy_last_block.json"),
         ("`copy_last_block`, identity projection",
          "docs/artifacts/smollm2_drafter_init_identity.json"))
PRETRAINED = (("reduced budget", "docs/artifacts/smollm2_pretrained_drafter_small.json"),
              ("full data budget", "docs/artifacts/smollm2_pretrained_drafter.json"))

# The project's goals (not measurements; the page states them in its prose): the SFT policy's
# drafter's online acceptance per depth and tokens per target forward (rejection sampling,
# T = 1), the MTP stage's minutes, and the pretrained policy's drafter's depth-1 acceptance.
ACCEPTANCE_GOAL = (0.80, 0.70, 0.60)
TPF_GOAL = 2.6
STAGE_MINUTES_GOAL = 30
PRETRAINED_DEPTH1_AIM = 0.6


def _schedule(node: Source) -> str:
  return " then ".join(f"`{loss}` to step {end}" for loss, end in node.value)


def _per_depth(b: Block, values: Source, fmt: str = ".3f") -> str:
  return " / ".join(b.num(v, fmt=fmt) for v in values)


def _wilson(b: Block, interval: Source) -> str:
  return ", ".join(f"[{b.num(lo, fmt='.3f')}, {b.num(hi, fmt='.3f')}]"
                   for lo, hi in (tuple(iv) for iv in interval))


def _chain_bound(acceptance: list[float]) -> float:
  """1 + a1 + a1 a2 + ...: the tokens per target forward if every iteration drafted K."""
  total, prod = 1.0, 1.0
  for a in acceptance:
    prod *= a
    total += prod
  return total


def sft_drafter(b: Block) -> str:
  job = Source(MAIN_JOB)
  mtp = job["mtp"]
  online, tf = mtp["online"], mtp["teacher_forced"]["rejection"]
  vocab = mtp.get("draft_vocab")
  lines = [f"Schedule: {_schedule(mtp['schedule'])}."]
  if vocab and vocab.get("size"):
    lines[0] += (f" Its {vocab['size'].value}-token draft vocabulary covers "
                 f"{b.num(vocab['coverage_train'], fmt='.2%')} of the training and "
                 f"{b.num(vocab['coverage_heldout'], fmt='.2%')} of the held-out policy tokens.")
  lines += ["", "| depth | online acceptance, rejection sampling [Wilson 95%] | drafts verified "
            "| online, greedy drafts | teacher-forced, reach-weighted | teacher-forced, "
            "unweighted | held-out positions | goal |", "|---|---|---|---|---|---|---|---|"]
  rej, greedy = online["rejection"], online.get("greedy_draft")
  for k in range(len(rej["acceptance"])):
    lo, hi = rej["interval"][k]
    goal = ACCEPTANCE_GOAL[k] if k < len(ACCEPTANCE_GOAL) else None
    g = "" if greedy is None else b.num(greedy["acceptance"][k], fmt=".3f")
    lines.append(
        f"| {k + 1} | {b.num(rej['acceptance'][k], fmt='.3f')} [{b.num(lo, fmt='.3f')}, "
        f"{b.num(hi, fmt='.3f')}] | {b.num(rej['attempted'][k], fmt=',.0f')} | {g} | "
        f"{b.num(tf['alpha'][k], fmt='.3f')} | {b.num(tf['alpha_unweighted'][k], fmt='.3f')} | "
        f"{b.num(tf['positions'][k], fmt=',.0f')} | "
        + ("" if goal is None else
           ("met" if rej["acceptance"][k].value >= goal else "missed")
           + ("; the goal lies inside the interval" if lo.value <= goal <= hi.value else ""))
        + " |")
  tpf = rej["tokens_per_target_forward"]
  tpf_text = ", ".join(f"{mode} {b.num(ev['tokens_per_target_forward'], fmt='.2f')}"
                       for mode, ev in online.items())
  lines += ["", f"Tokens per target forward (at most {len(rej['acceptance']) + 1}): {tpf_text}; "
            f"the goal for rejection sampling is "
            f"{'met' if tpf.value >= TPF_GOAL else 'missed'}."]
  if tpf.value < _chain_bound([a.value for a in rej["acceptance"]]):
    lines[-1] += (" They stay below 1 + α₁ + α₁α₂ + α₁α₂α₃ of the online rates because replies "
                  "are short: a reply's first token comes from its prefill, and its last block "
                  "stops at the stop token.")
  minutes = job["timing"]["mtp_s"].value / 60
  lines += ["", f"The stage took {b.num(job['timing']['mtp_s'], fmt='.1f', op='minutes')} "
            "minutes (sampling the drafter data, training and evaluation), "
            f"at {b.num(mtp['steady_step_time_s'], fmt='.2f')} s per steady training step: "
            f"{'within' if minutes <= STAGE_MINUTES_GOAL else 'over'} the "
            f"{STAGE_MINUTES_GOAL}-minute goal."]
  return "\n".join(lines)


def _curve_point(curve: Source, run: str, step: int) -> Source | None:
  for p in curve["points"]:
    if p["run"].value == run and p["step"].value == step:
      return p
  return None


def learning_curve(b: Block) -> str:
  curve = Source(CURVE)
  runs = curve["runs"]
  warm_steps = curve["warm_steps"].value
  objectives = [name.split("/", 1)[1] for name in runs if name.startswith("cold/")]
  final = lambda run, k: runs[run]["final"][f"alpha_{k + 1}"]
  first = next(iter(runs.value))
  depths = sum(1 for key in runs[first]["final"] if key.startswith("alpha_") and
               not key.startswith("alpha_unweighted"))
  lines = [f"About {b.num(runs[first]['tokens_per_step'], fmt='.0f')} training policy tokens "
           f"per step, from a store of {b.num(runs[first]['policy_tokens'], fmt=',.0f')} (the "
           "SFT policy's drafter data); evaluated over "
           f"{' / '.join(b.num(runs[first]['final'][f'draft_events_{k + 1}'], fmt=',.0f') for k in range(depths))} "
           "held-out positions per depth. Reach-weighted acceptance per depth at the last "
           "step:", "",
           "| objective | cold: schedule | cold | warm: schedule | warm |", "|---|---|---|---|---|"]
  for obj in objectives:
    cold, warm = f"cold/{obj}", f"warm/{obj}"
    lines.append(f"| `{obj}` | {_schedule(runs[cold]['schedule'])} | "
                 f"{' / '.join(b.num(final(cold, k), fmt='.3f') for k in range(depths))} | "
                 f"{_schedule(runs[warm]['schedule'])} | "
                 f"{' / '.join(b.num(final(warm, k), fmt='.3f') for k in range(depths))} |")
  # Cold: an objective whose depth-1 acceptance ends below half the best cold objective's
  # has stalled; name the step of its last gain.
  best = max(final(f"cold/{o}", 0).value for o in objectives)
  stalled = [o for o in objectives if final(f"cold/{o}", 0).value < best / 2]
  learned = [o for o in objectives if o not in stalled]
  text = []
  if stalled:
    text.append("Cold, " + " and ".join(f"`{o}`" for o in learned) + " learn while " +
                " and ".join(f"`{o}`" for o in stalled) + " end below half of the best cold "
                "depth-1 acceptance: the vanishing gradient above.")
  # Warm: does every objective gain after the KL phase, and how far apart do they end?
  gains = [final(f"warm/{o}", 0).value > _curve_point(curve, f"warm/{o}", warm_steps)["alpha"][0].value
           for o in objectives if _curve_point(curve, f"warm/{o}", warm_steps) is not None]
  spread = []
  for k in range(depths):
    nodes = [final(f"warm/{o}", k) for o in objectives]
    hi = max(nodes, key=lambda n: n.value)
    lo = min(nodes, key=lambda n: n.value)
    spread.append(b.num(hi, lo, fmt=".3f", op="difference"))
  text.append(("Warm, every objective gains after the KL steps" if gains and all(gains) else
               "Warm") + f"; the {len(objectives)} objectives end within "
              f"{' / '.join(spread)} of each other per depth (one seed).")
  return "\n".join(lines + ["", " ".join(text)])


def drafter_init(b: Block) -> str:
  runs = []
  for label, path in INITS:
    src = Source(path)
    run = next(iter(src["runs"].value))
    runs.append((label, [p for p in src["points"] if p["run"].value == run]))
  steps = [p["step"].value for p in runs[0][1]]
  lines = ["| start | " + " | ".join(f"step {s}" for s in steps) + " |",
           "|---" * (1 + len(steps)) + "|"]
  for label, points in runs:
    lines.append(f"| {label} | " + " | ".join(_per_depth(b, p["alpha"]) for p in points) + " |")
  depths = len(runs[0][1][-1]["alpha"])

  def by_start(pick) -> str:
    at: dict[str, list[int]] = {}
    for k in range(depths):
      at.setdefault(pick(runs, key=lambda r: r[1][-1]["alpha"][k].value)[0], []).append(k + 1)
    return "; ".join(
        f"{label} at every depth" if len(ks) == depths else
        f"{label} at depth{'s' if len(ks) > 1 else ''} "
        f"{' and '.join(', '.join(map(str, ks)).rsplit(', ', 1))}" for label, ks in at.items())

  lines += ["", f"At step {steps[-1]} the highest acceptance per depth: {by_start(max)}; the "
            f"lowest: {by_start(min)}."]
  return "\n".join(lines)


def pretrained_drafter(b: Block) -> str:
  sources = [(label, Source(path)) for label, path in PRETRAINED]
  rows = []

  def row(name, cell):
    rows.append(f"| {name} | " + " | ".join(cell(s) for _, s in sources) + " |")

  rej = lambda s: s["after"]["online"]["rejection"]
  greedy = lambda s: s["after"]["online"]["greedy_draft"]
  tf = lambda s: s["after"]["teacher_forced"]["rejection"]
  row("prompts sampled", lambda s: b.num(s["num_rollouts"], fmt=",.0f"))
  row("policy tokens", lambda s: b.num(s["policy_tokens"], fmt=",.0f"))
  row("schedule", lambda s: _schedule(s["schedule"]))
  row("s per steady step", lambda s: b.num(s["steady_step_time_s"], fmt=".2f"))
  row("stage minutes", lambda s: b.num(s["timing"]["total_s"], fmt=".0f", op="minutes"))
  row("online acceptance, rejection sampling",
      lambda s: _per_depth(b, rej(s)["acceptance"]))
  row("its Wilson 95% intervals", lambda s: _wilson(b, rej(s)["interval"]))
  row("drafts verified", lambda s: _per_depth(b, rej(s)["attempted"], fmt=",.0f"))
  row("online acceptance, greedy drafts", lambda s: _per_depth(b, greedy(s)["acceptance"]))
  row("tokens per target forward, rejection / greedy",
      lambda s: f"{b.num(rej(s)['tokens_per_target_forward'], fmt='.2f')} / "
                f"{b.num(greedy(s)['tokens_per_target_forward'], fmt='.2f')}")
  row("teacher-forced, reach-weighted", lambda s: _per_depth(b, tf(s)["alpha"]))
  row("held-out positions", lambda s: _per_depth(b, tf(s)["positions"], fmt=",.0f"))
  row("draft vocabulary coverage, train / held-out",
      lambda s: f"{b.num(s['draft_vocab']['coverage_train'], fmt='.1%')} / "
                f"{b.num(s['draft_vocab']['coverage_heldout'], fmt='.1%')}")
  lines = ["| | " + " | ".join(label for label, _ in sources) + " |",
           "|---" * (1 + len(sources)) + "|", *rows]
  verdicts = [f"{label} {'meets' if rej(s)['acceptance'][0].value >= PRETRAINED_DEPTH1_AIM else 'misses'} it"
              for label, s in sources]
  lines += ["", "Depth-1 online acceptance against the aim: " + "; ".join(verdicts) + "."]
  coverage = [s["draft_vocab"]["coverage_heldout"].value for _, s in sources]
  sft_vocab = Source(MAIN_JOB)["mtp"].get("draft_vocab")
  if sft_vocab and sft_vocab.get("coverage_heldout") and \
      max(coverage) < sft_vocab["coverage_heldout"].value:
    lines[-1] += (" A held-out token outside the draft vocabulary cannot be drafted, and this "
                  "policy's held-out tokens fall outside its vocabulary more often than the SFT "
                  "policy's do (its coverage is in the result above).")
  return "\n".join(lines)


def _block(fn) -> tuple[str, list]:
  b = Block()
  return b.text(fn(b))


def render() -> dict[str, tuple[str, list]]:
  return {"sft_drafter": _block(sft_drafter), "learning_curve": _block(learning_curve),
          "drafter_init": _block(drafter_init),
          "pretrained_drafter": _block(pretrained_drafter)}
