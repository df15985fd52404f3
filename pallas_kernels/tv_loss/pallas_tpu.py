"""TV distance as Mosaic TPU Pallas kernels (runs on CPU with interpret=True).

Forward: one `pallas_call` over the grid (row blocks, phase, vocab blocks). Row blocks are
"parallel"; phase and vocab are "arbitrary" (sequential reductions into VMEM scratch):
  phase 0: online log-sum-exp of both logits into per-row (max, sum) scratch;
  phase 1: alpha = sum min(p, q) and S = sum_{q<p} q, one exp per element (`common`).
The per-row outputs (tv, lse_q, lse_p, S) are [N, 1] blocks resident across phase and vocab
and written at the last step. Backward: a second `pallas_call` over (row blocks, vocab
blocks), both "parallel", recomputing q and 1[q < p] per block from the logits and the residuals.
Ragged edges (V or N not a multiple of the block) are masked in-kernel, not padded:
out-of-range columns are excluded from the sums, out-of-range rows are never written back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tv_loss import common

DEFAULT_BLOCK_SIZE = 2048  # vocab columns, a multiple of 128 lanes
DEFAULT_BLOCK_ROWS = 32  # a multiple of the 8 (f32) and 16 (bf16) sublane tiles


def _load(draft_ref, target_ref, j, vocab: int, block_cols: int):
  """The [br, bv] blocks as float32, and which columns lie inside V (None: all do)."""
  z = draft_ref[...].astype(jnp.float32)
  t = target_ref[...].astype(jnp.float32)
  if vocab % block_cols == 0:
    return z, t, None
  column = j * block_cols + lax.broadcasted_iota(jnp.int32, z.shape, 1)
  return z, t, column < vocab


def _init_logsumexp(max_q, sum_q, max_p, sum_p):
  max_q[...] = jnp.full(max_q.shape, common.NEG_INF, jnp.float32)
  max_p[...] = jnp.full(max_p.shape, common.NEG_INF, jnp.float32)
  sum_q[...] = jnp.zeros(sum_q.shape, jnp.float32)
  sum_p[...] = jnp.zeros(sum_p.shape, jnp.float32)


def _logsumexp_step(z, t, inside, max_q, sum_q, max_p, sum_p):
  if inside is not None:
    z = jnp.where(inside, z, common.NEG_INF)
    t = jnp.where(inside, t, common.NEG_INF)
  max_q[...], sum_q[...] = common.online_logsumexp_update(max_q[...], sum_q[...], z)
  max_p[...], sum_p[...] = common.online_logsumexp_update(max_p[...], sum_p[...], t)


def _overlap_step(z, t, inside, lse_q, lse_p, alpha, below_mass):
  smaller, smaller_below = common.min_prob_and_below(z - lse_q, t - lse_p)
  if inside is not None:
    smaller = jnp.where(inside, smaller, 0.0)
    smaller_below = jnp.where(inside, smaller_below, 0.0)
  alpha[...] += jnp.sum(smaller, axis=1, keepdims=True)
  below_mass[...] += jnp.sum(smaller_below, axis=1, keepdims=True)


def _zero(*refs):
  for ref in refs:
    ref[...] = jnp.zeros(ref.shape, jnp.float32)


def _stats_kernel(draft_ref, target_ref,  # [br, bv] blocks
                  tv_ref, lse_q_ref, lse_p_ref, below_mass_ref,  # [br, 1] outputs
                  max_q, sum_q, max_p, sum_p, alpha, below_mass,  # [br, 1] VMEM scratch
                  *, vocab: int, block_cols: int):
  phase, j = pl.program_id(1), pl.program_id(2)
  last_j = pl.num_programs(2) - 1
  z, t, inside = _load(draft_ref, target_ref, j, vocab, block_cols)

  @pl.when((phase == 0) & (j == 0))
  def _init():
    _init_logsumexp(max_q, sum_q, max_p, sum_p)

  @pl.when(phase == 0)
  def _logsumexp():
    _logsumexp_step(z, t, inside, max_q, sum_q, max_p, sum_p)

  @pl.when((phase == 0) & (j == last_j))
  def _finish_logsumexp():  # from here on max_q / max_p hold the log-sum-exps
    max_q[...] = max_q[...] + jnp.log(sum_q[...])
    max_p[...] = max_p[...] + jnp.log(sum_p[...])
    _zero(alpha, below_mass)

  @pl.when(phase == 1)
  def _overlap():
    _overlap_step(z, t, inside, max_q[...], max_p[...], alpha, below_mass)

  @pl.when((phase == 1) & (j == last_j))
  def _finish():
    tv_ref[...] = common.tv_from_alpha(alpha[...])
    lse_q_ref[...] = max_q[...]
    lse_p_ref[...] = max_p[...]
    below_mass_ref[...] = below_mass[...]


# The two passes as kernels of their own, for a vocabulary split across devices (`sharded`):
# grid (row blocks, vocab blocks), the per-row results written at the last vocab block.


def _logsumexp_kernel(draft_ref, target_ref, lse_q_ref, lse_p_ref,  # [br, bv] in, [br, 1] out
                      max_q, sum_q, max_p, sum_p, *, vocab: int, block_cols: int):
  j = pl.program_id(1)
  z, t, inside = _load(draft_ref, target_ref, j, vocab, block_cols)

  @pl.when(j == 0)
  def _init():
    _init_logsumexp(max_q, sum_q, max_p, sum_p)

  _logsumexp_step(z, t, inside, max_q, sum_q, max_p, sum_p)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    lse_q_ref[...] = max_q[...] + jnp.log(sum_q[...])
    lse_p_ref[...] = max_p[...] + jnp.log(sum_p[...])


def _overlap_kernel(draft_ref, target_ref, lse_q_ref, lse_p_ref,  # [br, bv], [br, 1] in
                    alpha_ref, below_mass_ref,  # [br, 1] out
                    alpha, below_mass, *, vocab: int, block_cols: int):
  j = pl.program_id(1)
  z, t, inside = _load(draft_ref, target_ref, j, vocab, block_cols)

  @pl.when(j == 0)
  def _init():
    _zero(alpha, below_mass)

  _overlap_step(z, t, inside, lse_q_ref[...], lse_p_ref[...], alpha, below_mass)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    alpha_ref[...] = alpha[...]
    below_mass_ref[...] = below_mass[...]


def _grad_kernel(draft_ref, target_ref,  # [br, bv] blocks
                 lse_q_ref, lse_p_ref, below_mass_ref, cotangent_ref,  # [br, 1]
                 grad_ref):  # [br, bv]
  grad = common.draft_logit_grad(draft_ref[...].astype(jnp.float32) - lse_q_ref[...],
                                 target_ref[...].astype(jnp.float32) - lse_p_ref[...],
                                 below_mass_ref[...], cotangent_ref[...])
  grad_ref[...] = grad.astype(grad_ref.dtype)  # columns past V fall outside the array


def _blocks(shape: tuple[int, int], block_cols: int, block_rows: int) -> tuple[int, int]:
  """Block sizes clamped to the array: a full dimension is always a legal block."""
  rows, vocab = shape
  block_rows = rows if rows <= block_rows else block_rows
  if vocab <= block_cols:
    return block_rows, vocab
  if block_cols % 128:
    raise ValueError(f"pallas_tpu block_size must be a multiple of 128, got {block_cols}.")
  return block_rows, block_cols


def _forward(draft, target, block_cols, block_rows, interpret):
  rows, vocab = draft.shape
  block_rows, block_cols = _blocks(draft.shape, block_cols, block_rows)
  grid = (pl.cdiv(rows, block_rows), 2, pl.cdiv(vocab, block_cols))
  logits_spec = pl.BlockSpec((block_rows, block_cols), lambda i, phase, j: (i, j))
  row_spec = pl.BlockSpec((block_rows, 1), lambda i, phase, j: (i, 0))
  per_row = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
  tv, lse_q, lse_p, below_mass = pl.pallas_call(
      functools.partial(_stats_kernel, vocab=vocab, block_cols=block_cols),
      out_shape=(per_row,) * 4,
      grid=grid,
      in_specs=[logits_spec, logits_spec],
      out_specs=(row_spec,) * 4,
      scratch_shapes=[pltpu.VMEM((block_rows, 1), jnp.float32)] * 6,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name="tv_distance_stats",
  )(draft, target)
  return tv[:, 0], (lse_q, lse_p, below_mass)


def _backward(draft, target, lse_q, lse_p, below_mass, cotangent, block_cols, block_rows,
              interpret):
  rows, vocab = draft.shape
  block_rows, block_cols = _blocks(draft.shape, block_cols, block_rows)
  logits_spec = pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j))
  row_spec = pl.BlockSpec((block_rows, 1), lambda i, j: (i, 0))
  return pl.pallas_call(
      _grad_kernel,
      out_shape=jax.ShapeDtypeStruct(draft.shape, draft.dtype),
      grid=(pl.cdiv(rows, block_rows), pl.cdiv(vocab, block_cols)),
      in_specs=[logits_spec, logits_spec] + [row_spec] * 4,
      out_specs=logits_spec,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
      name="tv_distance_grad",
  )(draft, target, lse_q, lse_p, below_mass, cotangent[:, None])


@functools.lru_cache(maxsize=None)
def _make_tv_distance(block_cols: int, block_rows: int, interpret):
  """custom_vjp TV distance for static block sizes and interpret mode."""

  @jax.custom_vjp
  def tv_distance_2d(draft, target):
    return _forward(draft, target, block_cols, block_rows, interpret)[0]

  def fwd(draft, target):
    tv, stats = _forward(draft, target, block_cols, block_rows, interpret)
    return tv, (draft, target) + stats

  def bwd(residuals, cotangent):
    grad = _backward(*residuals, cotangent, block_cols, block_rows, interpret)
    return grad, None  # target is stop-gradient: zero cotangent

  tv_distance_2d.defvjp(fwd, bwd)
  return tv_distance_2d


def tv_distance(draft_logits: jax.Array, target_logits: jax.Array, *,
                block_size: int | None = None, block_rows: int = DEFAULT_BLOCK_ROWS,
                interpret=False) -> jax.Array:
  """[N, V] logits -> [N] float32 TV distance; see the module docstring."""
  return _make_tv_distance(block_size or DEFAULT_BLOCK_SIZE, block_rows, interpret)(
      draft_logits, target_logits)


def _pass_call(kernel, draft, target, extra_inputs, num_scratch, block_size, block_rows,
               interpret, name):
  """One pass over (row blocks, vocab blocks): two [N] float32 results; `extra_inputs` are
  [N] per-row inputs, `num_scratch` the kernel's [br, 1] VMEM accumulators."""
  rows, vocab = draft.shape
  block_rows, block_cols = _blocks(draft.shape, block_size or DEFAULT_BLOCK_SIZE, block_rows)
  logits_spec = pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j))
  row_spec = pl.BlockSpec((block_rows, 1), lambda i, j: (i, 0))
  per_row = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
  outs = pl.pallas_call(
      functools.partial(kernel, vocab=vocab, block_cols=block_cols),
      out_shape=(per_row,) * 2,
      grid=(pl.cdiv(rows, block_rows), pl.cdiv(vocab, block_cols)),
      in_specs=[logits_spec, logits_spec] + [row_spec] * len(extra_inputs),
      out_specs=(row_spec,) * 2,
      scratch_shapes=[pltpu.VMEM((block_rows, 1), jnp.float32)] * num_scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name=name,
  )(draft, target, *[x[:, None] for x in extra_inputs])
  return tuple(o[:, 0] for o in outs)


