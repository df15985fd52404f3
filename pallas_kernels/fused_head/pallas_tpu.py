"""The fused head as Mosaic TPU Pallas kernels (runs on CPU with interpret=True).

Every kernel computes its blocks' logits on the MXU from a [K, br, d] block of draft hidden
states and a [d, bc] block of the head (plus a [br, d] target block, or a [br, bc] block of
given target logits), in float32, and never writes logits out:
  pass 1 (`logsumexp_pass`): grid (row blocks "parallel", vocab blocks "arbitrary"): online
          log-sum-exp, entropy, max and token logit per draft row, log-sum-exp per target row, in
          [br, 1] VMEM accumulators, written at the last vocab block;
  pass 2 (`overlap_pass`): same grid, alpha, S and KL under the final normalisers;
  backward (`grad_pass`): two kernels recomputing each block's logits and logit gradient g:
          d draft over (row blocks "parallel", vocab blocks "arbitrary"), accumulating
          g W_blk^T into the [K, br, d] output block; d head over (vocab blocks "parallel",
          row blocks "arbitrary"), accumulating h_blk^T g into a [d, bc] float32 scratch.
The whole d sits in each block: at d = 4096 and bf16, a [d, 512] head block is 4 MiB.
Ragged edges are masked in-kernel, not padded: columns past V get -inf logits (and zero head
columns in the backward), rows past N are never written back and are zeroed where they would
mix into d head. Block sizes are multiples of (8, 128) on hardware; in interpret mode any
size is allowed (the tests use tiny ones). The products take g in the head's (or hidden
states') dtype, so a bfloat16 head runs the MXU in bfloat16 with float32 accumulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.fused_head import common
from pallas_kernels.fused_head.common import Cotangents, FirstPass, HeadInputs, Overlap, Residuals

DEFAULT_CHUNK_SIZE = 512  # vocab columns per block, a multiple of 128 lanes
DEFAULT_BLOCK_ROWS = 128  # a multiple of the 8 (f32) and 16 (bf16) sublane tiles
_CONTRACT_LAST = (((1,), (1,)), ((), ()))  # a [m, c] x [n, c] -> [m, n] product
_CONTRACT_FIRST = (((0,), (0,)), ((), ()))  # a [c, m] x [c, n] -> [m, n] product


def _blocks(x: HeadInputs, chunk_size, block_rows, interpret) -> tuple[int, int]:
  """(rows, columns) per block, clamped to the arrays (a full dimension is always legal)."""
  _, rows, _ = x.draft.shape
  vocab = x.head.shape[1]
  block_rows = block_rows or DEFAULT_BLOCK_ROWS
  block_cols = chunk_size or DEFAULT_CHUNK_SIZE
  block_rows = rows if rows <= block_rows else block_rows
  block_cols = vocab if vocab <= block_cols else block_cols
  if not interpret and ((block_cols != vocab and block_cols % 128)
                        or (block_rows != rows and block_rows % 8)):
    raise ValueError(f"pallas_tpu blocks must be multiples of (8, 128) rows x columns, got "
                     f"({block_rows}, {block_cols}).")
  return block_rows, block_cols


class _Specs:
  """BlockSpecs of every input for a grid whose ids map to (row block, vocab block)."""

  def __init__(self, x: HeadInputs, block_rows: int, block_cols: int, order):
    k, _, d = x.draft.shape
    ij = lambda f: (lambda *g: f(*order(*g)))
    self.per_draft_row = pl.BlockSpec((k, block_rows, 1), ij(lambda i, j: (0, i, 0)))
    self.per_target_row = pl.BlockSpec((block_rows, 1), ij(lambda i, j: (i, 0)))
    self.by_name = dict(
        draft=pl.BlockSpec((k, block_rows, d), ij(lambda i, j: (0, i, 0))),
        head=pl.BlockSpec((d, block_cols), ij(lambda i, j: (0, j))),
        bias=pl.BlockSpec((1, block_cols), ij(lambda i, j: (0, j))),
        tokens=self.per_draft_row,
        target_hidden=pl.BlockSpec((block_rows, d), ij(lambda i, j: (i, 0))),
        target_logits=pl.BlockSpec((block_rows, block_cols), ij(lambda i, j: (i, j))))


def _kernel_inputs(x: HeadInputs, specs: _Specs, with_target: bool = True):
  """(names, arrays, specs) of the present inputs, reshaped for Mosaic ([K, N, 1] tokens,
  [1, V] bias)."""
  k, n, _ = x.draft.shape
  arrays = dict(draft=x.draft, head=x.head,
                bias=None if x.bias is None else x.bias.reshape(1, -1),
                tokens=None if x.tokens is None else x.tokens.reshape(k, n, 1))
  if with_target:
    arrays.update(target_hidden=x.target_hidden, target_logits=x.target_logits)
  names = [name for name, a in arrays.items() if a is not None]
  return names, [arrays[n] for n in names], [specs.by_name[n] for n in names]


def _call(kernel, grid, semantics, inputs, outputs, scratch, interpret, name):
  """pallas_call with refs handed to `kernel(ins, outs, scratch)` as dicts by name.

  inputs: (names, arrays, specs); outputs: {name: (ShapeDtypeStruct, spec)}."""
  in_names, in_arrays, in_specs = inputs
  out_names = list(outputs)

  def wrapped(*refs):
    ins = dict(zip(in_names, refs[:len(in_names)]))
    outs = dict(zip(out_names, refs[len(in_names):len(in_names) + len(out_names)]))
    kernel(ins, outs, refs[len(in_names) + len(out_names):])

  results = pl.pallas_call(
      wrapped,
      out_shape=[outputs[n][0] for n in out_names],
      grid=grid,
      in_specs=in_specs,
      out_specs=[outputs[n][1] for n in out_names],
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      interpret=interpret,
      name=name,
  )(*in_arrays)
  return dict(zip(out_names, results))


class _Block:
  """The logits of one (row block, vocab block) inside a kernel."""

  def __init__(self, ins, j, vocab: int, block_cols: int):
    self.ins = ins
    self.columns = j * block_cols + lax.broadcasted_iota(jnp.int32, (1, block_cols), 1)
    self.valid = None if vocab % block_cols == 0 else self.columns < vocab
    self.bias = ins["bias"][...] if "bias" in ins else None

  def hits(self, tokens: jax.Array) -> jax.Array:
    """[br, bc] bool 1[column == token] on real columns only: on a vocabulary shard the
    (shifted) id of a later shard's token may point into this block's padding."""
    hits = self.columns == tokens
    return hits if self.valid is None else hits & self.valid

  def head(self, zero_invalid: bool = False) -> jax.Array:
    head = self.ins["head"][...]
    if zero_invalid and self.valid is not None:  # padding may hold NaN: 0 * NaN = NaN
      head = jnp.where(self.valid, head, jnp.zeros_like(head))
    return head

  def _logits(self, hidden, head) -> jax.Array:
    hidden, head = common.promote(hidden, head)
    z = jnp.dot(hidden, head, preferred_element_type=jnp.float32)
    if self.bias is not None:
      z = z + self.bias
    return common.mask_columns(z, self.valid)

  def draft(self, k: int, head) -> jax.Array:  # [br, bc]
    return self._logits(self.ins["draft"][k], head)

  def target(self, head) -> jax.Array:  # [br, bc]
    if "target_logits" in self.ins:
      return common.mask_columns(self.ins["target_logits"][...].astype(jnp.float32),
                                 self.valid)
    return self._logits(self.ins["target_hidden"][...], head)


# ------------------------------------------------------------------ pass 1


def _logsumexp_kernel(ins, outs, scratch, *, num_drafts, vocab, block_cols):
  j, last = pl.program_id(1), pl.num_programs(1) - 1
  m, s, u, tok = scratch[:4]
  block = _Block(ins, j, vocab, block_cols)
  target = "target_hidden" in ins or "target_logits" in ins

  @pl.when(j == 0)
  def _init():
    for ref, value in zip((m, s, u, tok), (common.NEG_INF, 0.0, 0.0, 0.0)):
      ref[...] = jnp.full(ref.shape, value, jnp.float32)
    if target:
      scratch[4][...] = jnp.full(scratch[4].shape, common.NEG_INF, jnp.float32)
      scratch[5][...] = jnp.zeros(scratch[5].shape, jnp.float32)

  head = block.head()
  for k in range(num_drafts):
    z = block.draft(k, head)
    m[k], s[k], u[k] = common.logsumexp_update(m[k], s[k], u[k], z)
    if "tokens" in ins:
      tok[k] += jnp.sum(jnp.where(block.hits(ins["tokens"][k]), z, 0.0), axis=1,
                        keepdims=True)
  if target:
    max_p, sum_p, _ = common.logsumexp_update(scratch[4][...], scratch[5][...], None,
                                              block.target(head))
    scratch[4][...], scratch[5][...] = max_p, sum_p

  @pl.when(j == last)
  def _finish():
    for k in range(num_drafts):
      outs["lse_q"][k], outs["entropy"][k] = common.logsumexp_finish(m[k], s[k], u[k])
      outs["max_logit"][k] = m[k]
      if "token_logit" in outs:
        outs["token_logit"][k] = tok[k]
    if target:
      outs["lse_p"][...] = common.logsumexp_finish(scratch[4][...], scratch[5][...])[0]


def logsumexp_pass(x: HeadInputs, *, chunk_size: int | None = None,
                   block_rows: int | None = None, interpret=False) -> FirstPass:
  """Pass 1: per-row (lse_q, entropy, z_tok, lse_p, max z) as in
  `xla_blockwise.logsumexp_pass`."""
  k, n, _ = x.draft.shape
  vocab = x.head.shape[1]
  br, bc = _blocks(x, chunk_size, block_rows, interpret)
  specs = _Specs(x, br, bc, lambda i, j: (i, j))
  per_draft = (jax.ShapeDtypeStruct((k, n, 1), jnp.float32), specs.per_draft_row)
  outputs = dict(lse_q=per_draft, entropy=per_draft, max_logit=per_draft)
  if x.tokens is not None:
    outputs["token_logit"] = per_draft
  if x.has_target:
    outputs["lse_p"] = (jax.ShapeDtypeStruct((n, 1), jnp.float32), specs.per_target_row)
  scratch = [pltpu.VMEM((k, br, 1), jnp.float32)] * 4 + [pltpu.VMEM((br, 1), jnp.float32)] * 2
  out = _call(functools.partial(_logsumexp_kernel, num_drafts=k, vocab=vocab, block_cols=bc),
              (pl.cdiv(n, br), pl.cdiv(vocab, bc)), ("parallel", "arbitrary"),
              _kernel_inputs(x, specs), outputs, scratch, interpret, "fused_head_logsumexp")
  return FirstPass(out["lse_q"][..., 0], out["entropy"][..., 0],
                   out["token_logit"][..., 0] if "token_logit" in out else None,
                   out["lse_p"][:, 0] if "lse_p" in out else None, out["max_logit"][..., 0])


# ------------------------------------------------------------------ pass 2


def _overlap_kernel(ins, outs, scratch, *, num_drafts, vocab, block_cols):
  j, last = pl.program_id(1), pl.num_programs(1) - 1
  block = _Block(ins, j, vocab, block_cols)

  @pl.when(j == 0)
  def _init():
    for ref in scratch:
      ref[...] = jnp.zeros(ref.shape, jnp.float32)

  head = block.head()
  log_p = block.target(head) - ins["lse_p"][...]
  for k in range(num_drafts):
    terms = common.overlap_terms(block.draft(k, head) - ins["lse_q"][k], log_p)
    for ref, term in zip(scratch, terms):
      ref[k] += jnp.sum(term, axis=1, keepdims=True)

  @pl.when(j == last)
  def _finish():
    for name, ref in zip(("alpha", "below_mass", "kl"), scratch):
      outs[name][...] = ref[...]


def overlap_pass(x: HeadInputs, lse_q: jax.Array, lse_p: jax.Array, *,
                 chunk_size: int | None = None, block_rows: int | None = None,
                 interpret=False) -> Overlap:
  """Pass 2 under the normalisers lse_q [K, N], lse_p [N]: (alpha, S, KL), each [K, N]."""
  k, n, _ = x.draft.shape
  vocab = x.head.shape[1]
  br, bc = _blocks(x, chunk_size, block_rows, interpret)
  specs = _Specs(x, br, bc, lambda i, j: (i, j))
  names, arrays, in_specs = _kernel_inputs(x, specs)
  inputs = (names + ["lse_q", "lse_p"], arrays + [lse_q[..., None], lse_p[:, None]],
            in_specs + [specs.per_draft_row, specs.per_target_row])
  per_draft = (jax.ShapeDtypeStruct((k, n, 1), jnp.float32), specs.per_draft_row)
  out = _call(functools.partial(_overlap_kernel, num_drafts=k, vocab=vocab, block_cols=bc),
              (pl.cdiv(n, br), pl.cdiv(vocab, bc)), ("parallel", "arbitrary"), inputs,
              dict(alpha=per_draft, below_mass=per_draft, kl=per_draft),
              [pltpu.VMEM((k, br, 1), jnp.float32)] * 3, interpret, "fused_head_overlap")
  return Overlap(*(out[name][..., 0] for name in ("alpha", "below_mass", "kl")))


# ------------------------------------------------------------------ backward


def _logit_grads(ins, block: _Block, head, num_drafts: int, cot_names) -> list[jax.Array]:
  """The [br, bc] logit gradient of each draft k in this block (`common.logit_grad`)."""
  cot = Cotangents(**{name: None for name in Cotangents._fields})
  t = None
  if "tv" in cot_names or "kl" in cot_names:
    t = block.target(head)
  grads = []
  for k in range(num_drafts):
    cot_k = cot._replace(**{name: ins[f"cot_{name}"][k] for name in cot_names})
    hits = None
    if "logprob" in cot_names:
      hits = block.hits(ins["tokens"][k]).astype(jnp.float32)
    grads.append(common.logit_grad(
        block.draft(k, head), ins["lse_q"][k], ins["entropy"][k], cot_k, t=t,
        lse_p=ins["lse_p"][...] if "lse_p" in ins else None,
        below_mass=ins["below_mass"][k] if "below_mass" in ins else None, hits=hits))
  return grads


def _draft_grad_kernel(ins, outs, scratch, *, num_drafts, vocab, block_cols, cot_names):
  del scratch
  j = pl.program_id(1)
  block = _Block(ins, j, vocab, block_cols)
  head = block.head(zero_invalid=True)
  grads = _logit_grads(ins, block, head, num_drafts, cot_names)
  d_draft = outs["d_draft"]

  @pl.when(j == 0)
  def _init():
    d_draft[...] = jnp.zeros(d_draft.shape, jnp.float32)

  for k, grad in enumerate(grads):
    d_draft[k] += lax.dot_general(grad.astype(head.dtype), head, _CONTRACT_LAST,
                                  preferred_element_type=jnp.float32)


def _head_grad_kernel(ins, outs, scratch, *, num_drafts, vocab, block_cols, cot_names,
                      rows):
  j, i = pl.program_id(0), pl.program_id(1)
  block = _Block(ins, j, vocab, block_cols)
  head = block.head(zero_invalid=True)
  grads = _logit_grads(ins, block, head, num_drafts, cot_names)
  acc = scratch[0]

  @pl.when(i == 0)
  def _init():
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  block_rows = grads[0].shape[0]
  valid_rows = None
  if rows % block_rows:  # rows past N hold garbage: zero both factors (0 * NaN = NaN)
    valid_rows = i * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0) < rows
  for k, grad in enumerate(grads):
    hidden = ins["draft"][k]
    if valid_rows is not None:
      grad = jnp.where(valid_rows, grad, 0.0)
      hidden = jnp.where(valid_rows, hidden, jnp.zeros_like(hidden))
    acc[...] += lax.dot_general(hidden, grad.astype(hidden.dtype), _CONTRACT_FIRST,
                                preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _finish():
    outs["d_head"][...] = acc[...].astype(outs["d_head"].dtype)


def grad_pass(x: HeadInputs, res: Residuals, cot: Cotangents, *, head_grad: bool,
              chunk_size: int | None = None, block_rows: int | None = None, interpret=False):
  """(d draft [K, N, d] float32, d head [d, V] in head's dtype or None), see the docstring."""
  k, n, d = x.draft.shape
  vocab = x.head.shape[1]
  if all(c is None for c in cot):
    return (jnp.zeros(x.draft.shape, jnp.float32),
            jnp.zeros(x.head.shape, x.head.dtype) if head_grad else None)
  br, bc = _blocks(x, chunk_size, block_rows, interpret)
  cot_names = tuple(name for name, c in zip(Cotangents._fields, cot) if c is not None)
  rows = dict(lse_q=res.lse_q, entropy=res.entropy,
              below_mass=res.below_mass if cot.tv is not None else None,
              **{f"cot_{name}": getattr(cot, name) for name in cot_names})
  kw = dict(num_drafts=k, vocab=vocab, block_cols=bc, cot_names=cot_names)

  def inputs(specs: _Specs):
    names, arrays, in_specs = _kernel_inputs(x, specs, with_target=cot.needs_target)
    if "tokens" in names and cot.logprob is None:
      drop = names.index("tokens")
      del names[drop], arrays[drop], in_specs[drop]
    for name, value in rows.items():
      if value is not None:
        names.append(name)
        arrays.append(value[..., None])
        in_specs.append(specs.per_draft_row)
    if cot.needs_target:
      names.append("lse_p")
      arrays.append(res.lse_p[:, None])
      in_specs.append(specs.per_target_row)
    return names, arrays, in_specs

  by_rows = _Specs(x, br, bc, lambda i, j: (i, j))
  d_draft = _call(functools.partial(_draft_grad_kernel, **kw),
                  (pl.cdiv(n, br), pl.cdiv(vocab, bc)), ("parallel", "arbitrary"),
                  inputs(by_rows),
                  dict(d_draft=(jax.ShapeDtypeStruct((k, n, d), jnp.float32),
                                by_rows.by_name["draft"])),
                  [], interpret, "fused_head_draft_grad")["d_draft"]
  d_head = None
  if head_grad:
    by_cols = _Specs(x, br, bc, lambda j, i: (i, j))
    d_head = _call(functools.partial(_head_grad_kernel, rows=n, **kw),
                   (pl.cdiv(vocab, bc), pl.cdiv(n, br)), ("parallel", "arbitrary"),
                   inputs(by_cols),
                   dict(d_head=(jax.ShapeDtypeStruct(x.head.shape, x.head.dtype),
                                by_cols.by_name["head"])),
                   [pltpu.VMEM((d, bc), jnp.float32)], interpret,
                   "fused_head_head_grad")["d_head"]
  return d_draft, d_head


def fused_head(x: HeadInputs, *, chunk_size: int | None = None, interpret=False):
  """The per-row outputs (`api.fused_head`) with the custom VJP of `common`."""
  return common.fused_head_from_passes("pallas_tpu", chunk_size=chunk_size,
                                       interpret=interpret)(*x)
