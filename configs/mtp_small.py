"""MTP drafter training on the frozen sft_small policy, one loss per run (CPU, minutes).

  python -m bebop_jax.main --config=configs/mtp_small.py:loss=e2e_tv \
      --workdir=runs/mtp_small/e2e_tv
  python experiments/sweep.py --config=configs/mtp_small.py --workdir=runs/mtp_sweep  # get_sweep
  python experiments/sweep_mtp_losses.py --config=configs/mtp_small.py  # with seeds, a table

Every loss trains from the same SFT checkpoint (mtp.init_from), with freshly initialised MTP
modules, on the same cached rollouts with the same budget (steps, batch, learning rate), so
the sweep compares objectives only.
"""

from bebop_jax.stages import config as config_lib
from bebop_jax.losses.mtp import LOSSES
from bebop_jax.model import config as model_config


def get_sweep(arg: str | None = None):
  """One run per MTP objective (override dicts: dotted config keys to values)."""
  del arg
  return [{"mtp.loss": loss} for loss in LOSSES]


def get_config(arg: str | None = None):
  args = dict(a.split("=", 1) for a in arg.split(",")) if arg else {}
  config = config_lib.base_config()
  config.stages = ("mtp",)
  config.model.update(model_config.PRESETS["small"])
  # Must match configs/sft_small.py (the data the SFT stage was trained and evaluated on).
  config.data.num_train = 20_000
  config.data.num_test = 256
  config.data.batch_size = 16
  config.data.seq_len = 256
  config.data.tasks.math.weight = 2.0
  config.data.tasks.code.weight = 2.0
  config.sft.train.num_steps = 1100
  config.sft.optim.learning_rate = 4e-3
  config.sft.optim.warmup_steps = 50
  config.mtp.init_from = args.get("init_from", "runs/sft_small")
  config.mtp.loss = args.get("loss", "e2e_tv")
  # Each loss learns the drafter from scratch: the SFT's jointly trained MTP module is
  # already near-saturated on these tasks, which would hide the objectives' differences.
  config.mtp.init = "fresh"
  config.mtp.temperature = 1.0
  config.mtp.data.num_prompts = 1536
  config.mtp.data.max_new_tokens = 160
  config.mtp.data.batch_size = 64
  config.mtp.batch_size = 16
  config.mtp.optim.learning_rate = 2e-3
  config.mtp.optim.warmup_steps = 20
  config.mtp.train.num_steps = 400
  config.mtp.train.log_every = 25
  config.mtp.train.checkpoint_every = 100
  config.eval.num_examples = 64
  config.eval.batch_size = 64
  config.eval.max_new_tokens = 160
  return config
