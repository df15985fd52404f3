"""The quickstart's chain (SFT -> MTP -> eval) at test scale: the tiny model, seconds per stage.

  python -m bebop_jax.main --config=configs/quickstart_tiny.py
"""

from bebop_jax import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("sft", "mtp", "eval")
  config.data.num_train = 64
  config.data.num_test = 8
  config.data.batch_size = 8  # a multiple of the device count (8 simulated in tests)
  config.data.seq_len = 192
  config.sft.train.num_steps = 4
  config.sft.train.log_every = 2
  config.sft.train.checkpoint_every = 2
  config.sft.train.progress = False
  config.sft.optim.warmup_steps = 1
  config.mtp.data.num_prompts = 12
  config.mtp.data.max_new_tokens = 24
  config.mtp.data.batch_size = 8
  config.mtp.batch_size = 8
  config.mtp.eval_before = False
  config.mtp.train.num_steps = 2
  config.mtp.train.log_every = 1
  config.mtp.train.checkpoint_every = 2
  config.mtp.train.progress = False
  config.mtp.optim.warmup_steps = 1
  config.eval.num_examples = 2
  config.eval.batch_size = 8  # = mtp.data.batch_size: rollouts and evaluation share compiles
  config.eval.max_new_tokens = 24
  config.eval.temperatures = (1.0,)
  config.eval.prompt_buckets = (128, 256)  # one prompt shape: few compiles
  config.report.batch_sizes = (1, 8)
  config.report.num_prompts = 8
  config.report.repeats = 1
  config.report.entropy_temperatures = (1.0,)
  return config
