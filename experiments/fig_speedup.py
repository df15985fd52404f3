r"""The four-arm RL speed table from the e2e_tv drafter (bebop_jax/findings/speedup.py).

  python experiments/fig_speedup.py --scale=laptop --workdir=runs/reproduce

Writes <workdir>/findings/speedup*.{json,csv,md,png}; makes (or reuses) the stages it needs in
<workdir> (bebop_jax/findings/common.py), the same ones experiments/reproduce.py uses.
"""

from absl import app

from bebop_jax.findings import cli

if __name__ == "__main__":
  cli.define_flags(page=False)
  app.run(cli.main_one("speedup"))
