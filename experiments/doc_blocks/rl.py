"""docs/rl.md's generated blocks.

  adaptive_arm   three sync RL arms (autoregressive, speculative at the drafter's K, adaptive
                 draft length) from the quickstart's policy, interleaved in blocks
                 (docs/artifacts/bench_rl_adaptive_quickstart.json, bench_rl.py's output)
  smollm2_arms   the autoregressive and speculative sync arms on SmolLM2-135M-Instruct
                 (configs/smollm2.py), with the rollout share and the Amdahl bound
                 (docs/artifacts/bench_rl_smollm2.json)
"""
from __future__ import annotations

from experiments.doc_numbers import Block, Source

DOCUMENT = "docs/rl.md"

ADAPTIVE = "docs/artifacts/bench_rl_adaptive_quickstart.json"
SMOLLM2 = "docs/artifacts/bench_rl_smollm2.json"
ADAPTIVE_ARM = "adaptive_sync"


def _arms_table(b: Block, bench: Source, *, seconds: str) -> list[str]:
  """The schedule in words and one row per arm of bench_rl's medians over steady steps."""
  arms, schedule = bench["arms"], bench["schedule"]
  first = arms[next(iter(arms.value))]
  warmup = schedule["warmup"].value
  lines = [f"{first['steps'].value} steps per arm in {schedule['blocks'].value} blocks of "
           f"{schedule['block_steps'].value}, the first {warmup} "
           f"{'step' if warmup == 1 else 'steps'} of every block left out "
           f"({len(first['steady_steps'])} steady steps per arm); medians over the steady "
           "steps:", "",
           "| arm | s/step | rollout s | learner s | rollout share | tokens / target forward |",
           "|---|---|---|---|---|---|"]
  for name, arm in arms.items():
    lines.append(f"| {name} | {b.num(arm['step_s'], fmt=seconds)} | "
                 f"{b.num(arm['rollout_s'], fmt=seconds)} | "
                 f"{b.num(arm['learner_s'], fmt=seconds)} | "
                 f"{b.num(arm['rollout_share'], fmt='.0%')} | "
                 f"{b.num(arm['tokens_per_target_forward'], fmt='.2f')} |")
  return lines


def adaptive_arm(b: Block) -> str:
  bench = Source(ADAPTIVE)
  arms, pairs, schedule = bench["arms"], bench["pairs"], bench["schedule"]
  lines = _arms_table(b, bench, seconds=".2f")
  mine = [(name, pair) for name, pair in pairs.items()
          if pair["arms"].value[0] == ADAPTIVE_ARM and pair["of"].value == "step_s"]
  lines += ["", "| pair (A vs B), step seconds | paired speedup of A [95% interval] | ratio of "
            "medians |", "|---|---|---|"]
  for name, pair in mine:
    lo, hi = pair["ci95"]
    lines.append(f"| `{name}` | {b.num(pair['measured'], fmt='.2f')}x "
                 f"[{b.num(lo, fmt='.2f')}, {b.num(hi, fmt='.2f')}] | "
                 f"{b.num(pair['median_ratio'], fmt='.2f')}x |")
  # What the numbers say about the goal (at least as fast as the better of the others).
  fastest_median = min(arms, key=lambda n: arms[n]["step_s"].value) == ADAPTIVE_ARM
  point_above = all(pair["measured"].value >= 1 for _, pair in mine)
  other = lambda name: f"`{pair_arms(name)}`"
  pair_arms = lambda name: pairs[name]["arms"].value[1]
  above = [n for n, p in mine if p["ci95"][0].value > 1]
  below = [n for n, p in mine if p["ci95"][1].value < 1]
  open_ = [n for n, _ in mine if n not in above and n not in below]
  verdict = (f"`{ADAPTIVE_ARM}` is " +
             ("the fastest arm per step by the medians" if fastest_median else
              "not the fastest arm per step by the medians") +
             (" and faster than each other arm by the paired point estimates"
              if point_above else
              "; by the paired point estimates it is not faster than every other arm") + ".")
  if above:
    verdict += f" Its paired interval lies above 1 against {' and '.join(map(other, above))}."
  if below:
    verdict += f" Its paired interval lies below 1 against {' and '.join(map(other, below))}."
  if open_:
    verdict += (f" Against {' and '.join(map(other, open_))} the interval includes 1: "
                f"{schedule['blocks'].value} blocks do not rank the arms at 95%.")
  shares = [arms[n]["rollout_share"] for n in arms]
  verdict += (f" With rollouts at {b.num(*shares, fmt='.0%', op='min')} to "
              f"{b.num(*shares, fmt='.0%', op='max')} of a step, even a "
              "faster decoder moves a step by less.")
  return "\n".join(lines + ["", verdict])


def smollm2_arms(b: Block) -> str:
  """The sync arms on SmolLM2 (medians over steady steps), then speculative against
  autoregressive (the step and the rollout phase, paired by step) and what Amdahl's law
  allows at the measured rollout share."""
  bench = Source(SMOLLM2)
  arms, pairs, ratios = bench["arms"], bench["pairs"], bench["ratios"]
  placement = bench["placement"]
  lines = _arms_table(b, bench, seconds=".1f")
  step = pairs["speculative_sync_vs_autoregressive_sync"]
  decode = pairs["decode_speedup"]
  share = arms["autoregressive_sync"]["rollout_share"]
  amdahl = ratios["speculative_sync"]
  span = lambda p: f"[{b.num(p['ci95'][0], fmt='.2f')}, {b.num(p['ci95'][1], fmt='.2f')}]"
  lines += ["",
            f"Speculative (K = 3) against autoregressive, paired by step (95% intervals over "
            f"blocks): the whole step {b.num(step['measured'], fmt='.2f')}x {span(step)}, the "
            f"rollout phase {b.num(decode['measured'], fmt='.2f')}x {span(decode)}. The "
            f"autoregressive arm's rollouts are {b.num(share, fmt='.0%')} of its step, so by "
            f"Amdahl's law the rollout speedup (ratio of medians "
            f"{b.num(ratios['decode_speedup'], fmt='.2f')}x) allows at most "
            f"{b.num(amdahl['amdahl'], fmt='.2f')}x on the step; the step's ratio of medians "
            f"is {b.num(amdahl['measured'], fmt='.2f')}x. Placement: {placement['mode'].value}, "
            f"{placement['devices'].value} {placement['platform'].value} device, "
            f"{placement['cpu_cores'].value} cores."]
  return "\n".join(lines)


def render() -> dict[str, tuple[str, list]]:
  out = {}
  b = Block()
  out["adaptive_arm"] = b.text(adaptive_arm(b))
  b = Block()
  out["smollm2_arms"] = b.text(smollm2_arms(b))
  return out
