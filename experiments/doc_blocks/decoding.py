"""docs/decoding.md's generated blocks: the decoding benchmarks and the iteration profile,
each rendered from its committed JSON under docs/artifacts/. Every number is read from the
artifact; the comparisons in words (faster or slower, goal met or missed, within the loop's
own timing noise or not) are computed from the same values.

  bench_decode.json                    single_turn, multi_turn (bench_decode.py, one turn per
                                       prompt and whole agentic episodes)
  profile_speculative.json             profile (profile_speculative.py, batch 1)
  bench_adaptive_quickstart_arms.json  adaptive, adaptive_calls, block_by_task
                                       (bench_decode.py --adaptive --draft_lengths=1,2,3)
  call_overhead_quickstart.json        call_overhead (bench_call_overhead.py)
"""

from __future__ import annotations

from experiments.doc_numbers import Block, Source

DOCUMENT = "docs/decoding.md"
BENCH = "docs/artifacts/bench_decode.json"
PROFILE = "docs/artifacts/profile_speculative.json"
ADAPTIVE = "docs/artifacts/bench_adaptive_quickstart_arms.json"
CALL_OVERHEAD = "docs/artifacts/call_overhead_quickstart.json"

# The goal set for the adaptive decoder (not a measurement: the page states it in prose, in
# inline code): at least GOAL_RATIO of autoregressive decoding's speed, and within
# GOAL_WITHIN of the best fixed draft length (K = 0, ratio 1, included).
GOAL_RATIO = 0.97
GOAL_WITHIN = 0.05


# ----------------------------------------------------------------------------- helpers


def _depths(b: Block, values: Source, fmt: str = ".2f", sep: str = "/") -> str:
  return sep.join(b.num(v, fmt=fmt) for v in values)


def _range(b: Block, nodes: list[Source], fmt: str, suffix: str = "") -> str:
  """"lo-hi" of the nodes' values (one value when they agree at the printed precision)."""
  lo, hi = b.num(*nodes, fmt=fmt, op="min"), b.num(*nodes, fmt=fmt, op="max")
  if format(min(n.value for n in nodes), fmt) == format(max(n.value for n in nodes), fmt):
    return lo + suffix
  return f"{lo}{suffix}-{hi}{suffix}"


def _verdict(values: list[float]) -> str:
  if all(v > 1 for v in values):
    return "faster than"
  if all(v < 1 for v in values):
    return "slower than"
  return "about as fast as"


def _ratio_cell(b: Block, row: Source, fmt: str = ".2f") -> str:
  """The speed ratio, with its 95% interval over passes when the row has one."""
  cell = f"{b.num(row['speedup'], fmt=fmt)}x"
  ci = row.get("speedup_ci95")
  if ci is not None and ci.value:
    cell += f" [{b.num(ci[0], fmt=fmt)}, {b.num(ci[1], fmt=fmt)}]"
  return cell


def _protocol(rows: list[Source]) -> str:
  """Whether the rows' wall-clock ratios meet the benchmark's protocol
  (`decode_timing.meets_protocol`, recorded in each row by the benchmark)."""
  flags = [r.get("meets_protocol") for r in rows]
  if any(f is None for f in flags):
    return ("The JSON's rows carry one ratio per arm (each arm's best timed pass) and no interval "
            "over passes, so they do not meet the protocol of `decode_timing.meets_protocol`; "
            "read them as one measurement each.")
  met = sum(bool(f.value) for f in flags)
  if met == len(flags):
    return "Every row meets the protocol of `decode_timing.meets_protocol`."
  return (f"{met} of {len(flags)} rows meet the protocol of `decode_timing.meets_protocol` "
          "(the others are one measurement each).")


def _list(items: list[str]) -> str:
  return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ----------------------------------------------------------------------------- single turn


