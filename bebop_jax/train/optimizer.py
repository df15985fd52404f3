"""A stage's optimizer from its typed settings (`OptimSettings`, bebop_jax/train/settings.py):
AdamW, warmup then cosine/linear/constant decay, global-norm clipping; and the parameter
subsets a stage may train."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import optax
from flax import nnx

if TYPE_CHECKING:  # train/settings.py imports this module (DECAYS, TRAINABLE)
  from bebop_jax.train.settings import OptimSettings

DECAYS = ("cosine", "linear", "constant")
TRAINABLE = ("all", "mtp", "main")


def learning_rate_schedule(optim: OptimSettings, num_steps: int) -> optax.Schedule:
  """Linear warmup to optim.learning_rate over optim.warmup_steps, then optim.decay to
  optim.learning_rate * optim.end_lr_fraction at num_steps."""
  peak = optim.learning_rate
  warmup = min(optim.warmup_steps, max(num_steps - 1, 0))
  end = peak * optim.end_lr_fraction
  rest = max(num_steps - warmup, 1)
  if optim.decay == "cosine":
    decay = optax.cosine_decay_schedule(peak, rest, alpha=optim.end_lr_fraction)
  elif optim.decay == "linear":
    decay = optax.linear_schedule(peak, end, rest)
  elif optim.decay == "constant":
    decay = optax.constant_schedule(peak)
  else:
    raise ValueError(f"optim.decay={optim.decay!r} is not allowed: one of {DECAYS}")
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(optim: OptimSettings, num_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(AdamW with clipping, its learning-rate schedule) from a stage's optimizer settings."""
  schedule = learning_rate_schedule(optim, num_steps)
  tx = optax.chain(
      optax.clip_by_global_norm(optim.clip_norm) if optim.clip_norm > 0 else optax.identity(),
      optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=1e-8,
                  weight_decay=optim.weight_decay, mask=_decay_mask),
  )
  return tx, schedule


def _decay_mask(params):
  """Weight decay on weights, not on norm scales (every norm parameter's name has 'norm')."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


def trainable_filter(trainable: str) -> nnx.filterlib.Filter:
  """The nnx filter selecting the parameters a stage trains: "all", "mtp" or "main"."""
  if trainable == "all":
    return nnx.Param
  if trainable == "mtp":
    return nnx.All(nnx.Param, nnx.PathContains("mtp"))
  if trainable == "main":
    return nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp")))
  raise ValueError(f"optim.trainable={trainable!r} is not allowed: one of {TRAINABLE}")
