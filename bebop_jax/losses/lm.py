"""Next-token cross-entropy of the main model and of the MTP chain (SFT losses).

Batches follow bebop_jax.data.pipeline: `loss_mask[t]` says token t is a training target.
The main model's logits at i predict x_{i+1}; MTP depth k at i predicts x_{i+k+1}.
The forward's outputs decide the head (losses/head.py): with logits (dense), or with
final-normed hidden states and the head (fused: no [B, T, V] or [K, B, T, V] logits; the
chain's terms through losses.mtp's fused path). Both give the same loss, metrics and
gradients (tests/test_sft.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bebop_jax.losses import head as head_lib
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.losses.head import shift_left_axis1, token_cross_entropy
from bebop_jax.model.model import shift_left


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sft_loss(out: dict[str, jax.Array], tokens: jax.Array, loss_mask: jax.Array,
             mtp_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Main next-token CE on target tokens, plus mtp_weight * mean over depths of MTP CE.

  Args:
    out: the teacher-forced forward's outputs (bebop_jax.model.model.Policy.__call__), with
      logits (the dense head) or, from `logits=False`, final-normed hidden states and the
      head (the fused head).
    tokens: [B, T]; loss_mask: [B, T] (1 = token is a target).
  Returns:
    (loss, metrics): metrics has ce, accuracy (the target is an argmax of the logits; at a
    tie, any of the tied tokens counts), num_targets and, with the MTP chain, mtp_ce_k and
    teacher-forced acceptance mtp_alpha_k = sum_v min(p_{i+k}, q_i^k) per depth.
  """
  targets = shift_left(tokens, 1)
  mask = out["mask"] & (shift_left(loss_mask, 1) > 0)
  terms = head_lib.next_token_terms(out, targets)
  ce = _masked_mean(-terms["logprob"], mask)
  acc = _masked_mean(jax.lax.stop_gradient(terms["logprob"]) >= terms["max_logprob"], mask)
  metrics = {"ce": ce, "accuracy": acc, "num_targets": jnp.sum(mask)}
  loss = ce
  if "mtp_normed" in out and mtp_weight > 0:
    # The chain's CE (the mean over depths, as below) with its acceptance as a metric.
    mtp_ce, m = mtp_losses.mtp_loss(out, tokens, loss_mask, loss="ce")
    for k in range(out["mtp_mask"].shape[0]):
      metrics[f"mtp_ce_{k + 1}"] = m[f"ce_{k + 1}"]
      metrics[f"mtp_alpha_{k + 1}"] = m[f"alpha_{k + 1}"]
    loss = loss + mtp_weight * mtp_ce
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

