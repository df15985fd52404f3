"""A seconds-long data run for tests: tiny datasets, tiny batches."""

from bebop_jax.stages import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("data",)
  config.data.num_train = 64
  config.data.num_test = 16
  config.data.num_rl = 16
  config.data.batch_size = 8
  config.data.seq_len = 256
  config.rl.prompts_per_batch = 2
  config.rl.group_size = 4  # 8 rollouts: splits over 8 simulated devices
  config.preview.examples_per_task = 1
  return config
