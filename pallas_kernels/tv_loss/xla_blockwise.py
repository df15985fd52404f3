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


def _per_row(rows: int, value: float) -> jax.Array:
  return jnp.full((rows, 1), value, jnp.float32)


def _logsumexp(draft: jax.Array, target: jax.Array, block: int):
  """Pass 1: (lse_q, lse_p), each [N, 1], by an online log-sum-exp over column blocks."""
  rows, vocab = draft.shape
  ragged = vocab % block != 0

  def body(i, carry):
    max_q, sum_q, max_p, sum_p = carry
    z, fresh = _column_block(draft, i, block)
    t, _ = _column_block(target, i, block)
    if ragged:
      z = jnp.where(fresh, z, common.NEG_INF)
      t = jnp.where(fresh, t, common.NEG_INF)
    max_q, sum_q = common.online_logsumexp_update(max_q, sum_q, z)
    max_p, sum_p = common.online_logsumexp_update(max_p, sum_p, t)
    return max_q, sum_q, max_p, sum_p

  init = (_per_row(rows, common.NEG_INF), _per_row(rows, 0.0)) * 2
  max_q, sum_q, max_p, sum_p = lax.fori_loop(0, -(-vocab // block), body, init)
  return max_q + jnp.log(sum_q), max_p + jnp.log(sum_p)


def _overlap(draft: jax.Array, target: jax.Array, lse_q: jax.Array, lse_p: jax.Array,
             block: int):
  """Pass 2: (alpha, S), each [N, 1], under the normalisers lse_q, lse_p ([N, 1])."""
  rows, vocab = draft.shape
  ragged = vocab % block != 0

  def body(i, carry):
    alpha, below_mass = carry
    z, fresh = _column_block(draft, i, block)
    t, _ = _column_block(target, i, block)
    smaller, smaller_below = common.min_prob_and_below(z - lse_q, t - lse_p)
    if ragged:
      smaller = jnp.where(fresh, smaller, 0.0)
      smaller_below = jnp.where(fresh, smaller_below, 0.0)
    return (alpha + jnp.sum(smaller, axis=1, keepdims=True),
            below_mass + jnp.sum(smaller_below, axis=1, keepdims=True))

  init = (_per_row(rows, 0.0), _per_row(rows, 0.0))
  return lax.fori_loop(0, -(-vocab // block), body, init)


def _forward(draft: jax.Array, target: jax.Array, block: int):
  """Returns (tv, lse_q, lse_p, below_mass) for [N, V] logits, the last three [N, 1]."""
  lse_q, lse_p = _logsumexp(draft, target, block)
  alpha, below_mass = _overlap(draft, target, lse_q, lse_p, block)
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
    grad = common.dense_draft_grad(draft, target, lse_q[:, 0], lse_p[:, 0], below_mass[:, 0],
                                   tv_cotangent)
    return grad, None  # target is stop-gradient: zero cotangent

  tv_distance_2d.defvjp(fwd, bwd)
  return tv_distance_2d


def tv_distance(draft_logits: jax.Array, target_logits: jax.Array, *,
                block_size: int | None = None, interpret=False) -> jax.Array:
  """[N, V] logits -> [N] float32 TV distance; see the module docstring. `interpret` unused."""
  del interpret
  return _make_tv_distance(_block(draft_logits, block_size))(draft_logits, target_logits)


def _block(x: jax.Array, block_size: int | None) -> int:
  return min(block_size or DEFAULT_BLOCK_SIZE, x.shape[1])


# The passes on their own, for a vocabulary split across devices (`sharded`): the caller
# combines the per-shard log-sum-exps and sums across shards in between. Rows are [N].


def logsumexp(draft_logits, target_logits, *, block_size=None, interpret=False):
  """Pass 1 on [N, V] logits: (lse_q, lse_p), each [N] float32. `interpret` unused."""
  del interpret
  lse_q, lse_p = _logsumexp(draft_logits, target_logits, _block(draft_logits, block_size))
  return lse_q[:, 0], lse_p[:, 0]


def overlap(draft_logits, target_logits, lse_q, lse_p, *, block_size=None, interpret=False):
  """Pass 2 on [N, V] logits under given normalisers [N]: (sum min(p, q), sum_{q<p} q), [N]."""
  del interpret
  alpha, below_mass = _overlap(draft_logits, target_logits, lse_q[:, None], lse_p[:, None],
                               _block(draft_logits, block_size))
  return alpha[:, 0], below_mass[:, 0]


draft_grad = common.dense_draft_grad
