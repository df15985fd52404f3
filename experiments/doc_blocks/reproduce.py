"""docs/reproduce.md's generated blocks.

  real_scale_time   the `real` scale's verdicts and each finding's run time
                    (docs/results_real/<finding>.json: `verdict`, `seconds`)
"""
from __future__ import annotations

import os

from experiments.doc_numbers import Block, Source

DOCUMENT = "docs/reproduce.md"

REAL_RESULTS = "docs/results_real"
REAL_FINDINGS = ("acceptance_entropy", "greedy_vs_rejection", "objectives", "through_rl")


def real_scale_time(b: Block) -> str:
  lines = ["| finding | verdict | minutes of its run (the stages it made included) |", "|---|---|---|"]
  for name in REAL_FINDINGS:
    path = os.path.join(REAL_RESULTS, f"{name}.json")
    if not os.path.exists(path):  # a page made with --only holds some of the findings
      continue
    f = Source(path)
    minutes = (b.num(f["seconds"], fmt=".1f", op="minutes") if f["seconds"].value > 0 else
               "none: it reuses the points of the finding above")
    lines.append(f"| [{f['title'].value}](results_real.md) | {f['verdict'].value} | "
                 f"{minutes} |")
  ledger_path = os.path.join(REAL_RESULTS, "stage_seconds.json")
  if os.path.exists(ledger_path):
    ledger = Source(ledger_path)
    total = b.num(*(ledger[k] for k in ledger.value), fmt=".1f", op="sum_minutes")
    lines.append(f"| every stage the page's findings read (`{ledger_path}`, seconds per stage; "
                 f"a finding's own minutes above leave out stages an earlier run made) | | "
                 f"{total} |")
  return "\n".join(lines)


def render() -> dict[str, tuple[str, list]]:
  b = Block()
  return {"real_scale_time": b.text(real_scale_time(b))}
