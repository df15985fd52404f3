r"""F1/F2: acceptance against policy entropy, rejection vs greedy_draft (bebop_jax/findings/acceptance_entropy.py).

  python experiments/fig_acceptance_entropy.py --scale=laptop --workdir=runs/reproduce

Writes <workdir>/findings/acceptance_entropy*.{json,csv,md,png}; makes (or reuses) the stages it needs in
<workdir> (bebop_jax/findings/common.py), the same ones experiments/reproduce.py uses.
"""

from absl import app

from bebop_jax.findings import cli

if __name__ == "__main__":
  cli.define_flags(page=False)
  app.run(cli.main_one("acceptance_entropy"))
