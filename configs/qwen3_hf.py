"""SFT -> MTP drafter training (e2e-TV) -> GRPO, starting from a Hugging Face Qwen3 checkpoint.

  python -m bebop_jax.main --config=configs/qwen3_hf.py:/ckpt/Qwen3-0.6B --workdir=runs/q06

arg: a checkpoint directory with config.json, the safetensors weights and tokenizer.json
(architecture Qwen3ForCausalLM; bebop_jax.model.hf). config.model is the checkpoint's
decoder as its config.json describes it, with one MTP module chained over K = 3 depths: the
MTP module saved beside the weights by `hf.export_checkpoint` when the directory has one,
otherwise a fresh module (`--config.sft.hf_mtp=copy_last_block` starts its block from the
last decoder layer). The tokenizer is the checkpoint's tokenizer.json, with the task markers
added as special tokens, so the synthetic tasks, rollouts and rewards all run on the
checkpoint's vocabulary.

The step counts and batches here are small, for a small checkpoint on one device. On a pod,
set the mesh and the scale as configs/pod_qwen3.py does, e.g. for Qwen3-8B:

  python -m bebop_jax.main --config=configs/qwen3_hf.py:/ckpt/Qwen3-8B \\
      --config.mesh.shape=-1,4 --config.mesh.axes=fsdp,tensor \\
      --config.data.batch_size=256 --config.data.seq_len=2048 --config.model.dtype=bfloat16
"""

import os

from bebop_jax.stages import config as config_lib
from bebop_jax.model import hf


def get_config(arg: str | None = None):
  if not arg:
    raise ValueError("configs/qwen3_hf.py needs a checkpoint directory: "
                     "--config=configs/qwen3_hf.py:/path/to/checkpoint")
  path = os.path.abspath(os.path.expanduser(arg))
  config_json = os.path.join(path, "config.json")
  if not os.path.exists(config_json):
    raise ValueError(f"configs/qwen3_hf.py:{arg}: {config_json} does not exist (a Hugging "
                     "Face checkpoint directory holds config.json, *.safetensors and "
                     "tokenizer.json)")
  config = config_lib.base_config()
  config.stages = ("sft", "mtp", "rl")
  config.model.update(hf.model_fields(path, num_mtp_modules=1, num_draft_steps=3))
  config.data.tokenizer = path
  config.sft.init_from_hf = path
  config.sft.hf_mtp = "auto"

  config.data.num_train = 4096
  config.data.num_test = 64
  config.data.batch_size = 8
  config.data.seq_len = 256
  config.sft.train.num_steps = 100
  config.sft.train.log_every = 20
  config.sft.train.checkpoint_every = 50
  config.sft.optim.learning_rate = 1e-3
  config.sft.optim.warmup_steps = 10
  config.mtp.data.num_prompts = 128
  config.mtp.data.max_new_tokens = 96
  config.mtp.batch_size = 8
  config.mtp.train.num_steps = 50
  config.mtp.train.checkpoint_every = 25
  config.rl.prompts_per_batch = 4
  config.rl.group_size = 4
  config.rl.train.num_steps = 4
  config.rl.train.eval_every = 0
  config.rl.train.checkpoint_every = 2
  config.rl.eval.num_examples = 16
  config.eval.num_examples = 16
  config.eval.max_new_tokens = 96
  return config
