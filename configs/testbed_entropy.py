"""The quickstart's policy trained on many solution paths per problem: a testbed whose
policy has real entropy, for the MTP objective sweep and the acceptance-against-entropy fit.

  python -m bebop_jax.main --config=configs/testbed_entropy.py --workdir=runs/testbed_entropy
  python experiments/sweep_mtp_losses.py --config=configs/testbed_entropy.py \
      --init_from=runs/testbed_entropy --starts=warm,scratch --seeds=3 --workdir=runs/sweep_entropy

Everything as configs/laptop.py (the same model, data, SFT, MTP and eval budgets) except
that SFT samples a fresh demonstration at every visit: every structural fork
(`diversity=1`: reduction order, equivalent programs and traced example, look-up order and
calc forms) and the spaced writing style for half of the demonstrations. The restatement
(math) and confirmation look-up (agentic) forks stay off: at this size they cost most of
the pass@1 (docs/mtp.md has the commands that measure it). No rl stage: the sweep needs the
SFT policy.
"""

import os

from bebop_jax.stages import config as config_lib
from bebop_jax.tasks import TASK_NAMES


def get_config(arg: str | None = None):
  config = config_lib.load_file(os.path.join(os.path.dirname(__file__), "laptop.py"), arg)
  config.stages = ("sft", "mtp", "eval")
  for name in TASK_NAMES:
    config.data.tasks[name].knobs.diversity = 1.0
    config.data.tasks[name].knobs.spacing = 0.5
  return config