def single_turn_block(b: Block, bench: Source) -> str:
  rows = list(bench["results"])
  lines = [
      f"The JSON's policy: {bench['model'].value}; device: {bench['device'].value}; "
      f"{bench['max_new_tokens'].value} new tokens at most. " + _protocol(rows), "",
      "| batch | prompts | temp | mode | AR tok/s | spec tok/s | ratio | tok/fwd | acceptance "
      "online | teacher-forced | AR fixed share | decode-phase ratio |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['batch'].value} | {b.num(r['prompts'], fmt='.0f')} | "
        f"{r['temperature'].value:g} | {r['mode'].value} | "
        f"{b.num(r['ar_tokens_per_s'], fmt='.1f')} | "
        f"{b.num(r['spec_tokens_per_s'], fmt='.1f')} | {_ratio_cell(b, r)} | "
        f"{b.num(r['tokens_per_target_forward'], fmt='.2f')} | "
        f"{_depths(b, r['acceptance_online'])} | "
        f"{_depths(b, r['acceptance_teacher_forced'])} | "
        f"{b.num(r['ar_fixed_share'], fmt='.0%')} | "
        f"{b.num(r['decode_phase_speedup'], fmt='.2f')}x |")
  # The largest gap between online and teacher-forced acceptance, over rows and depths.
  gap, pair = -1.0, None
  for r in rows:
    for on, tf in zip(r["acceptance_online"], r["acceptance_teacher_forced"]):
      if abs(on.value - tf.value) > gap:
        gap, pair = abs(on.value - tf.value), (on, tf) if on.value >= tf.value else (tf, on)
  batches = sorted({r["batch"].value for r in rows})
  by_batch = []
  for batch in batches:
    sel = [r for r in rows if r["batch"].value == batch]
    short = {"faster than": "faster", "slower than": "slower", "about as fast as": "about as fast"}
    by_batch.append(f"{short[_verdict([r['speedup'].value for r in sel])]} "
                    f"at batch {batch} ({_range(b, [r['speedup'] for r in sel], '.2f', 'x')})")
  tpf = [r["tokens_per_target_forward"] for r in rows]
  far = max(r["speedup"].value for r in rows) < min(t.value for t in tpf) / 2
  lines += [
      "", f"Tokens per target forward is {_range(b, tpf, '.2f')} of at most 4 in every mode, "
      "and online acceptance agrees with the teacher-forced expectation at the visited "
      f"frontiers within {b.num(*pair, fmt='.3f', op='difference')} per depth: the drafter "
      "and the verification work. In wall clock, against autoregressive decoding, "
      "speculative decoding is " + _list(by_batch) + "." +
      (" Nowhere does the wall-clock ratio come near the reduction in target forwards "
       "(tokens per target forward) it buys." if far else "")]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- multi turn


def multi_turn_block(b: Block, bench: Source) -> str:
  rows = list(bench["results_multi_turn"])
  lines = [
      f"The JSON's policy: {bench['model'].value}; {bench['episode_max_new_tokens'].value} "
      "tokens per episode at most, replies included.", "",
      "| batch | episodes | temp | mode | spec tok/s | AR tok/s | AR re-encoded tok/s | spec/AR "
      "| AR/re-encoded | tok/fwd | acceptance online | turns spec | turns AR | AR loops "
      "identical |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['batch'].value} | {b.num(r['prompts'], fmt='.0f')} | "
        f"{r['temperature'].value:g} | {r['mode'].value} | "
        f"{b.num(r['spec_tokens_per_s'], fmt='.1f')} | "
        f"{b.num(r['ar_tokens_per_s'], fmt='.1f')} | "
        f"{b.num(r['ar_reencoded_tokens_per_s'], fmt='.1f')} | {_ratio_cell(b, r)} | "
        f"{b.num(r['continuation_speedup'], fmt='.2f')}x | "
        f"{b.num(r['tokens_per_target_forward'], fmt='.2f')} | "
        f"{_depths(b, r['acceptance_online'])} | {b.num(r['spec_mean_turns'], fmt='.2f')} | "
        f"{b.num(r['ar_mean_turns'], fmt='.2f')} | "
        f"{b.num(r['ar_identical_fraction'], fmt='.0%')} |")
  cont = [r["continuation_speedup"] for r in rows]
  batches = sorted({r["batch"].value for r in rows})
  per_batch = {bt: [r for r in rows if r["batch"].value == bt] for bt in batches}
  lows = [min(r["continuation_speedup"].value for r in per_batch[bt]) for bt in batches]
  highs = [max(r["continuation_speedup"].value for r in per_batch[bt]) for bt in batches]
  growing = all(l2 > h1 for h1, l2 in zip(highs, lows[1:]))
  direction = "faster than" if min(c.value for c in cont) > 1 else "against"
  spec = [f"{_range(b, [r['speedup'] for r in per_batch[bt]], '.2f', 'x')} at batch {bt}"
          for bt in batches]
  identical = [r["ar_identical_fraction"] for r in rows]
  same = ("The two autoregressive loops sampled every episode identically."
          if all(i.value == 1 for i in identical) else
          "The two autoregressive loops sampled "
          f"{_range(b, identical, '.0%')} of the episodes identically (the rest differ by "
          "float rounding of the logits changing a sample).")
  lines += [
      "", f"Keeping the cache across turns makes autoregressive episodes "
      f"{_range(b, cont, '.2f', 'x')} {direction} re-encoding the context every turn"
      + (", more so at larger batches" if growing else "") +
      ". Against that like-for-like baseline, speculative episodes run at " + _list(spec) +
      ". " + same + " " + _protocol(rows)]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the profile


