"""The fused head as Triton-lowered Pallas kernels for GPUs (runs on CPU with interpret=True).

Each program owns a block of br rows and computes its logits tile by tile: a [br, bc] block of
z is sum over d tiles of dot(h[br, bd], W[bd, bc]) (the W tile is loaded once for all K
drafts and the target), in float32, with masked loads (rows past N and d past d read 0,
columns past V get -inf logits), so no size needs to be a multiple of a block.
  pass 1 (`logsumexp_pass`): grid (row blocks,); each program loops over the vocabulary
          chunks with an online log-sum-exp, entropy and token logit per draft row and a
          log-sum-exp per target row in registers, and stores the per-row results;
  pass 2 (`overlap_pass`): the same loop for alpha, S and KL under the final normalisers;
  backward (`grad_pass`): grid (row blocks, vocab chunks); each program recomputes its
          block's logits and logit gradient g, then for every d tile atomically adds
          g W_tile^T into d draft and h_tile^T g into d head (float32 buffers padded to whole
          tiles, zero-initialised and aliased to the outputs), as Cut Cross-Entropy does.
Triton tensors must have power-of-2 sizes and `dot` needs every dimension >= 16, so the block
sizes are powers of 2 >= 16 (the tail is masked, not sliced). The K draft rows are stored as
[K * N, ...] so one program's rows of draft k are rows k * N + r.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fused_head import common
from pallas_kernels.fused_head.common import Cotangents, FirstPass, HeadInputs, Overlap, Residuals

DEFAULT_CHUNK_SIZE = 64  # vocabulary columns per block
DEFAULT_BLOCK_ROWS = 64
DEFAULT_BLOCK_D = 64
NUM_WARPS = 4


def _power_of_two(value: int, what: str) -> int:
  if value < 16 or value & (value - 1):
    raise ValueError(f"pallas_gpu {what} must be a power of 2 >= 16, got {value}.")
  return value


class _Tiles:
  """Static sizes and the in-kernel tile loads of one call."""

  def __init__(self, x: HeadInputs, chunk_size, block_rows, block_d):
    self.num_drafts, self.rows, self.d = x.draft.shape
    self.vocab = x.head.shape[1]
    self.br = _power_of_two(block_rows or DEFAULT_BLOCK_ROWS, "block_rows")
    self.bc = _power_of_two(chunk_size or DEFAULT_CHUNK_SIZE, "chunk_size")
    self.bd = _power_of_two(block_d or DEFAULT_BLOCK_D, "block_d")
    self.br = min(self.br, max(16, pl.next_power_of_2(self.rows)))
    self.bc = min(self.bc, max(16, pl.next_power_of_2(self.vocab)))
    self.bd = min(self.bd, max(16, pl.next_power_of_2(self.d)))
    self.num_chunks = pl.cdiv(self.vocab, self.bc)
    self.num_d_tiles = pl.cdiv(self.d, self.bd)

  def row_ids(self, i):
    rows = i * self.br + jnp.arange(self.br)
    return rows, rows < self.rows

  def column_ids(self, j):
    columns = j * self.bc + jnp.arange(self.bc)
    return columns, columns < self.vocab

  def d_ids(self, t):
    ds = t * self.bd + jnp.arange(self.bd)
    return ds, ds < self.d

  def hidden_tile(self, ref, rows, row_ok, ds, d_ok):
    """[br, bd] of a [rows, d] ref (zeros outside)."""
    return plgpu.load(ref.at[rows[:, None], ds[None, :]], mask=row_ok[:, None] & d_ok[None, :],
                      other=0.0)

  def head_tile(self, ref, ds, d_ok, columns, col_ok):
    """[bd, bc] of the [d, V] head (zeros outside)."""
    return plgpu.load(ref.at[ds[:, None], columns[None, :]],
                      mask=d_ok[:, None] & col_ok[None, :], other=0.0)

  def logits(self, refs, i, j, *, target: bool):
    """([K] draft logits [br, bc], target logits [br, bc] or None), float32, -inf past V."""
    rows, row_ok = self.row_ids(i)
    columns, col_ok = self.column_ids(j)
    with_hidden = target and "target_hidden" in refs
    n_acc = self.num_drafts + int(with_hidden)

    def body(t, accs):
      ds, d_ok = self.d_ids(t)
      head = self.head_tile(refs["head"], ds, d_ok, columns, col_ok)
      hiddens = [self.hidden_tile(refs["draft"], k * self.rows + rows, row_ok, ds, d_ok)
                 for k in range(self.num_drafts)]
      if with_hidden:
        hiddens.append(self.hidden_tile(refs["target_hidden"], rows, row_ok, ds, d_ok))
      out = []
      for acc, hidden in zip(accs, hiddens):
        a, b = common.promote(hidden, head)
        out.append(acc + plgpu.dot(a, b).astype(jnp.float32))
      return tuple(out)

    accs = lax.fori_loop(0, self.num_d_tiles, body,
                         tuple(jnp.zeros((self.br, self.bc), jnp.float32)
                               for _ in range(n_acc)))
    bias = 0.0
    if "bias" in refs:
      bias = plgpu.load(refs["bias"].at[columns], mask=col_ok, other=0.0)[None, :]
    valid = col_ok[None, :]
    finish = lambda z: jnp.where(valid, z + bias, common.NEG_INF)
    drafts = [finish(acc) for acc in accs[:self.num_drafts]]
    t = None
    if with_hidden:
      t = finish(accs[-1])
    elif target and "target_logits" in refs:
      t = plgpu.load(refs["target_logits"].at[rows[:, None], columns[None, :]],
                     mask=row_ok[:, None] & valid, other=common.NEG_INF).astype(jnp.float32)
      t = jnp.where(valid, t, common.NEG_INF)
    return drafts, t

  def load_rows(self, ref, k, i):
    """[br, 1] of a per-row [K * N] (k given) or [N] (k None) float32 ref (0 outside)."""
    rows, row_ok = self.row_ids(i)
    index = rows if k is None else k * self.rows + rows
    return plgpu.load(ref.at[index], mask=row_ok, other=0)[:, None]

  def store_rows(self, ref, k, i, value):
    rows, row_ok = self.row_ids(i)
    index = rows if k is None else k * self.rows + rows
    plgpu.store(ref.at[index], value[:, 0], mask=row_ok)


def _call(kernel, grid, inputs: dict, outputs: dict, interpret, name, aliases=None):
  """pallas_call on whole arrays, refs handed to `kernel(ins, outs)` as dicts by name."""
  in_names, out_names = list(inputs), list(outputs)

  def wrapped(*refs):
    kernel(dict(zip(in_names, refs[:len(in_names)])),
           dict(zip(out_names, refs[len(in_names):])))

  results = pl.pallas_call(
      wrapped,
      out_shape=[outputs[n] for n in out_names],
      grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
      input_output_aliases=aliases or {},
      interpret=interpret,
      name=name,
  )(*inputs.values())
  return dict(zip(out_names, results))


def _inputs(x: HeadInputs, with_target: bool = True) -> dict:
  """The present inputs as [K * N, d] drafts, [K * N] tokens and the rest as they are."""
  k, n, d = x.draft.shape
  arrays = dict(draft=x.draft.reshape(k * n, d), head=x.head, bias=x.bias,
                tokens=None if x.tokens is None else x.tokens.reshape(k * n))
  if with_target:
    arrays.update(target_hidden=x.target_hidden, target_logits=x.target_logits)
  return {name: a for name, a in arrays.items() if a is not None}


def _hits(columns, col_ok, tokens):
  """[br, bc] bool 1[column == token] on real columns only: on a vocabulary shard the
  (shifted) id of a later shard's token may point past V into the block's padding."""
  return (columns[None, :] == tokens) & col_ok[None, :]


# ------------------------------------------------------------------ pass 1


def _logsumexp_kernel(ins, outs, *, tiles: _Tiles):
  i = pl.program_id(0)
  target = "lse_p" in outs
  tokens = [plgpu.load(ins["tokens"].at[k * tiles.rows + tiles.row_ids(i)[0]],
                       mask=tiles.row_ids(i)[1], other=-1)[:, None]
            for k in range(tiles.num_drafts)] if "tokens" in ins else None

  def body(j, carry):
    drafts_state, target_state = carry
    z, t = tiles.logits(ins, i, j, target=target)
    columns, col_ok = tiles.column_ids(j)
    new = []
    for k, (state, zk) in enumerate(zip(drafts_state, z)):
      m, s, u, tok = state
      m, s, u = common.logsumexp_update(m, s, u, zk)
      if tokens is not None:
        tok = tok + jnp.sum(jnp.where(_hits(columns, col_ok, tokens[k]), zk, 0.0), axis=1,
                            keepdims=True)
      new.append((m, s, u, tok))
    if target:
      target_state = common.logsumexp_update(*target_state, None, t)[:2]
    return tuple(new), target_state

  shape = (tiles.br, 1)
  init = (tuple(common.logsumexp_init(shape) + (jnp.zeros(shape, jnp.float32),)
                for _ in range(tiles.num_drafts)), common.logsumexp_init(shape)[:2])
  drafts_state, target_state = lax.fori_loop(0, tiles.num_chunks, body, init)
  for k, (m, s, u, tok) in enumerate(drafts_state):
    lse, entropy = common.logsumexp_finish(m, s, u)
    tiles.store_rows(outs["lse_q"], k, i, lse)
    tiles.store_rows(outs["entropy"], k, i, entropy)
    tiles.store_rows(outs["max_logit"], k, i, m)
    if "token_logit" in outs:
      tiles.store_rows(outs["token_logit"], k, i, tok)
  if target:
    tiles.store_rows(outs["lse_p"], None, i, common.logsumexp_finish(*target_state)[0])


def logsumexp_pass(x: HeadInputs, *, chunk_size: int | None = None,
                   block_rows: int | None = None, block_d: int | None = None,
                   interpret=False) -> FirstPass:
  """Pass 1: per-row (lse_q, entropy, z_tok, lse_p, max z) as in
  `xla_blockwise.logsumexp_pass`."""
  tiles = _Tiles(x, chunk_size, block_rows, block_d)
  k, n, _ = x.draft.shape
  per_draft = jax.ShapeDtypeStruct((k * n,), jnp.float32)
  outputs = dict(lse_q=per_draft, entropy=per_draft, max_logit=per_draft)
  if x.tokens is not None:
    outputs["token_logit"] = per_draft
  if x.has_target:
    outputs["lse_p"] = jax.ShapeDtypeStruct((n,), jnp.float32)
  out = _call(functools.partial(_logsumexp_kernel, tiles=tiles),
              (pl.cdiv(n, tiles.br),), _inputs(x), outputs, interpret, "fused_head_logsumexp")
  per_row = lambda name: out[name].reshape(k, n) if name in out else None
  return FirstPass(per_row("lse_q"), per_row("entropy"), per_row("token_logit"),
                   out.get("lse_p"), per_row("max_logit"))


# ------------------------------------------------------------------ pass 2


def _overlap_kernel(ins, outs, *, tiles: _Tiles):
  i = pl.program_id(0)
  lse_q = [tiles.load_rows(ins["lse_q"], k, i) for k in range(tiles.num_drafts)]
  lse_p = tiles.load_rows(ins["lse_p"], None, i)

  def body(j, sums):
    z, t = tiles.logits(ins, i, j, target=True)
    log_p = t - lse_p
    new = []
    for k, zk in enumerate(z):
      terms = common.overlap_terms(zk - lse_q[k], log_p)
      new.append(tuple(acc + jnp.sum(term, axis=1, keepdims=True)
                       for acc, term in zip(sums[k], terms)))
    return tuple(new)

  zeros = jnp.zeros((tiles.br, 1), jnp.float32)
  sums = lax.fori_loop(0, tiles.num_chunks, body, ((zeros,) * 3,) * tiles.num_drafts)
  for k, per_draft in enumerate(sums):
    for name, value in zip(("alpha", "below_mass", "kl"), per_draft):
      tiles.store_rows(outs[name], k, i, value)


def overlap_pass(x: HeadInputs, lse_q: jax.Array, lse_p: jax.Array, *,
                 chunk_size: int | None = None, block_rows: int | None = None,
                 block_d: int | None = None, interpret=False) -> Overlap:
  """Pass 2 under the normalisers lse_q [K, N], lse_p [N]: (alpha, S, KL), each [K, N]."""
  tiles = _Tiles(x, chunk_size, block_rows, block_d)
  k, n, _ = x.draft.shape
  inputs = _inputs(x)
  inputs.pop("tokens", None)
  inputs.update(lse_q=lse_q.reshape(k * n), lse_p=lse_p)
  per_draft = jax.ShapeDtypeStruct((k * n,), jnp.float32)
  out = _call(functools.partial(_overlap_kernel, tiles=tiles), (pl.cdiv(n, tiles.br),),
              inputs, dict(alpha=per_draft, below_mass=per_draft, kl=per_draft), interpret,
              "fused_head_overlap")
  return Overlap(*(out[name].reshape(k, n) for name in ("alpha", "below_mass", "kl")))


# ------------------------------------------------------------------ backward


def _grad_kernel(ins, outs, *, tiles: _Tiles, cot_names, head_grad: bool):
  i, j = pl.program_id(0), pl.program_id(1)
  rows, row_ok = tiles.row_ids(i)
  columns, col_ok = tiles.column_ids(j)
  need_target = "tv" in cot_names or "kl" in cot_names
  z, t = tiles.logits(ins, i, j, target=need_target)
  lse_p = tiles.load_rows(ins["lse_p"], None, i) if need_target else None
  inside = row_ok[:, None] & col_ok[None, :]
  grads = []
  for k, zk in enumerate(z):
    per_row = lambda name: tiles.load_rows(ins[name], k, i)
    cot = Cotangents(**{name: per_row(f"cot_{name}") if name in cot_names else None
                        for name in Cotangents._fields})
    hits = None
    if "logprob" in cot_names:
      tokens = plgpu.load(ins["tokens"].at[k * tiles.rows + rows], mask=row_ok, other=-1)
      hits = _hits(columns, col_ok, tokens[:, None]).astype(jnp.float32)
    grad = common.logit_grad(zk, per_row("lse_q"), per_row("entropy"), cot, t=t, lse_p=lse_p,
                             below_mass=per_row("below_mass") if "tv" in cot_names else None,
                             hits=hits)
    grads.append(jnp.where(inside, grad, 0.0))

  # The float32 outputs are padded to whole tiles ([K * N_pad, d_pad], [d_pad, V_pad]), so
  # the atomic adds need no mask; what lands in the padding is zero and sliced off.
  padded_rows = pl.cdiv(tiles.rows, tiles.br) * tiles.br

  @pl.loop(0, tiles.num_d_tiles)
  def _d_tile(tile):
    ds, d_ok = tiles.d_ids(tile)
    head = tiles.head_tile(ins["head"], ds, d_ok, columns, col_ok)
    d_head = None
    for k, grad in enumerate(grads):
      part = plgpu.dot(grad.astype(head.dtype), head, trans_b=True).astype(jnp.float32)
      plgpu.atomic_add(outs["d_draft"], (pl.ds(k * padded_rows + i * tiles.br, tiles.br),
                                         pl.ds(tile * tiles.bd, tiles.bd)), part)
      if head_grad:
        hidden = tiles.hidden_tile(ins["draft"], k * tiles.rows + rows, row_ok, ds, d_ok)
        part = plgpu.dot(hidden, grad.astype(hidden.dtype), trans_a=True).astype(jnp.float32)
        d_head = part if d_head is None else d_head + part
    if head_grad:
      plgpu.atomic_add(outs["d_head"], (pl.ds(tile * tiles.bd, tiles.bd),
                                        pl.ds(j * tiles.bc, tiles.bc)), d_head)


def grad_pass(x: HeadInputs, res: Residuals, cot: Cotangents, *, head_grad: bool,
              chunk_size: int | None = None, block_rows: int | None = None,
              block_d: int | None = None, interpret=False):
  """(d draft [K, N, d] float32, d head [d, V] in head's dtype or None), see the docstring."""
  k, n, d = x.draft.shape
  if all(c is None for c in cot):
    return (jnp.zeros(x.draft.shape, jnp.float32),
            jnp.zeros(x.head.shape, x.head.dtype) if head_grad else None)
  tiles = _Tiles(x, chunk_size, block_rows, block_d)
  cot_names = tuple(name for name, c in zip(Cotangents._fields, cot) if c is not None)
  inputs = _inputs(x, with_target=cot.needs_target)
  if cot.logprob is None:
    inputs.pop("tokens", None)
  flat = lambda a: a.reshape(k * n)
  inputs.update(lse_q=flat(res.lse_q), entropy=flat(res.entropy))
  if cot.tv is not None:
    inputs["below_mass"] = flat(res.below_mass)
  if cot.needs_target:
    inputs["lse_p"] = res.lse_p
  inputs.update({f"cot_{name}": flat(getattr(cot, name)) for name in cot_names})
  padded_rows = pl.cdiv(n, tiles.br) * tiles.br
  padded_d = tiles.num_d_tiles * tiles.bd
  padded_vocab = tiles.num_chunks * tiles.bc
  buffers = dict(d_draft=(k * padded_rows, padded_d))
  if head_grad:
    buffers["d_head"] = (padded_d, padded_vocab)
  aliases = {}
  for position, (name, shape) in enumerate(buffers.items()):
    aliases[len(inputs)] = position
    inputs[f"{name}_init"] = jnp.zeros(shape, jnp.float32)
  outputs = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in buffers.items()}
  out = _call(functools.partial(_grad_kernel, tiles=tiles, cot_names=cot_names,
                                head_grad=head_grad),
              (pl.cdiv(n, tiles.br), tiles.num_chunks), inputs, outputs, interpret,
              "fused_head_grad", aliases)
  d_draft = out["d_draft"].reshape(k, padded_rows, padded_d)[:, :n, :d]
  d_head = out["d_head"][:d, :x.head.shape[1]].astype(x.head.dtype) if head_grad else None
  return d_draft, d_head


def fused_head(x: HeadInputs, *, chunk_size: int | None = None, interpret=False):
  """The per-row outputs (`api.fused_head`) with the custom VJP of `common`."""
  return common.fused_head_from_passes("pallas_gpu", chunk_size=chunk_size,
                                       interpret=interpret)(*x)
