"""The TV distance on a device mesh: `shard_map` over the rows and, optionally, the vocabulary.

    tv = tv_distance(d, t, mesh=mesh, spec=P(None, ("data", "fsdp"), None, "tensor"))

`spec` is the PartitionSpec of the [..., V] logits (both inputs): its leading entries split
the rows, its last entry names the mesh axes that split the vocabulary. XLA cannot partition
a Pallas custom call, so without this a sharded caller would have its logits gathered onto
every device. Here each device works on its own block of the logits:

  * rows only: each device runs the implementation's fused forward and backward on its rows;
    no communication;
  * vocabulary split over axes A (the vocab-parallel head):
      pass 1: each shard's (lse_q, lse_p) over its columns, combined over A as
              m = pmax(lse), lse = m + log psum exp(lse - m);
      pass 2: each shard's sum min(p, q) and S = sum_{q<p} q under those global
              normalisers, summed over A with psum; TV = 1 - alpha;
      backward: elementwise per shard from the per-row residuals (lse_q, lse_p, S), with
              no communication.
    The custom VJP saves only the inputs and those per-row residuals, as unsharded.

A vocabulary that the shard count does not divide is padded with -inf columns (probability 0
in both inputs: they add nothing, their gradient is 0 and is sliced off), at the cost of one
padded copy of each input. Every implementation provides the passes on their own as
`logsumexp`, `overlap` and `draft_grad`; `reference` computes them densely, so its sharded
gradient is the analytic one of `common` rather than autodiff.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import layout
from pallas_kernels.tv_loss import common


_axes = layout.axes
vocab_shards = layout.vocab_shards


def check_spec(mesh: Mesh, spec: PartitionSpec, shape: Sequence[int]) -> None:
  """Raises ValueError, naming what is wrong, unless `spec` fits [..., V] logits on `mesh`."""
  layout.check_spec(mesh, spec, shape, "tv_distance")


def local_shape(mesh: Mesh, spec: PartitionSpec, shape: Sequence[int]) -> tuple[int, int]:
  """The [rows, V] each device works on (V padded up to a multiple of the vocab shards)."""
  n = vocab_shards(mesh, spec)
  padded = tuple(shape[:-1]) + (-(-shape[-1] // n) * n,)
  local = NamedSharding(mesh, spec).shard_shape(padded)
  return math.prod(local[:-1]), local[-1]


# check_vma=False on every shard_map: the implementations' loop carries and Pallas calls are
# written for one device and carry no varying-axes types. Nothing here is differentiated
# through a collective (the vocabulary split has its own VJP), and the outputs' replication
# over the vocabulary axes holds by construction: they are psum / pmax results.


def _module(name: str):
  return importlib.import_module(f"pallas_kernels.tv_loss.{name}")


def _combine_logsumexp(lse: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """The log-sum-exp over all shards of per-shard log-sum-exps (a shard may be all -inf)."""
  top = jax.lax.pmax(lse, axes)
  shift = jnp.where(top == common.NEG_INF, 0.0, top)
  return shift + jnp.log(jax.lax.psum(jnp.exp(lse - shift), axes))


@functools.lru_cache(maxsize=None)
def _rows_only(name: str, mesh: Mesh, spec: PartitionSpec, block_size, interpret):
  """Each device runs the fused implementation on its rows (the vocabulary is whole)."""
  fn = _module(name).tv_distance

  def local(draft, target):
    batch = draft.shape[:-1]
    tv = fn(draft.reshape(-1, draft.shape[-1]), target.reshape(-1, target.shape[-1]),
            block_size=block_size, interpret=interpret)
    return tv.reshape(batch)

  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec),
                       out_specs=PartitionSpec(*spec[:-1]), check_vma=False)


@functools.lru_cache(maxsize=None)
def _vocab_split(name: str, mesh: Mesh, spec: PartitionSpec, block_size, interpret):
  """custom_vjp TV distance with the vocabulary split over spec[-1] (see the docstring)."""
  module = _module(name)
  axes = _axes(spec[-1])
  rows = PartitionSpec(*spec[:-1])
  kw = dict(block_size=block_size, interpret=interpret)
  flat = lambda x: x.reshape(-1, x.shape[-1])

  def local_forward(draft, target):
    batch = draft.shape[:-1]
    d, t = flat(draft), flat(target)
    lse_q, lse_p = module.logsumexp(d, t, **kw)
    lse_q, lse_p = _combine_logsumexp(lse_q, axes), _combine_logsumexp(lse_p, axes)
    alpha, below_mass = module.overlap(d, t, lse_q, lse_p, **kw)
    alpha, below_mass = jax.lax.psum(alpha, axes), jax.lax.psum(below_mass, axes)
    per_row = (common.tv_from_alpha(alpha), lse_q, lse_p, below_mass)
    return tuple(x.reshape(batch) for x in per_row)

  def local_backward(draft, target, lse_q, lse_p, below_mass, cotangent):
    grad = module.draft_grad(flat(draft), flat(target), lse_q.reshape(-1), lse_p.reshape(-1),
                             below_mass.reshape(-1), cotangent.reshape(-1), **kw)
    return grad.reshape(draft.shape)

  forward = jax.shard_map(local_forward, mesh=mesh, in_specs=(spec, spec),
                          out_specs=(rows,) * 4, check_vma=False)
  backward = jax.shard_map(local_backward, mesh=mesh, in_specs=(spec, spec) + (rows,) * 4,
                           out_specs=spec, check_vma=False)

  @jax.custom_vjp
  def tv_distance(draft, target):
    return forward(draft, target)[0]

  def fwd(draft, target):
    tv, *stats = forward(draft, target)
    return tv, (draft, target, *stats)

  def bwd(residuals, cotangent):
    return backward(*residuals, cotangent), None  # target is stop-gradient

  tv_distance.defvjp(fwd, bwd)
  return tv_distance


def tv_distance(name: str, draft: jax.Array, target: jax.Array, *, mesh: Mesh,
                spec: PartitionSpec, block_size: int | None = None,
                interpret: Any = False) -> jax.Array:
  """TV distance of [..., V] logits laid out by `spec` on `mesh`, with implementation `name`.

  Returns [...] float32, sharded like the logits' leading dimensions.
  """
  check_spec(mesh, spec, draft.shape)
  n, vocab = vocab_shards(mesh, spec), draft.shape[-1]
  if n == 1:
    if math.prod(mesh.shape[a] for e in spec for a in _axes(e)) == 1:  # nothing to split
      return _module(name).tv_distance(
          draft.reshape(-1, draft.shape[-1]), target.reshape(-1, target.shape[-1]),
          block_size=block_size, interpret=interpret).reshape(draft.shape[:-1])
    return _rows_only(name, mesh, spec, block_size, interpret)(draft, target)
  if vocab % n:
    pad = [(0, 0)] * (draft.ndim - 1) + [(0, -vocab % n)]
    draft = jnp.pad(draft, pad, constant_values=common.NEG_INF)
    target = jnp.pad(target, pad, constant_values=common.NEG_INF)
  return _vocab_split(name, mesh, spec, block_size, interpret)(draft, target)