def profile_block(b: Block, p: Source, bench: Source) -> str:
  loops, parts, steps = p["loops"], p["parts"], p["parts_in_ar_steps"]
  lines = [
      f"The JSON's policy: {p['model'].value}; device: {p['device'].value}.", "",
      "| measurement | seconds | autoregressive steps |", "|---|---|---|",
      f"| an autoregressive step, in the loop | {b.num(loops['ar_step_s'], fmt='.6f')} | 1 |",
      f"| the speculative iteration, in the loop | {b.num(loops['iteration_s'], fmt='.6f')} | "
      f"{b.num(loops['iteration_in_ar_steps'], fmt='.2f')} |",
      f"| an autoregressive step, timed alone (the unit of the parts) | "
      f"{b.num(parts['ar_step_s'], fmt='.6f')} | 1 |",
      f"| part: verify forward over K + 1 = 4 tokens | "
      f"{b.num(parts['verify_forward_s'], fmt='.6f')} | "
      f"{b.num(steps['verify_forward_in_ar_steps'], fmt='.2f')} |",
      f"| part: the K = 3 draft depths over their windows, with sampling | "
      f"{b.num(parts['drafts_s'], fmt='.6f')} | "
      f"{b.num(steps['drafts_in_ar_steps'], fmt='.2f')} |",
      f"| part: the rest of the iteration (verification, commit) | | "
      f"{b.num(p['rest_of_iteration_in_ar_steps'], fmt='.2f')} |",
      f"| part: prefill of the {p['prompt_len'].value}-token prompt bucket, once per call | "
      f"{b.num(parts['prefill_s'], fmt='.6f')} | "
      f"{b.num(steps['prefill_in_ar_steps'], fmt='.2f')} |", "",
      f"With {b.num(loops['tokens_per_target_forward'], fmt='.2f')} tokens per target "
      f"forward, the decoding phase runs at {b.num(loops['decode_phase_ratio'], fmt='.2f')}x "
      f"the autoregressive loop and the whole call at "
      f"{b.num(loops['end_to_end_ratio'], fmt='.2f')}x, since the per-call fixed cost "
      f"(prefill and first token) is {b.num(loops['fixed_share_of_ar'], fmt='.0%')} of the "
      "autoregressive time. In the single-turn benchmark above that fixed cost is "
      + _range(b, [r["ar_fixed_share"] for r in bench["results"]], ".0%") +
      " of the autoregressive time."]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- adaptive


def _fixed(rows: list[Source], batch, mode) -> list[Source]:
  return sorted((r for r in rows if r["batch"].value == batch and r["mode"].value == mode
                 and r["k"].value != "adaptive"), key=lambda r: r["k"].value)


def _adaptive(rows: list[Source], batch, mode) -> Source:
  return next(r for r in rows if r["batch"].value == batch and r["mode"].value == mode
              and r["k"].value == "adaptive")


