"""TV distance as Triton-lowered Pallas kernels for GPUs (runs on CPU with interpret=True).

Forward: grid (N,), one row per program; each program loops over vocabulary blocks with
masked `plgpu.load`s (tail columns read as -inf), first for the online log-sum-exp of both
logits, then for alpha = sum min(p, q) and S = sum_{q<p} q (one exp per element, `common`), and
stores the per-row (tv, lse_q, lse_p, S). Backward: grid (N, vocab blocks), each program
recomputes q and 1[q < p] for its block from the logits and those residuals and stores its slice of
the gradient with a masked `plgpu.store`. Triton tensors must have power-of-2 sizes, so the
block size is a power of 2 and the tail is masked rather than sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tv_loss import common

DEFAULT_BLOCK_SIZE = 4096
NUM_WARPS = 8


def _load_block(ref, index: jax.Array, block: int):
  """Columns [index * block, (index + 1) * block) of a [V] row ref as float32, and the mask."""
  column = index * block + jnp.arange(block)
  inside = column < ref.shape[0]
  values = plgpu.load(ref.at[column], mask=inside, other=common.NEG_INF)
  return values.astype(jnp.float32), inside


def _row_logsumexp(draft_ref, target_ref, block: int):
  """(lse_q, lse_p) of one row, by an online log-sum-exp over its vocabulary blocks."""
  num_blocks = pl.cdiv(draft_ref.shape[0], block)

  def body(i, carry):
    max_q, sum_q, max_p, sum_p = carry
    z, _ = _load_block(draft_ref, i, block)
    t, _ = _load_block(target_ref, i, block)
    new_max_q = jnp.maximum(max_q, jnp.max(z))
    new_max_p = jnp.maximum(max_p, jnp.max(t))
    # A shift of 0 while everything seen is -inf keeps exp(-inf - -inf) out (common.py).
    shift_q = jnp.where(new_max_q == common.NEG_INF, 0.0, new_max_q)
    shift_p = jnp.where(new_max_p == common.NEG_INF, 0.0, new_max_p)
    sum_q = sum_q * jnp.exp(max_q - shift_q) + jnp.sum(jnp.exp(z - shift_q))
    sum_p = sum_p * jnp.exp(max_p - shift_p) + jnp.sum(jnp.exp(t - shift_p))
    return new_max_q, sum_q, new_max_p, sum_p

  neg_inf, zero = jnp.float32(common.NEG_INF), jnp.float32(0.0)
  max_q, sum_q, max_p, sum_p = lax.fori_loop(0, num_blocks, body, (neg_inf, zero, neg_inf, zero))
  return max_q + jnp.log(sum_q), max_p + jnp.log(sum_p)


def _row_overlap(draft_ref, target_ref, lse_q, lse_p, block: int):
  """(sum min(p, q), sum_{q<p} q) of one row under the normalisers lse_q, lse_p."""

  def body(i, carry):
    alpha, below_mass = carry
    z, _ = _load_block(draft_ref, i, block)
    t, _ = _load_block(target_ref, i, block)
    # Tail columns load as -inf in both, so they add exp(-inf) = 0 and are not below.
    smaller, smaller_below = common.min_prob_and_below(z - lse_q, t - lse_p)
    return alpha + smaller, below_mass + smaller_below

  alpha, below_mass = lax.fori_loop(
      0, pl.cdiv(draft_ref.shape[0], block), body,
      (jnp.zeros(block, jnp.float32), jnp.zeros(block, jnp.float32)))
  return jnp.sum(alpha), jnp.sum(below_mass)


def _stats_kernel(draft_ref, target_ref,  # [V] row
                  tv_ref, lse_q_ref, lse_p_ref, below_mass_ref,  # scalars
                  *, block: int):
  lse_q, lse_p = _row_logsumexp(draft_ref, target_ref, block)
  alpha, below_mass = _row_overlap(draft_ref, target_ref, lse_q, lse_p, block)
  tv_ref[...] = common.tv_from_alpha(alpha)
  lse_q_ref[...] = lse_q
  lse_p_ref[...] = lse_p
  below_mass_ref[...] = below_mass


# The two passes as kernels of their own, for a vocabulary split across devices (`sharded`).


def _logsumexp_kernel(draft_ref, target_ref, lse_q_ref, lse_p_ref, *, block: int):
  lse_q_ref[...], lse_p_ref[...] = _row_logsumexp(draft_ref, target_ref, block)


def _overlap_kernel(draft_ref, target_ref, lse_q_ref, lse_p_ref, alpha_ref, below_mass_ref,
                    *, block: int):
  alpha_ref[...], below_mass_ref[...] = _row_overlap(draft_ref, target_ref, lse_q_ref[...],
                                                     lse_p_ref[...], block)


def _grad_kernel(draft_ref, target_ref,  # [V] row
                 lse_q_ref, lse_p_ref, below_mass_ref, cotangent_ref,  # scalars
                 grad_ref,  # [V] row
                 *, block: int):
  j = pl.program_id(1)
  z, inside = _load_block(draft_ref, j, block)
  t, _ = _load_block(target_ref, j, block)
  grad = common.draft_logit_grad(z - lse_q_ref[...], t - lse_p_ref[...], below_mass_ref[...],
                                 cotangent_ref[...])
  column = j * block + jnp.arange(block)
  plgpu.store(grad_ref.at[column], grad.astype(grad_ref.dtype), mask=inside)


def _block(vocab: int, block_size: int) -> int:
  if block_size & (block_size - 1):
    raise ValueError(f"pallas_gpu block_size must be a power of 2, got {block_size}.")
  return min(block_size, pl.next_power_of_2(vocab))


_ROW = lambda vocab: pl.BlockSpec((None, vocab), lambda i, *_: (i, 0))
_SCALAR = pl.BlockSpec((None,), lambda i, *_: (i,))


def _forward(draft, target, block_size, interpret):
  rows, vocab = draft.shape
  per_row = jax.ShapeDtypeStruct((rows,), jnp.float32)
  tv, lse_q, lse_p, below_mass = pl.pallas_call(
      functools.partial(_stats_kernel, block=_block(vocab, block_size)),
      out_shape=(per_row,) * 4,
      grid=(rows,),
      in_specs=[_ROW(vocab), _ROW(vocab)],
      out_specs=(_SCALAR,) * 4,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
      interpret=interpret,
      name="tv_distance_stats",
  )(draft, target)
  return tv, (lse_q, lse_p, below_mass)


def _backward(draft, target, lse_q, lse_p, below_mass, cotangent, block_size, interpret):
  rows, vocab = draft.shape
  block = _block(vocab, block_size)
  return pl.pallas_call(
      functools.partial(_grad_kernel, block=block),
      out_shape=jax.ShapeDtypeStruct(draft.shape, draft.dtype),
      grid=(rows, pl.cdiv(vocab, block)),
      in_specs=[_ROW(vocab), _ROW(vocab)] + [_SCALAR] * 4,
      out_specs=_ROW(vocab),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
      interpret=interpret,
      name="tv_distance_grad",
  )(draft, target, lse_q, lse_p, below_mass, cotangent)


@functools.lru_cache(maxsize=None)
def _make_tv_distance(block_size: int, interpret):
  """custom_vjp TV distance for a static vocabulary block size and interpret mode."""

  @jax.custom_vjp
  def tv_distance_2d(draft, target):
    return _forward(draft, target, block_size, interpret)[0]

  def fwd(draft, target):
    tv, stats = _forward(draft, target, block_size, interpret)
    return tv, (draft, target) + stats

  def bwd(residuals, cotangent):
    grad = _backward(*residuals, cotangent, block_size, interpret)
    return grad, None  # target is stop-gradient: zero cotangent

  tv_distance_2d.defvjp(fwd, bwd)
  return tv_distance_2d


def tv_distance(draft_logits: jax.Array, target_logits: jax.Array, *,
                block_size: int | None = None, interpret=False) -> jax.Array:
  """[N, V] logits -> [N] float32 TV distance; see the module docstring."""
  return _make_tv_distance(block_size or DEFAULT_BLOCK_SIZE, interpret)(
      draft_logits, target_logits)


def _pass_call(kernel, draft, target, extra_inputs, block_size, interpret, name):
  """One program per row: two [N] float32 results; `extra_inputs` are [N] per-row inputs."""
  rows, vocab = draft.shape
  per_row = jax.ShapeDtypeStruct((rows,), jnp.float32)
  return pl.pallas_call(
      functools.partial(kernel, block=_block(vocab, block_size or DEFAULT_BLOCK_SIZE)),
      out_shape=(per_row,) * 2,
      grid=(rows,),
      in_specs=[_ROW(vocab), _ROW(vocab)] + [_SCALAR] * len(extra_inputs),
      out_specs=(_SCALAR,) * 2,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
      interpret=interpret,
      name=name,
  )(draft, target, *extra_inputs)


def logsumexp(draft_logits, target_logits, *, block_size=None, interpret=False):
  """Pass 1 on [N, V] logits: (lse_q, lse_p), each [N] float32."""
  return _pass_call(_logsumexp_kernel, draft_logits, target_logits, (), block_size, interpret,
                    "tv_distance_logsumexp")


def overlap(draft_logits, target_logits, lse_q, lse_p, *, block_size=None, interpret=False):
  """Pass 2 on [N, V] logits under given normalisers [N]: (sum min(p, q), sum_{q<p} q), [N]."""
  return _pass_call(_overlap_kernel, draft_logits, target_logits, (lse_q, lse_p), block_size,
                    interpret, "tv_distance_overlap")


def draft_grad(draft_logits, target_logits, lse_q, lse_p, below_mass, cotangent, *,
               block_size=None, interpret=False):
  """cotangent * d TV / d draft_logits, [N, V] in draft's dtype, from [N] residuals."""
  return _backward(draft_logits, target_logits, lse_q, lse_p, below_mass, cotangent,
                   block_size or DEFAULT_BLOCK_SIZE, interpret)
