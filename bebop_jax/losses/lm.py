"""Next-token cross-entropy of the main model and of the MTP chain (SFT losses).

Batches follow bebop_jax.data.pipeline: `loss_mask[t]` says token t is a training target.
The main model's logits at i predict x_{i+1}; MTP depth k at i predicts x_{i+k+1}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bebop_jax.model.model import shift_left


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """-log softmax(logits)[target] per position; logits [..., V], targets [...] int."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def sft_loss(out: dict[str, jax.Array], tokens: jax.Array, loss_mask: jax.Array,
             mtp_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Main next-token CE on target tokens, plus mtp_weight * mean over depths of MTP CE.

  Args:
    out: the teacher-forced forward's outputs (bebop_jax.model.model.Policy.__call__).
    tokens: [B, T]; loss_mask: [B, T] (1 = token is a target).
  Returns:
    (loss, metrics): metrics has ce, accuracy, num_targets and, with the MTP chain,
    mtp_ce_k and teacher-forced acceptance mtp_alpha_k = sum_v min(p_{i+k}, q_i^k) per depth.
  """
  targets = shift_left(tokens, 1)
  mask = out["mask"] & (shift_left(loss_mask, 1) > 0)
  ce = _masked_mean(token_cross_entropy(out["logits"], targets), mask)
  acc = _masked_mean(jnp.argmax(out["logits"], -1) == targets, mask)
  metrics = {"ce": ce, "accuracy": acc, "num_targets": jnp.sum(mask)}
  loss = ce
  if "mtp_logits" in out and mtp_weight > 0:
    p = jax.nn.softmax(jax.lax.stop_gradient(out["logits"]), axis=-1)
    depth_ce = []
    for k in range(out["mtp_logits"].shape[0]):
      mask_k = out["mtp_mask"][k] & (shift_left(loss_mask, k + 2) > 0)
      ce_k = _masked_mean(token_cross_entropy(out["mtp_logits"][k], shift_left(tokens, k + 2)),
                          mask_k)
      q = jax.nn.softmax(out["mtp_logits"][k], axis=-1)
      p_target = shift_left_axis1(p, k + 1)  # depth k+1 at i targets p_{i+k+1}
      alpha = jnp.sum(jnp.minimum(p_target, q), axis=-1)
      metrics[f"mtp_ce_{k + 1}"] = ce_k
      metrics[f"mtp_alpha_{k + 1}"] = _masked_mean(jax.lax.stop_gradient(alpha), mask_k)
      depth_ce.append(ce_k)
    loss = loss + mtp_weight * jnp.mean(jnp.stack(depth_ce))
  metrics["loss"] = loss
  return loss, metrics


def shift_left_axis1(x: jax.Array, k: int) -> jax.Array:
  """x[:, i + k] at i along axis 1 (zeros past the end), for arrays [B, T, ...]."""
  pad = jnp.zeros((x.shape[0], k) + x.shape[2:], x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)
