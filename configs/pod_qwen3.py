"""Pod-scale shapes: SFT, then MTP drafter training (e2e-TV), of a Qwen3-1.7B-like or
Qwen3-8B-like policy with one MTP module.

  python -m bebop_jax.main --config=configs/pod_qwen3.py:8b --workdir=gs://.../qwen3_8b

arg: "1p7b" (default) or "8b". The mesh is fsdp x tensor (tensor 4 by default; fsdp takes
the remaining devices), bfloat16 parameters and compute. These shapes are compiled ahead of
time on a simulated 8-device mesh in tests/test_sharding.py; on a laptop the config
validates only with a device count divisible by 4. The head is vocab-parallel (the vocabulary
over `tensor`), so the MTP stage's TV kernel runs on each device's [rows, V/4] block of the
logits (pallas_kernels/tv_loss/sharded.py); tests/test_tv_sharded.py compiles that training
step ahead of time on the same simulated mesh.

From the released Qwen3-8B weights (the 8b preset is its shape; the import checks every
field against config.json and places each tensor onto its sharding), with its tokenizer:

  python -m bebop_jax.main --config=configs/pod_qwen3.py:8b \
      --config.sft.init_from_hf=/ckpt/Qwen3-8B --config.data.tokenizer=/ckpt/Qwen3-8B
"""

from bebop_jax.stages import config as config_lib
from bebop_jax.model import config as model_config

_PRESETS = {"1p7b": "qwen3_1p7b", "8b": "qwen3_8b"}


def get_config(arg: str | None = None):
  size = arg or "1p7b"
  if size not in _PRESETS:
    raise ValueError(f"configs/pod_qwen3.py:{size} is not allowed: one of {sorted(_PRESETS)}")
  config = config_lib.base_config()
  config.stages = ("sft", "mtp")
  config.model.update(model_config.PRESETS[_PRESETS[size]])
  config.mesh.shape = (-1, 4)
  config.mesh.axes = ("fsdp", "tensor")
  config.data.batch_size = 256
  config.data.seq_len = 2048
  config.sft.train.num_steps = 10_000
  config.sft.train.checkpoint_every = 500
  config.sft.train.eval_every = 1000
  config.sft.optim.learning_rate = 3e-4
  config.sft.optim.warmup_steps = 500
  config.eval.batch_size = 256
  config.mtp.loss = "e2e_tv"
  config.mtp.batch_size = 64
  config.mtp.data.num_prompts = 65_536
  config.mtp.data.batch_size = 256
  config.mtp.train.num_steps = 2000
  config.mtp.train.checkpoint_every = 500
  config.mtp.optim.learning_rate = 3e-4
  config.mtp.optim.warmup_steps = 100
  return config
