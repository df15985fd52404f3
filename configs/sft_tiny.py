"""A seconds-long SFT run for tests: the tiny model, tiny data, a few steps."""

from bebop_jax.stages import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("sft",)
  config.data.num_train = 64
  config.data.num_test = 8
  config.data.num_rl = 8
  config.data.batch_size = 8  # a multiple of the device count (8 simulated in tests)
  config.data.seq_len = 192
  config.sft.train.num_steps = 6
  config.sft.train.log_every = 2
  config.sft.train.checkpoint_every = 3
  config.sft.train.progress = False
  config.sft.optim.warmup_steps = 2
  config.eval.num_examples = 2
  config.eval.batch_size = 2
  config.eval.max_new_tokens = 24
  return config
