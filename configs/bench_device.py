"""The accelerator benchmark's decoding policy (experiments/bench_device.sh).

  python experiments/bench_decode.py --config=configs/bench_device.py:qwen3_0p6b --random_init

`qwen3_0p6b` (default): a randomly initialised policy of Qwen3-0.6B's shape with one MTP
module, in bfloat16; `tiny`: the test preset, for the script's CPU mode. Prompts are the
synthetic tasks' (character tokens, a small part of the 151,936-entry vocabulary).
"""

from bebop_jax.stages import config as config_lib
from bebop_jax.model import config as model_config

SIZES = ("qwen3_0p6b", "tiny")


def get_config(arg: str | None = None):
  size = arg or "qwen3_0p6b"
  if size not in SIZES:
    raise ValueError(f"configs/bench_device.py:{size} is not allowed: one of {SIZES}")
  config = config_lib.base_config()
  config.model.update(model_config.PRESETS[size])
  config.data.num_train = 64
  config.data.num_test = 64
  config.eval.max_new_tokens = 64
  return config