def _iterations(b: Block, row: Source) -> str:
  its = row["k_iterations"]
  if list(its) == ["0"]:
    return "K 0 throughout"
  return "K " + ", ".join(f"{k}: {b.num(its[k], fmt='.0f')}" for k in its) + " iterations"


def adaptive_block(b: Block, bench: Source) -> str:
  rows = list(bench["results"])
  batches = sorted({r["batch"].value for r in rows})
  modes = list(dict.fromkeys(r["mode"].value for r in rows))
  ks = " / ".join(str(k) for k in sorted({r["k"].value for r in rows
                                          if r["k"].value != "adaptive"}))
  k3 = [r for r in rows if r["k"].value == 3 and r["mode"].value == "rejection"
        and r["batch"].value == max(batches)]
  lines = [f"The JSON's policy: {bench['model'].value}; device: {bench['device'].value}. "
           + (f"Its drafter's online acceptance at K = 3 with rejection sampling (batch "
              f"{max(batches)}): {_depths(b, k3[0]['acceptance_online'], sep=' / ')}. "
              if k3 else "") + _protocol(rows), "",
           "| batch | " + " | ".join(f"fixed K = {ks}, {m}" for m in modes) + " | "
           + " | ".join(f"adaptive, {m}" for m in modes) + " | goal met |",
           "|---" * (2 + 2 * len(modes)) + "|"]
  analysis = []
  for batch in batches:
    fixed = {m: _fixed(rows, batch, m) for m in modes}
    ada = {m: _adaptive(rows, batch, m) for m in modes}
    goal = []
    for m in modes:
      best = max([1.0] + [r["speedup"].value for r in fixed[m]])
      v = ada[m]["speedup"].value
      goal.append(f"{m} {'yes' if v >= GOAL_RATIO and v >= (1 - GOAL_WITHIN) * best else 'no'}")
    lines.append(
        f"| {batch} | " + " | ".join(
            " / ".join(f"{b.num(r['speedup'], fmt='.2f')}x" for r in fixed[m]) for m in modes)
        + " | " + " | ".join(f"{b.num(ada[m]['speedup'], fmt='.3f')}x "
                             f"({_iterations(b, ada[m])})" for m in modes)
        + " | " + ", ".join(goal) + " |")
    # In words: the best fixed choice (K = 0 is the autoregressive loop, 1x), and where the
    # adaptive decoder stands against it and against the goal.
    said = []
    for m in modes:
      best = max(fixed[m], key=lambda r: r["speedup"].value)
      v = ada[m]["speedup"].value
      if best["speedup"].value > 1:
        ref = (f"the best fixed K (K = {best['k'].value}, "
               f"{b.num(best['speedup'], fmt='.2f')}x)")
        best_v = best["speedup"].value
      else:
        ref = "the best choice, K = 0 (every fixed K is slower than autoregressive decoding)"
        best_v = 1.0
      met = v >= GOAL_RATIO and v >= (1 - GOAL_WITHIN) * best_v
      said.append(f"{m}: adaptive {b.num(ada[m]['speedup'], fmt='.3f')}x, "
                  f"{'faster' if v > best_v else 'slower'} than {ref}, "
                  f"goal {'met' if met else 'missed'}")
    analysis.append(f"- **Batch {batch}**: " + "; ".join(said) + ".")
  return "\n".join(lines + ["", "What it shows:", ""] + analysis)


def adaptive_calls_block(b: Block, bench: Source) -> str:
  """The adaptive rows' per-call measurements and the autoregressive loop timed in both
  rounds (the noise floor of the ratios)."""
  rows = [r for r in bench["results"] if r["k"].value == "adaptive"]
  lines = ["| batch | mode | prefill (s) | call residual per arm (s) | segment call cost (s) | "
           "AR loop, first round / adaptive round (s) |", "|---|---|---|---|---|---|"]
  for r in rows:
    res = r["call_residual_s"]
    arms = ", ".join(
        f"K = {arm.split()[0]}{' whole-call program' if arm.endswith('whole') else ' in segments'}"
        f" {b.num(res[arm], fmt='+.5f')}" for arm in res)
    seg = list(r["segment_overhead_s"][k] for k in r["segment_overhead_s"])
    own = r.get("ar_seconds_own_round")
    lines.append(
        f"| {r['batch'].value} | {r['mode'].value} | {b.num(r['prefill_s'], fmt='.4f')} | "
        f"{arms} | {_range(b, seg, '.5f')} | {b.num(r['ar_seconds'], fmt='.3f')} / "
        + (b.num(own, fmt=".3f") if own is not None else "—") + " |")
  return "\n".join(lines)


