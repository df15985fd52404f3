r"""F4: drafter acceptance through RL, frozen / online / periodic (experiments/findings/through_rl.py).

  python experiments/fig_through_rl.py --scale=laptop --workdir=runs/reproduce

Writes <workdir>/findings/through_rl*.{json,csv,md,png}; makes (or reuses) the stages it needs in
<workdir> (experiments/findings/common.py), the same ones experiments/reproduce.py uses.
"""

import os  # pylint: disable=g-bad-import-order
import sys

if __package__ in (None, ""):  # run as a script: the checkout's root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app

from experiments.findings import cli

if __name__ == "__main__":
  cli.define_flags(page=False)
  app.run(cli.main_one("through_rl"))
