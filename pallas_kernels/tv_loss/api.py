"""Dispatch for the TV distance: pick an implementation, fall back to XLA if a kernel fails.

    tv = tv_distance(draft_logits, target_logits)            # best for the backend
    tv = tv_distance(d, t, implementation="pallas_tpu", interpret=True)   # CPU testing
    tv = tv_distance(d, t, mesh=mesh, spec=P("data", None, "tensor"))     # sharded
    alpha = 1.0 - tv                                          # what the MTP losses use

Every implementation returns the same value and the same gradient (see `common` for the
gradient and its choice at ties p_v == q_v); the target logits are always treated as a
constant (stop-gradient): their gradient is exactly zero.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from pallas_kernels import layout
from pallas_kernels.tv_loss import sharded

IMPLEMENTATIONS = layout.IMPLEMENTATIONS
FALLBACK = layout.FALLBACK
_BACKEND_DEFAULT = layout.BACKEND_DEFAULT
_warned_fallbacks: set[str] = set()


def _implementation_fn(name: str):
  """The module-level `tv_distance` of `pallas_kernels.tv_loss.<name>` (imported lazily)."""
  return importlib.import_module(f"pallas_kernels.tv_loss.{name}").tv_distance


@functools.lru_cache(maxsize=None)
def _compile_error(name: str, shape: tuple[int, int], draft_dtype, target_dtype,
                   block_size: int | None, split: bool = False) -> str | None:
  """Lowers and compiles forward + backward of `name` at this shape (`split`: its separate
  passes, as a vocabulary-split mesh runs them); the error text or None."""
  if split:
    module = importlib.import_module(f"pallas_kernels.tv_loss.{name}")

    def loss(d, t):
      lse_q, lse_p = module.logsumexp(d, t, block_size=block_size)
      alpha, below_mass = module.overlap(d, t, lse_q, lse_p, block_size=block_size)
      return jnp.sum(alpha), module.draft_grad(d, t, lse_q, lse_p, below_mass, alpha,
                                               block_size=block_size)
  else:
    fn = _implementation_fn(name)
    loss = jax.value_and_grad(lambda d, t: jnp.sum(fn(d, t, block_size=block_size)))
  try:
    jax.jit(loss).lower(
        jax.ShapeDtypeStruct(shape, draft_dtype),
        jax.ShapeDtypeStruct(shape, target_dtype)).compile()
  except Exception as e:  # pylint: disable=broad-except  # any lowering/compile failure
    return f"{type(e).__name__}: {e}"
  return None


def _pick_implementation(shape, draft_dtype, target_dtype, block_size, interpret,
                         split: bool = False) -> str:
  name = _BACKEND_DEFAULT.get(jax.default_backend(), FALLBACK)
  if name == FALLBACK or interpret:
    return name
  error = _compile_error(name, shape, draft_dtype, target_dtype, block_size, split)
  if error is None:
    return name
  if name not in _warned_fallbacks:
    _warned_fallbacks.add(name)
    logging.warning("tv_distance: %s failed to lower/compile for %s %s/%s (%s); "
                    "falling back to %s.", name, shape, draft_dtype, target_dtype,
                    error.splitlines()[0][:500], FALLBACK)
  return FALLBACK


def tv_distance(draft_logits: jax.Array, target_logits: jax.Array, *,
                implementation: str | None = None, block_size: int | None = None,
                interpret: Any = False, mesh: jax.sharding.Mesh | None = None,
                spec: jax.sharding.PartitionSpec | None = None) -> jax.Array:
  """Total-variation distance 0.5 * sum_v |p_v - q_v| per row, in float32.

  Args:
    draft_logits: [..., V] logits of q = softmax(draft_logits); float32 or bfloat16.
    target_logits: [..., V] logits of p = softmax(target_logits), same shape, any float
      dtype. Stop-gradient: its gradient is exactly zero.
    implementation: one of IMPLEMENTATIONS, or None for the backend's best (tpu:
      pallas_tpu, gpu: pallas_gpu, cpu: xla_blockwise); a kernel that fails to lower or
      compile at this shape falls back to xla_blockwise with a warning logged once.
    block_size: vocabulary columns per block (None: the implementation's default).
    interpret: passed to every `pallas_call` (True, or a Pallas InterpretParams) to run
      the Pallas kernels on CPU.
    mesh, spec: run on `mesh` with both logits laid out by the PartitionSpec `spec` (one
      entry per dimension; the last splits the vocabulary): `sharded` wraps the
      implementation in shard_map, so each device works on its own rows and columns. None
      (the default): one program over the whole arrays.

  Returns:
    [...] float32 TV in [0, 1]. Logits of -inf are masked entries (probability 0); each
    row needs a finite logit in both inputs. Differentiable in draft_logits (custom VJP
    with the analytic gradient, recomputing blocks; only per-row residuals are saved).
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown tv_distance implementation {implementation!r}; "
                     f"expected one of {IMPLEMENTATIONS} or None.")
  if block_size is not None and block_size < 1:
    raise ValueError(f"block_size must be positive, got {block_size}.")
  if draft_logits.shape != target_logits.shape or draft_logits.ndim < 1:
    raise ValueError(f"draft and target logits must have one shape [..., V]; got "
                     f"{draft_logits.shape} and {target_logits.shape}.")
  if (mesh is None) != (spec is None):
    raise ValueError("tv_distance needs both mesh and spec to run sharded, or neither; got "
                     f"mesh={mesh}, spec={spec}.")
  if mesh is not None:
    sharded.check_spec(mesh, spec, draft_logits.shape)
    if implementation is None:
      implementation = _pick_implementation(
          sharded.local_shape(mesh, spec, draft_logits.shape), draft_logits.dtype,
          target_logits.dtype, block_size, interpret,
          split=sharded.vocab_shards(mesh, spec) > 1)
    return sharded.tv_distance(implementation, draft_logits, target_logits, mesh=mesh,
                               spec=spec, block_size=block_size, interpret=interpret)
  *batch, vocab = draft_logits.shape
  shape = (math.prod(batch), vocab)
  draft_2d = draft_logits.reshape(shape)
  target_2d = target_logits.reshape(shape)
  if implementation is None:
    implementation = _pick_implementation(shape, draft_2d.dtype, target_2d.dtype,
                                          block_size, interpret)
  tv = _implementation_fn(implementation)(draft_2d, target_2d, block_size=block_size,
                                           interpret=interpret)
  return tv.reshape(batch)