def logsumexp(draft_logits, target_logits, *, block_size=None,
              block_rows: int = DEFAULT_BLOCK_ROWS, interpret=False):
  """Pass 1 on [N, V] logits: (lse_q, lse_p), each [N] float32."""
  return _pass_call(_logsumexp_kernel, draft_logits, target_logits, (), 4, block_size,
                    block_rows, interpret, "tv_distance_logsumexp")


def overlap(draft_logits, target_logits, lse_q, lse_p, *, block_size=None,
            block_rows: int = DEFAULT_BLOCK_ROWS, interpret=False):
  """Pass 2 on [N, V] logits under given normalisers [N]: (sum min(p, q), sum_{q<p} q), [N]."""
  return _pass_call(_overlap_kernel, draft_logits, target_logits, (lse_q, lse_p), 2,
                    block_size, block_rows, interpret, "tv_distance_overlap")


def draft_grad(draft_logits, target_logits, lse_q, lse_p, below_mass, cotangent, *,
               block_size=None, block_rows: int = DEFAULT_BLOCK_ROWS, interpret=False):
  """cotangent * d TV / d draft_logits, [N, V] in draft's dtype, from [N] residuals."""
  return _backward(draft_logits, target_logits, lse_q[:, None], lse_p[:, None],
                   below_mass[:, None], cotangent, block_size or DEFAULT_BLOCK_SIZE,
                   block_rows, interpret)
