"""SFT -> MTP -> RL at smoke-test scale: the tiny model, a few steps of each (minutes on CPU).

  python -m bebop_jax.main --config=configs/rl_tiny.py --workdir=runs/rl_tiny

Tests and smoke runs use it. The tiny model barely learns the tasks in a few SFT steps, so the
rewards are mostly 0: this config checks that every piece runs, not that RL improves a policy
(configs/quickstart.py does that).
"""

from bebop_jax.stages import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("sft", "mtp", "rl")
  config.data.num_train = 64
  config.data.num_test = 8
  config.data.num_rl = 16
  config.data.batch_size = 8
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
  config.rl.prompts_per_batch = 2
  config.rl.group_size = 4
  config.rl.max_prompt_len = 128
  config.rl.rollout.max_new_tokens = 24
  config.rl.rollout.batch_size = 8
  config.rl.train.num_steps = 3
  config.rl.train.checkpoint_every = 2
  config.rl.train.progress = False
  config.rl.eval.num_examples = 2
  config.report.progress = False
  config.eval.num_examples = 2
  config.eval.batch_size = 8  # = the rollout batch: evaluation and rollouts share compiles
  config.eval.max_new_tokens = 24
  config.eval.temperatures = (1.0,)
  config.eval.prompt_buckets = (128, 256)  # one prompt shape: few compiles
  return config
