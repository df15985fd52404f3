r"""F4: drafter acceptance through RL, frozen / online / periodic (bebop_jax/findings/through_rl.py).

  python experiments/fig_through_rl.py --scale=laptop --workdir=runs/reproduce

Writes <workdir>/findings/through_rl*.{json,csv,md,png}; makes (or reuses) the stages it needs in
<workdir> (bebop_jax/findings/common.py), the same ones experiments/reproduce.py uses.
"""

from absl import app

from bebop_jax.findings import cli

if __name__ == "__main__":
  cli.define_flags(page=False)
  app.run(cli.main_one("through_rl"))
