"""The quickstart's chain (SFT -> MTP -> RL -> eval) at test scale: configs/rl_tiny.py plus the
eval stage, seconds per stage.

  python -m bebop_jax.main --config=configs/quickstart_tiny.py
"""

import os

from bebop_jax.stages import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.load_file(os.path.join(os.path.dirname(__file__), "rl_tiny.py"))
  config.stages = ("sft", "mtp", "rl", "eval")
  config.rl.train.num_steps = 3  # > 2 points for the entropy fit across steps
  config.report.batch_sizes = (1, 8)
  config.report.num_prompts = 8
  config.report.repeats = 1
  config.report.entropy_temperatures = (1.0,)
  return config
