r"""F3: the MTP objectives ce / kl / tv / e2e_tv per task over seeds (bebop_jax/findings/objectives.py).

  python experiments/fig_objectives.py --scale=laptop --workdir=runs/reproduce

Writes <workdir>/findings/objectives*.{json,csv,md,png}; makes (or reuses) the stages it needs in
<workdir> (bebop_jax/findings/common.py), the same ones experiments/reproduce.py uses.
"""

from absl import app

from bebop_jax.findings import cli

if __name__ == "__main__":
  cli.define_flags(page=False)
  app.run(cli.main_one("objectives"))