def block_by_task_block(b: Block, bench: Source) -> str:
  rows = list(bench["results"])
  k_max = max(r["k"].value for r in rows if r["k"].value != "adaptive")
  batch = sorted({r["batch"].value for r in rows})[len({r["batch"].value for r in rows}) // 2]
  pick = {r["mode"].value: r for r in rows
          if r["k"].value == k_max and r["batch"].value == batch}
  block, rej = pick["block"]["tokens_per_target_forward_by_task"], \
      pick["rejection"]["tokens_per_target_forward_by_task"]
  tasks = list(block)
  at_least = [t for t in tasks if block[t].value >= rej[t].value]
  verdict = ("Block verification earns at least as many tokens per target forward as "
             "rejection on every task" if len(at_least) == len(tasks) else
             f"Block verification earns at least as many tokens per target forward as "
             f"rejection on {len(at_least)} of {len(tasks)} tasks")
  return (f"{verdict} ({bench['model'].value}, K = {k_max}, batch {batch}, block / "
          "rejection: " + ", ".join(
              f"{t} {b.num(block[t], fmt='.3f')} / {b.num(rej[t], fmt='.3f')}" for t in tasks)
          + f"; one run, `{ADAPTIVE}`, every row of which has the per-task figures).")


def call_overhead_block(b: Block, c: Source) -> str:
  what = {
      "autoregressive": "`autoregressive.generate` (the baseline)",
      "program": "the adaptive decoder's K = 0 whole-call program alone",
      "before_dispatch": "that program, the decoder's per-call host work done before the "
                         "dispatch",
      "after_dispatch": "that program, the same host work done after the dispatch",
      "adaptive": "`adaptive.generate` itself",
  }
  v = c["variants"]
  lines = [f"One {b.num(c['tokens_per_call'], fmt='.0f')}-token call of "
           f"{c['model'].value}, blocks of {b.num(c['calls'], fmt='.0f')} calls, "
           f"{b.num(c['blocks'], fmt='.0f')} blocks of every variant interleaved "
           f"(`{c['command'].value}`):", "",
           "| variant | median seconds per call | speed relative to the autoregressive "
           "program |", "|---|---|---|"]
  for name in v:
    lines.append(f"| {what.get(name, name)} | {b.num(v[name]['median_s'], fmt='.5f')} | "
                 f"{b.num(v[name]['ratio'], fmt='.3f')}x |")
  if "adaptive" in v and "autoregressive" in v:
    ada, ar = v["adaptive"]["median_s"], v["autoregressive"]["median_s"]
    more = ada.value > ar.value
    diff = b.num(*((ada, ar) if more else (ar, ada)), fmt=".5f", op="difference")
    lines += ["", f"The adaptive call costs {diff} s per call {'more' if more else 'less'} "
              "than the autoregressive program (medians). One run: differences of a few "
              "percent between these variants are within this CPU's run-to-run variation."]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- render


def _block(fn, *args) -> tuple[str, list]:
  b = Block()
  return b.text(fn(b, *args))


def render() -> dict[str, tuple[str, list]]:
  bench = Source(BENCH)
  adaptive = Source(ADAPTIVE)
  return {
      "single_turn": _block(single_turn_block, bench),
      "adaptive": _block(adaptive_block, adaptive),
      "adaptive_calls": _block(adaptive_calls_block, adaptive),
      "call_overhead": _block(call_overhead_block, Source(CALL_OVERHEAD)),
      "block_by_task": _block(block_by_task_block, adaptive),
      "profile": _block(profile_block, Source(PROFILE), bench),
      "multi_turn": _block(multi_turn_block, bench),
  }
