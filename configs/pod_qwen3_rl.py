"""Pod-scale shapes: asynchronous RL of a Qwen3-1.7B-like or Qwen3-8B-like policy with one MTP
module, the learner and the rollouts on two disjoint halves of the devices.

  python -m bebop_jax.main --config=configs/pod_qwen3_rl.py:8b --workdir=gs://.../qwen3_8b

arg: "1p7b" (default) or "8b". rl.placement is split: the first half of the devices is the
learner sub-mesh (fsdp x tensor 4, as configs/pod_qwen3.py), the rest the rollout sub-mesh
(data x tensor 4: every rollout replica holds a quarter of the parameters); bfloat16
parameters and compute. Both RL programs (the policy update and the speculative rollout) are
compiled ahead of time on a simulated mesh by experiments/aot_compile_rl.py and
tests/test_rl_aot.py (e.g. 256 devices = 128 + 128); the config validates on 8 to 256
devices, a power of two (each half a multiple of 4, and the batches below must split over
the data-parallel sizes).
"""

import os

from bebop_jax.stages import config as config_lib
from bebop_jax import sharding

_SIZES = ("1p7b", "8b")


def get_config(arg: str | None = None):
  size = arg or "1p7b"
  if size not in _SIZES:
    raise ValueError(f"configs/pod_qwen3_rl.py:{size} is not allowed: one of "
                     f"{sorted(_SIZES)}")
  # The model, mesh (fsdp x tensor 4: the learner's, also config.mesh for the SFT / MTP
  # stages) and batch sizes of the SFT pod config.
  config = config_lib.load_file(os.path.join(os.path.dirname(__file__), "pod_qwen3.py"), size)
  config.stages = ("rl",)

  p = config.rl.placement
  p.mode = "split"
  p.learner_devices = 0.5
  p.rollout_devices = 0.0  # the rest
  p.learner_mesh.shape = (-1, 4)
  p.learner_mesh.axes = ("fsdp", "tensor")
  p.learner_mesh.rules = sharding.DEFAULT_RULES
  p.rollout_mesh.shape = (-1, 4)
  p.rollout_mesh.axes = ("data", "tensor")
  p.rollout_mesh.rules = sharding.DEFAULT_RULES  # batch over data; heads, mlp, vocab tensor
  config.rl.asynchronous.enabled = True
  config.rl.asynchronous.max_staleness = 1

  # 512 rollouts a step in 4 updates of 128 rows of up to 512 + 1024 tokens, each update 2
  # accumulated microbatches of 2 rows per data-parallel shard (128 learner devices): the 8B
  # policy update's temp is 8.56 GiB a device with the fused head (10.61 dense), 13.83
  # (17.05) without accumulation, 5.74 (6.97) with 4, by the CPU compiler's memory analysis
  # (docs/rl.md).
  config.rl.prompts_per_batch = 64
  config.rl.group_size = 8
  config.rl.max_prompt_len = 512
  config.rl.minibatches = 4
  config.rl.train.grad_accum_steps = 2
  config.rl.rollout.max_new_tokens = 1024
  config.rl.rollout.batch_size = 256
  config.rl.train.num_steps = 1000
  config.rl.train.checkpoint_every = 50
  config.rl.train.eval_every = 100
  config.rl.optim.learning_rate = 1e-6
  config.rl.eval.num_examples = 256
  return config
