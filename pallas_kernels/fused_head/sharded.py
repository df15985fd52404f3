"""The fused head on a device mesh: `shard_map` over the rows and, optionally, the vocabulary.

    out = fused_head(h, W, target_hidden=hp, tokens=x, mesh=mesh,
                     spec=P(None, "data", None, "tensor"))

`spec` is the PartitionSpec of the logits [..., V] the head would produce (the same spec as
tv_loss takes, e.g. `sharding.current_spec(LOGITS_AXES, shape)`): its leading entries split
the rows, its last entry names the mesh axes that split the vocabulary. From it the draft
hidden states [..., d] are laid out P(*spec[:-1], None), the head [d, V] P(None, spec[-1]),
the bias [V] P(spec[-1]), tokens [...] P(*spec[:-1]), the target hidden states (or logits)
by the entries of their own trailing dimensions. Each device works on its block:

  pass 1: each shard's per-row (lse_q, H, z_tok, lse_p, max z) over its columns (token ids
          are offset to the shard's columns), combined over the vocabulary axes: pmax / psum
          of exp for the log-sum-exps, the mixture formula of `common.combine_entropy` for H,
          psum for z_tok, pmax for max z;
  pass 2: each shard's alpha, S and KL under the global normalisers, psum'd;
  backward: each shard's logit gradient from the per-row residuals; the hidden-state
          gradient sums over the vocabulary (psum over the vocabulary axes), the head's over
          the rows (psum over the row axes).
Only [rows] statistics and [rows, d] / [d, V / shards] gradients cross devices. A vocabulary
the shard count does not divide is padded with zero head columns and -inf bias (probability
0: they add nothing and their gradient is sliced off), at the cost of one padded copy.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels import layout
from pallas_kernels.fused_head import common
from pallas_kernels.fused_head.common import Cotangents, HeadInputs, Residuals


_axes = layout.axes
vocab_shards = layout.vocab_shards


def check_spec(mesh: Mesh, spec: PartitionSpec, logits_shape: Sequence[int]) -> None:
  """Raises ValueError, naming what is wrong, unless `spec` fits [..., V] logits on `mesh`."""
  layout.check_spec(mesh, spec, logits_shape, "fused_head")


def local_shapes(mesh: Mesh, spec: PartitionSpec, lead: Sequence[int],
                 num_target_dims: int | None, vocab: int) -> tuple[int, int, int]:
  """(K, N, V) of the blocks each device works on (V padded to the vocabulary shards)."""
  sizes = [dim // math.prod(mesh.shape[a] for a in _axes(e)) for dim, e in zip(lead, spec)]
  extra = len(lead) - num_target_dims if num_target_dims is not None else 0
  n = vocab_shards(mesh, spec)
  return math.prod(sizes[:extra]), math.prod(sizes[extra:]), -(-vocab // n)


# check_vma=False on every shard_map: the implementations' loop carries and Pallas calls are
# written for one device and carry no varying-axes types. Nothing is differentiated through
# a collective (the custom VJP is outside the shard_map); the replication of the outputs over
# the vocabulary axes holds by construction (psum / pmax results).


class _Layout:
  """Specs of every argument and the local flattening, from the logits' spec."""

  def __init__(self, spec: PartitionSpec, lead_ndim: int, target_ndim: int | None):
    self.spec = spec
    self.vocab_axes = _axes(spec[-1])
    self.rows = PartitionSpec(*spec[:-1])
    self.row_axes = tuple(a for e in spec[:-1] for a in _axes(e))
    self.target_ndim = target_ndim  # the target's leading dimensions (None: no target)
    target_entries = spec[lead_ndim - (target_ndim or 0):-1]
    self.target_rows = PartitionSpec(*target_entries)
    self.specs = dict(
        draft=PartitionSpec(*spec[:-1], None), head=PartitionSpec(None, spec[-1]),
        bias=PartitionSpec(spec[-1]), tokens=self.rows,
        target_hidden=PartitionSpec(*target_entries, None),
        target_logits=PartitionSpec(*target_entries, spec[-1]))

  def flatten(self, arrays: dict[str, jax.Array]) -> HeadInputs:
    """The device's blocks as a local HeadInputs ([K, N, d] rows), token ids local."""
    draft = arrays["draft"]
    lead = draft.shape[:-1]
    extra = len(lead) - (self.target_ndim or 0) if self.target_ndim is not None else 0
    k, rows = math.prod(lead[:extra]), math.prod(lead[extra:])
    tokens = arrays.get("tokens")
    if tokens is not None:
      tokens = tokens.reshape(k, rows).astype(jnp.int32)
      if self.vocab_axes:
        local_vocab = arrays["head"].shape[1]
        tokens = tokens - jax.lax.axis_index(self.vocab_axes) * local_vocab
    target_hidden, target_logits = arrays.get("target_hidden"), arrays.get("target_logits")
    return HeadInputs(
        draft.reshape(k, rows, draft.shape[-1]), arrays["head"], arrays.get("bias"), tokens,
        None if target_hidden is None else target_hidden.reshape(rows, -1),
        None if target_logits is None else target_logits.reshape(rows, -1))


