"""The laptop run: the quickstart's four stages at about 2.5 times its budget (about 22
minutes on two CPU cores): SFT -> MTP drafter training (e2e-TV) -> GRPO on speculative
rollouts -> evaluation and report.

  python -m bebop_jax.main --config=configs/laptop.py --workdir=runs/laptop

SFT of the ~1M-parameter `small_deep` policy for 800 steps on the three synthetic tasks
(math, code and the multi-turn agentic task), MTP training with the end-to-end TV loss on the
frozen policy's own rollouts, 80 GRPO steps with the drafter frozen, then speculative against
autoregressive decoding and the report (docs/main_job.md has the times). Writes
<workdir>/report.md, summary.json and plots/. Each stage is skipped when complete and
resumed from its last checkpoint when interrupted: rerun the same command.
"""

from bebop_jax.stages import config as config_lib
from bebop_jax.model import config as model_config


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("sft", "mtp", "rl", "eval")
  config.model.update(model_config.PRESETS["small_deep"])
  config.data.num_train = 20_000
  config.data.num_test = 256
  config.data.batch_size = 16
  config.data.seq_len = 256
  config.data.tasks.math.weight = 2.0
  config.data.tasks.code.weight = 2.0
  # SFT: 800 steps (configs/sft_small.py trains the 4-layer preset for 1100).
  config.sft.train.num_steps = 800
  config.sft.train.log_every = 25
  config.sft.train.checkpoint_every = 100
  config.sft.optim.learning_rate = 4e-3
  config.sft.optim.warmup_steps = 40
  config.sft.mtp_loss_weight = 0.3
  # MTP: e2e-TV on 1024 self-distilled rollouts at temperature 1, starting from the MTP
  # module SFT trained jointly.
  config.mtp.loss = "e2e_tv"
  config.mtp.temperature = 1.0
  config.mtp.data.num_prompts = 1024
  config.mtp.data.max_new_tokens = 160
  config.mtp.data.batch_size = 64
  config.mtp.batch_size = 16
  config.mtp.train.num_steps = 200
  config.mtp.train.log_every = 25
  config.mtp.train.checkpoint_every = 50
  config.mtp.optim.learning_rate = 1e-3
  config.mtp.optim.warmup_steps = 20
  # RL: 80 GRPO steps of 16 unseen prompts x 8 rollouts (speculative, rejection sampling,
  # temperature 1), two policy updates per step, the drafter frozen; held-out evaluation on
  # all 256 test prompts per task before, at step 40 and after.
  config.rl.prompts_per_batch = 16
  config.rl.group_size = 8
  config.rl.minibatches = 2
  config.rl.rollout.batch_size = 64
  config.rl.optim.learning_rate = 1e-4
  config.rl.train.num_steps = 80
  config.rl.train.eval_every = 40
  config.rl.train.checkpoint_every = 20
  config.rl.eval.num_examples = 256
  # Evaluation: pass@1 on 64 held-out prompts per task.
  config.eval.num_examples = 64
  config.eval.batch_size = 64
  config.eval.max_new_tokens = 160
  config.eval.temperatures = (1.0,)
  config.report.batch_sizes = (1, 8)
  config.report.num_prompts = 48
  config.report.repeats = 3
  return config
