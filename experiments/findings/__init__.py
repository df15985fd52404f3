"""The paper's findings, reproduced: one module per finding and the results page.

  common.py              scales (smoke | laptop | full), the shared stage outputs (one SFT
                         policy, one drafter per MTP loss and seed, one RL run per drafter
                         arm, the entropy RL run), the output files of a finding
  stats.py               paired t intervals, line fits, autocorrelation-corrected series fits
  rules.py               every finding's verdict rule, with its versions, texts and history
  acceptance_entropy.py  F1/F2: acceptance against policy entropy, rejection vs greedy_draft
  objectives.py          F3: the MTP objectives ce / kl / tv / e2e_tv per task over seeds
  through_rl.py          F4: drafter acceptance through RL, frozen / online / periodic
  speedup.py             the four-arm RL speed table (experiments.rl_benchmark)
  results.py             docs/results.md from the findings' outputs, with verdicts, each
                         beside its rule and the verdicts of the rule's older versions

experiments/reproduce.py runs them all; experiments/fig_*.py run one each. Every finding
writes <workdir>/findings/<name>.{json,csv,md} and <name>*.png.
"""