def _module(name: str):
  return importlib.import_module(f"pallas_kernels.fused_head.{name}")


@functools.lru_cache(maxsize=None)
def _sharded_head(name: str, mesh: Mesh, spec: PartitionSpec, lead_ndim: int,
                  target_ndim: int | None, present: tuple[str, ...], chunk_size, interpret):
  """custom_vjp fused head over `mesh` for arguments `present` (see the module docstring)."""
  module = _module(name)
  layout = _Layout(spec, lead_ndim, target_ndim)
  kw = dict(chunk_size=chunk_size, interpret=interpret)
  in_specs = {k: layout.specs[k] for k in present}
  residual_specs = Residuals(layout.rows, layout.rows,
                             layout.rows if target_ndim is not None else None,
                             layout.target_rows if target_ndim is not None else None)

  def local_forward(arrays):
    x = layout.flatten(arrays)
    lead = arrays["draft"].shape[:-1]
    outputs, res = common.forward(module, x, vocab_axes=layout.vocab_axes, **kw)
    target_lead = lead[len(lead) - target_ndim:] if target_ndim is not None else None
    res = Residuals(res.lse_q.reshape(lead), res.entropy.reshape(lead),
                    None if res.below_mass is None else res.below_mass.reshape(lead),
                    None if res.lse_p is None else res.lse_p.reshape(target_lead))
    return {k: v.reshape(lead) for k, v in outputs.items()}, res

  output_names = ("entropy", "max_logprob") + (("logprob",) if "tokens" in present else ()) + (
      ("tv", "kl") if target_ndim is not None else ())
  forward = jax.shard_map(local_forward, mesh=mesh, in_specs=(in_specs,),
                          out_specs=({k: layout.rows for k in output_names}, residual_specs),
                          check_vma=False)

  @functools.lru_cache(maxsize=None)
  def backward_map(cot_present: tuple[bool, ...], head_grad: bool):
    def local_backward(arrays, res, cot):
      x = layout.flatten(arrays)
      k, n = x.draft.shape[:2]
      flat = lambda a, shape: None if a is None else a.reshape(shape)
      res = Residuals(flat(res.lse_q, (k, n)), flat(res.entropy, (k, n)),
                      flat(res.below_mass, (k, n)), flat(res.lse_p, (n,)))
      cot = Cotangents(*(flat(c, (k, n)) for c in cot))
      d_draft, d_head = common.backward(module, x, res, cot, head_grad=head_grad,
                                        vocab_axes=layout.vocab_axes,
                                        row_axes=layout.row_axes, **kw)
      return d_draft.reshape(arrays["draft"].shape), d_head

    cot_specs = Cotangents(*(layout.rows if p else None for p in cot_present))
    return jax.shard_map(
        local_backward, mesh=mesh, in_specs=(in_specs, residual_specs, cot_specs),
        out_specs=(layout.specs["draft"], layout.specs["head"] if head_grad else None),
        check_vma=False)

  def forward_fn(x: HeadInputs):
    return forward({k: getattr(x, k) for k in present})

  def backward_fn(x: HeadInputs, res: Residuals, cot: Cotangents, *, head_grad: bool):
    arrays = {k: getattr(x, k) for k in present}
    return backward_map(tuple(c is not None for c in cot), head_grad)(arrays, res, cot)

  return common.make_fused_head(forward_fn, backward_fn)


def fused_head(name: str, draft: jax.Array, head: jax.Array, *, bias=None, tokens=None,
               target_hidden=None, target_logits=None, mesh: Mesh, spec: PartitionSpec,
               chunk_size: int | None = None, interpret: Any = False) -> dict[str, jax.Array]:
  """The fused head's per-row outputs (`api.fused_head`, without "ce") of arrays laid out by
  the logits' `spec` on `mesh`, with implementation `name`; each [...] float32."""
  lead, vocab = draft.shape[:-1], head.shape[1]
  check_spec(mesh, spec, tuple(lead) + (vocab,))
  target = target_hidden if target_hidden is not None else target_logits
  target_ndim = None if target is None else target.ndim - 1
  n = vocab_shards(mesh, spec)
  if vocab % n:
    pad = -vocab % n
    head = jnp.pad(head, ((0, 0), (0, pad)))
    bias = jnp.zeros((vocab,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    bias = jnp.pad(bias, (0, pad), constant_values=common.NEG_INF)
    if target_logits is not None:
      target_logits = jnp.pad(target_logits, [(0, 0)] * (target_logits.ndim - 1) + [(0, pad)],
                              constant_values=common.NEG_INF)
  args = HeadInputs(draft, head, bias, tokens, target_hidden, target_logits)
  present = tuple(k for k in HeadInputs._fields if getattr(args, k) is not None)
  fn = _sharded_head(name, mesh, spec, len(lead), target_ndim, present, chunk_size, interpret)
  return fn(*args)
