"""The quickstart: SFT -> MTP drafter training (e2e-TV) -> GRPO on speculative rollouts ->
evaluation and report, in under ten minutes on two CPU cores (docs/main_job.md has the
times).

  python -m bebop_jax.main --config=configs/quickstart.py --workdir=runs/quickstart

SFT of the ~1M-parameter `small_deep` policy on math and code (640 steps of 8 packed rows),
MTP training with the end-to-end TV loss on the frozen policy's own rollouts, 40 GRPO steps
on speculative rollouts with the drafter frozen, then the final policy's speculative against
autoregressive decoding and the report. Held-out pass@1 is measured on 384 prompts per task
before and after RL, paired. Writes <workdir>/report.md, summary.json and plots/. Each stage
is skipped when complete and resumed from its last checkpoint when interrupted: rerun the
same command. configs/laptop.py runs the same stages at about 2.5 times the budget, with the
multi-turn agentic task as well.
"""

from bebop_jax.stages import config as config_lib
from bebop_jax.model import config as model_config


def get_config(arg: str | None = None):
  del arg
  config = config_lib.base_config()
  config.stages = ("sft", "mtp", "rl", "eval")
  config.model.update(model_config.PRESETS["small_deep"])
  config.data.num_train = 12_000
  config.data.num_test = 384
  config.data.batch_size = 8
  config.data.seq_len = 256
  config.data.tasks.agentic.weight = 0.0  # math and code only (configs/laptop.py has all 3)
  # SFT: 640 steps of 8 rows (about 1.3M tokens).
  config.sft.train.num_steps = 640
  config.sft.train.log_every = 50
  config.sft.train.checkpoint_every = 160
  config.sft.optim.learning_rate = 3e-3
  config.sft.optim.warmup_steps = 50
  config.sft.mtp_loss_weight = 0.3
  # MTP: e2e-TV on 256 self-distilled rollouts at temperature 1, starting from the MTP
  # module SFT trained jointly.
  config.mtp.loss = "e2e_tv"
  config.mtp.temperature = 1.0
  config.mtp.eval_modes = ("rejection",)
  config.mtp.data.num_prompts = 256
  config.mtp.data.max_new_tokens = 160
  config.mtp.data.batch_size = 64
  config.mtp.batch_size = 16
  config.mtp.train.num_steps = 20
  config.mtp.train.log_every = 10
  config.mtp.train.checkpoint_every = 10
  config.mtp.optim.learning_rate = 1e-3
  config.mtp.optim.warmup_steps = 10
  # RL: 40 GRPO steps of 16 unseen prompts x 8 rollouts (speculative, rejection sampling,
  # temperature 1), two policy updates per step, the drafter frozen; held-out evaluation on
  # all 384 test prompts per task before and after.
  config.rl.prompts_per_batch = 16
  config.rl.group_size = 8
  config.rl.minibatches = 2
  config.rl.rollout.batch_size = 128  # a step's 128 rollouts in one call
  config.rl.optim.learning_rate = 1e-4
  config.rl.train.num_steps = 40
  config.rl.train.eval_every = 40
  config.rl.train.checkpoint_every = 20
  config.rl.eval.num_examples = 384
  config.rl.eval.modes = ("rejection",)
  # Evaluation of the final policy: decode speed at batch 1, acceptance against entropy at
  # temperature 1.
  config.eval.num_examples = 32
  config.eval.batch_size = 64
  config.eval.max_new_tokens = 160
  config.eval.temperatures = (1.0,)
  # Math prompts are 16-18 tokens, code prompts 49-102, whole rollouts under 512: two
  # prompt buckets, half the decoding programs the default's would compile for these.
  config.eval.prompt_buckets = (32, 128, 512)
  config.report.batch_sizes = (1,)
  config.report.num_prompts = 8
  config.report.repeats = 2
  config.report.entropy_temperatures = (1.0,)
  return config
