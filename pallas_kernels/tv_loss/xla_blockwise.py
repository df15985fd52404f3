"""TV distance streamed over vocabulary blocks in plain XLA (any backend, the CPU default).

Forward, two `lax.fori_loop`s over [N, B] column blocks (`dynamic_slice`):
  1. online log-sum-exp of both logits -> lse_q, lse_p  [N];
  2. alpha = sum min(p, q) and S = sum_{q<p} q with one exp per element (`common`).
No [N, V] float32 array exists in the forward. The residuals are the inputs and the per-row
(lse_q, lse_p, S). The backward is elementwise given those (d TV/d z = -q (1[q < p] - S),
with q and the indicator recomputed from the logits), so XLA emits it as one loop fusion
whose only [N, V] buffer is the gradient itself.

On CPU, bfloat16 inputs cost one [N, V] 16-bit copy each (see `_column_block`).

When B does not divide V, the last block is shifted left to end at column V (no padding copy)
and its columns already covered by the previous block are masked out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.tv_loss import common

DEFAULT_BLOCK_SIZE = 8192


def _column_block(x: jax.Array, index: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """Block `index` of x's columns in float32, and which of its columns are new ([B] bool)."""
  vocab = x.shape[1]
  start = jnp.minimum(index * block, vocab - block)
  if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    # XLA:CPU computes bfloat16 ops in float32: slice(x) becomes slice(convert(x)) and the
    # loop-invariant convert is hoisted out of the loop, a whole [N, V] float32 copy of x.
    # Slicing the raw 16-bit patterns costs a [N, V] 16-bit copy instead (the bitcast is
    # hoisted too), half as much. TPU and GPU slice bfloat16 natively.
    bits = lax.dynamic_slice_in_dim(lax.bitcast_convert_type(x, jnp.uint16), start, block,
                                    axis=1)
    columns = lax.bitcast_convert_type(bits, jnp.bfloat16)
  else:
    columns = lax.dynamic_slice_in_dim(x, start, block, axis=1)
  columns = columns.astype(jnp.float32)
  fresh = start + jnp.arange(block) >= index * block
  return columns, fresh


def _forward(draft: jax.Array, target: jax.Array, block: int):
  """Returns (tv, lse_q, lse_p, below_mass) for [N, V] logits, the last three [N, 1]."""
  rows, vocab = draft.shape
  num_blocks = -(-vocab // block)
  ragged = vocab % block != 0
  per_row = lambda value: jnp.full((rows, 1), value, jnp.float32)

  def logsumexp_body(i, carry):
    max_q, sum_q, max_p, sum_p = carry
    z, fresh = _column_block(draft, i, block)
    t, _ = _column_block(target, i, block)
    if ragged:
      z = jnp.where(fresh, z, common.NEG_INF)
      t = jnp.where(fresh, t, common.NEG_INF)
    max_q, sum_q = common.online_logsumexp_update(max_q, sum_q, z)
    max_p, sum_p = common.online_logsumexp_update(max_p, sum_p, t)
    return max_q, sum_q, max_p, sum_p

  init = (per_row(common.NEG_INF), per_row(0.0)) * 2
  max_q, sum_q, max_p, sum_p = lax.fori_loop(0, num_blocks, logsumexp_body, init)
  lse_q = max_q + jnp.log(sum_q)
  lse_p = max_p + jnp.log(sum_p)

  def overlap_body(i, carry):
    alpha, below_mass = carry
    z, fresh = _column_block(draft, i, block)
    t, _ = _column_block(target, i, block)
    smaller, smaller_below = common.min_prob_and_below(z - lse_q, t - lse_p)
    if ragged:
      smaller = jnp.where(fresh, smaller, 0.0)
      smaller_below = jnp.where(fresh, smaller_below, 0.0)
    return (alpha + jnp.sum(smaller, axis=1, keepdims=True),
            below_mass + jnp.sum(smaller_below, axis=1, keepdims=True))

  alpha, below_mass = lax.fori_loop(0, num_blocks, overlap_body, (per_row(0.0), per_row(0.0)))
  return common.tv_from_alpha(alpha[:, 0]), lse_q, lse_p, below_mass


@functools.lru_cache(maxsize=None)
def _make_tv_distance(block: int):
  """custom_vjp TV distance for a static vocabulary block size."""

  @jax.custom_vjp
  def tv_distance_2d(draft, target):
    return _forward(draft, target, block)[0]

  def fwd(draft, target):
    tv, lse_q, lse_p, below_mass = _forward(draft, target, block)
    return tv, (draft, target, lse_q, lse_p, below_mass)

  def bwd(residuals, tv_cotangent):
    draft, target, lse_q, lse_p, below_mass = residuals
    grad = common.draft_logit_grad(draft.astype(jnp.float32) - lse_q,
                                   target.astype(jnp.float32) - lse_p,
                                   below_mass, tv_cotangent[:, None])
    return grad.astype(draft.dtype), None  # target is stop-gradient: zero cotangent

  tv_distance_2d.defvjp(fwd, bwd)
  return tv_distance_2d


def tv_distance(draft_logits: jax.Array, target_logits: jax.Array, *,
                block_size: int | None = None, interpret=False) -> jax.Array:
  """[N, V] logits -> [N] float32 TV distance; see the module docstring. `interpret` unused."""
  del interpret
  block = min(block_size or DEFAULT_BLOCK_SIZE, draft_logits.shape[1])
  return _make_tv_distance(block)(draft_logits, target_logits)
