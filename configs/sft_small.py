"""SFT of the ~1M-parameter quickstart policy on the three tasks (two CPU cores, minutes).

  python -m bebop_jax.main --config=configs/sft_small.py --workdir=runs/sft_small
"""

from bebop_jax.stages import config as config_lib
from bebop_jax.model import config as model_config


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("sft",)
  config.model.update(model_config.PRESETS["small"])
  config.data.num_train = 20_000
  config.data.num_test = 256
  config.data.batch_size = 16
  config.data.seq_len = 256
  config.data.tasks.math.weight = 2.0
  config.data.tasks.code.weight = 2.0
  config.sft.train.num_steps = 1100
  config.sft.train.log_every = 25
  config.sft.train.checkpoint_every = 100
  config.sft.optim.learning_rate = 4e-3
  config.sft.optim.warmup_steps = 50
  config.sft.mtp_loss_weight = 0.3
  config.eval.num_examples = 64
  config.eval.temperatures = (0.0, 1.0)
  config.eval.batch_size = 64
  config.eval.max_new_tokens = 160
  return config
