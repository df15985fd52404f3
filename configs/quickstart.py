"""The quickstart: what a new user runs first.

  python -m bebop_jax.main --config=configs/quickstart.py --workdir=runs/quickstart

For now it prepares the three task datasets and shows examples with their rewards and one
batch of each pipeline; SFT, MTP training and speculative evaluation join as they land.
"""

from bebop_jax import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("data",)
  config.data.num_train = 20_000
  config.data.num_test = 256
  return config
