"""Dense truth: both softmaxes materialized in float32, TV = 0.5 * sum_v |p_v - q_v|."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tv_distance(draft_logits: jax.Array, target_logits: jax.Array, *,
                block_size: int | None = None, interpret=False) -> jax.Array:
  """Per-row TV distance of softmax(target_logits) and softmax(draft_logits).

  Args:
    draft_logits: [N, V] logits of the draft distribution q (any float dtype).
    target_logits: [N, V] logits of the target distribution p; treated as a constant
      (stop-gradient), so its gradient is exactly zero.
    block_size: unused (dense); accepted so every implementation has one signature.
    interpret: unused.

  Returns:
    [N] float32, in [0, 1]. Gradients come from plain autodiff, so at a tie p_v == q_v the
    |p_v - q_v| term contributes sign(0) = 0.
  """
  del block_size, interpret
  q = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
  p = jax.nn.softmax(jax.lax.stop_gradient(target_logits).astype(jnp.float32), axis=-1)
  return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
