"""Math shared by the blockwise implementations (pure jnp, usable inside Pallas kernels).

Notation: q = softmax(draft logits z), p = softmax(target logits t), per row.
  alpha = sum_v min(p_v, q_v),  TV = 0.5 * sum_v |p_v - q_v| = 1 - alpha,
  S = sum_{v: q_v < p_v} q_v,  d TV / d z_u = -q_u (1[q_u < p_u] - S).
Off ties (q_v != p_v) this is the analytic gradient. At a tie the |p_v - q_v| term is not
differentiable and the indicator is taken strictly (0 at a tie), one valid subgradient:
  * a row with p == q everywhere (identical logits) gets S = 0 and gradient exactly 0, the
    same as autodiff of the dense reference (sign(0) = 0);
  * entries masked with -inf in both inputs are ties with q_v = 0 and contribute nothing;
  * a partial tie q_v == p_v > 0 in an otherwise unequal row (measure zero for real logits)
    gives -q_v (0 - S), where the reference's autodiff gives q_v * (the mean of the two
    one-sided values); both are subgradients, they differ only there.
Comparisons are made on log-probabilities (z - lse_q < t - lse_p), which never needs p or
q themselves, so the overlap pass needs one exp per element: min(p, q) = exp(min(log p,
log q)), and wherever q < p that minimum is q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def online_logsumexp_update(running_max: jax.Array, running_sum: jax.Array,
                            block: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Folds a [..., B] block of logits into a running (max, sum exp(x - max)) of shape [..., 1].

  Stays NaN-free while every logit seen so far is -inf (a masked head of the vocabulary):
  the shift is 0 then, so the exps are 0 rather than exp(-inf - -inf).
  """
  new_max = jnp.maximum(running_max, jnp.max(block, axis=-1, keepdims=True))
  shift = jnp.where(new_max == NEG_INF, 0.0, new_max)
  new_sum = (running_sum * jnp.exp(running_max - shift)
             + jnp.sum(jnp.exp(block - shift), axis=-1, keepdims=True))
  return new_max, new_sum


def below(log_q: jax.Array, log_p: jax.Array) -> jax.Array:
  """1[q_v < p_v] as float32, from log-probabilities."""
  return (log_q < log_p).astype(jnp.float32)


def min_prob_and_below(log_q: jax.Array, log_p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(min(p, q), 1[q < p] * q) elementwise, with a single exp; summed they give alpha, S."""
  smaller = jnp.exp(jnp.minimum(log_q, log_p))
  return smaller, jnp.where(log_q < log_p, smaller, 0.0)


def tv_from_alpha(alpha: jax.Array) -> jax.Array:
  """TV = 1 - alpha, clipped to [0, 1] against rounding in the sum (|error| ~ 1e-7)."""
  return jnp.clip(1.0 - alpha, 0.0, 1.0)


def draft_logit_grad(log_q: jax.Array, log_p: jax.Array, below_mass: jax.Array,
                     tv_cotangent: jax.Array) -> jax.Array:
  """g * d TV / d z = g * q (S - 1[q < p]) elementwise; S (`below_mass`) and g per row."""
  return tv_cotangent * jnp.exp(log_q) * (below_mass - below(log_q, log_p))


def dense_draft_grad(draft_logits: jax.Array, target_logits: jax.Array, lse_q: jax.Array,
                     lse_p: jax.Array, below_mass: jax.Array, cotangent: jax.Array, *,
                     block_size=None, interpret=False) -> jax.Array:
  """`draft_logit_grad` over whole [N, V] logits from [N] residuals, in draft's dtype: XLA
  emits it as one elementwise fusion. `block_size` and `interpret` are unused."""
  del block_size, interpret
  grad = draft_logit_grad(draft_logits.astype(jnp.float32) - lse_q[:, None],
                          target_logits.astype(jnp.float32) - lse_p[:, None],
                          below_mass[:, None], cotangent[:, None])
  return grad.astype(draft_logits.dtype)
