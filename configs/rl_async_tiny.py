"""Async GRPO at smoke-test scale: configs/rl_tiny.py with the learner and the rollouts on two
disjoint sub-meshes, a rollout thread and a staleness bound of 1.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python -m bebop_jax.main --config=configs/rl_async_tiny.py --workdir=runs/rl_async_tiny

On a CPU the four devices are simulated (they share its cores): this config checks that the
split placement, the weight sync, the versions and the staleness bookkeeping run end to end,
and its log reports staleness and idle times. It does not show an async speedup
(experiments/bench_rl.py measures that).
"""

import os

from bebop_jax.stages import config as config_lib


def get_config(arg: str | None = None):
  del arg
  config = config_lib.load_file(os.path.join(os.path.dirname(__file__), "rl_tiny.py"))
  config.rl.placement.mode = "split"
  config.rl.placement.learner_devices = 2   # devices 0-1: the learner (data-parallel 2)
  config.rl.placement.rollout_devices = 2   # devices 2-3: the rollouts (rows split 2 ways)
  a = config.rl.asynchronous
  a.enabled = True
  a.max_staleness = 1
  a.interrupt = True                        # new weights between a batch's decoding calls
  config.rl.rollout.batch_size = 4          # two decoding calls per 8-rollout batch
  config.rl.train.num_steps = 6
  config.rl.train.checkpoint_every = 3
  return config
