"""Dense truth: both softmaxes materialized in float32, TV = 0.5 * sum_v |p_v - q_v|.

`logsumexp`, `overlap` and `draft_grad` are the same math as dense pieces, for a vocabulary
split across devices (`sharded`); there the gradient is the analytic one of `common`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tv_loss import common


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


def logsumexp(draft_logits, target_logits, *, block_size=None, interpret=False):
  """(lse_q, lse_p) of [N, V] logits, each [N] float32."""
  del block_size, interpret
  return (jax.nn.logsumexp(draft_logits.astype(jnp.float32), axis=-1),
          jax.nn.logsumexp(target_logits.astype(jnp.float32), axis=-1))


def overlap(draft_logits, target_logits, lse_q, lse_p, *, block_size=None, interpret=False):
  """(sum min(p, q), sum_{q<p} q) per row of [N, V] logits under normalisers [N]."""
  del block_size, interpret
  q = jnp.exp(draft_logits.astype(jnp.float32) - lse_q[:, None])
  p = jnp.exp(target_logits.astype(jnp.float32) - lse_p[:, None])
  return jnp.sum(jnp.minimum(p, q), axis=-1), jnp.sum(jnp.where(q < p, q, 0.0), axis=-1)


draft_grad = common.dense_draft_grad
