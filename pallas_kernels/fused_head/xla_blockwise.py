"""The fused head in plain XLA: `lax.fori_loop`s over vocabulary chunks (any backend, CPU default).

Each pass slices a [d, C] chunk of the head (and of the bias and given target logits),
computes the chunk's [K, N, C] draft logits (and [N, C] target logits) with one matmul each in
float32, and reduces them per row (`common`):
  pass 1 (`logsumexp_pass`): online log-sum-exp, entropy and max of q's logits, the token's
          logit, and the log-sum-exp of p;
  pass 2 (`overlap_pass`): alpha = sum min(p, q), S = sum_{q<p} q and KL(p || q);
  backward (`grad_pass`): the chunk's logit gradient g, then dh += g W_c^T and
          dW[:, chunk] = h^T g (each head column is written once, in the head's dtype).
No [N, V] array exists: the loop carries are per-row statistics, the [K, N, d] hidden-state
gradient and the [d, V] head gradient. When C does not divide V the last, shorter chunk runs
after the loop with a static size (no padding, no masking).

On CPU a bfloat16 head (or target logits) is sliced as raw 16-bit patterns: XLA:CPU computes
bfloat16 in float32 and would hoist a whole-array convert out of the loop (as tv_loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fused_head import common
from pallas_kernels.fused_head.common import Cotangents, FirstPass, HeadInputs, Overlap, Residuals

DEFAULT_CHUNK_SIZE = 2048


def _chunk(vocab: int, chunk_size: int | None) -> int:
  return min(chunk_size or DEFAULT_CHUNK_SIZE, vocab)


def _over_chunks(vocab: int, chunk: int, body, carry):
  """carry = body(start, size, carry) over [0, V): full chunks in a fori_loop, then the tail."""
  full, tail = divmod(vocab, chunk)
  if full:
    carry = lax.fori_loop(0, full, lambda i, c: body(i * chunk, chunk, c), carry)
  if tail:
    carry = body(full * chunk, tail, carry)
  return carry


def _columns(x: jax.Array, start, size: int) -> jax.Array:
  """Columns [start, start + size) of a [R, V] array, in its own dtype."""
  if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    bits = lax.dynamic_slice_in_dim(lax.bitcast_convert_type(x, jnp.uint16), start, size,
                                    axis=1)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)
  return lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _logits(hidden: jax.Array, head_chunk: jax.Array, bias_chunk) -> jax.Array:
  """[..., d] x [d, C] -> [..., C] float32 logits (+ bias)."""
  hidden, head_chunk = common.promote(hidden, head_chunk)
  z = jnp.einsum("...d,dc->...c", hidden, head_chunk, preferred_element_type=jnp.float32)
  return z if bias_chunk is None else z + bias_chunk


class _Chunk:
  """One chunk's head columns, bias and logits, computed on first use."""

  def __init__(self, x: HeadInputs, start, size: int):
    self.x, self.start, self.size = x, start, size
    self.head = _columns(x.head, start, size)
    self.bias = None if x.bias is None else lax.dynamic_slice_in_dim(x.bias, start, size)

  def columns(self) -> jax.Array:
    return self.start + jnp.arange(self.size)

  def draft(self) -> jax.Array:  # [K, N, C]
    return _logits(self.x.draft, self.head, self.bias)

  def target(self) -> jax.Array:  # [N, C]
    if self.x.target_logits is not None:
      return _columns(self.x.target_logits, self.start, self.size).astype(jnp.float32)
    return _logits(self.x.target_hidden, self.head, self.bias)


def logsumexp_pass(x: HeadInputs, *, chunk_size: int | None = None,
                   interpret=False) -> FirstPass:
  """Pass 1: per-row log-sum-exp, entropy and max logit of q, z_tok (with tokens), lse_p
  (with a target). `interpret` unused."""
  del interpret
  k, n, _ = x.draft.shape
  vocab = x.head.shape[1]

  def body(start, size, carry):
    draft_state, token_logit, target_state = carry
    chunk = _Chunk(x, start, size)
    z = chunk.draft()
    draft_state = common.logsumexp_update(*draft_state, z)
    if token_logit is not None:
      hit = chunk.columns() == x.tokens[..., None]
      token_logit = token_logit + jnp.sum(jnp.where(hit, z, 0.0), axis=-1, keepdims=True)
    if target_state is not None:
      target_state = common.logsumexp_update(*target_state, chunk.target())
    return draft_state, token_logit, target_state

  init = (common.logsumexp_init((k, n, 1)),
          None if x.tokens is None else jnp.zeros((k, n, 1), jnp.float32),
          (common.logsumexp_init((n, 1))[:2] + (None,)) if x.has_target else None)
  draft_state, token_logit, target_state = _over_chunks(
      vocab, _chunk(vocab, chunk_size), body, init)
  lse_q, entropy = common.logsumexp_finish(*draft_state)
  lse_p = None if target_state is None else common.logsumexp_finish(*target_state)[0][:, 0]
  return FirstPass(lse_q[..., 0], entropy[..., 0],
                   None if token_logit is None else token_logit[..., 0], lse_p,
                   draft_state[0][..., 0])


def overlap_pass(x: HeadInputs, lse_q: jax.Array, lse_p: jax.Array, *,
                 chunk_size: int | None = None, interpret=False) -> Overlap:
  """Pass 2 under the normalisers lse_q [K, N], lse_p [N]: (alpha, S, KL), each [K, N]."""
  del interpret
  k, n, _ = x.draft.shape
  vocab = x.head.shape[1]
  lse_q, lse_p = lse_q[..., None], lse_p[:, None]

  def body(start, size, sums):
    chunk = _Chunk(x, start, size)
    terms = common.overlap_terms(chunk.draft() - lse_q, chunk.target() - lse_p)
    return tuple(acc + jnp.sum(term, axis=-1, keepdims=True) for acc, term in zip(sums, terms))

  sums = _over_chunks(vocab, _chunk(vocab, chunk_size), body,
                      (jnp.zeros((k, n, 1), jnp.float32),) * 3)
  return Overlap(*(s[..., 0] for s in sums))


def grad_pass(x: HeadInputs, res: Residuals, cot: Cotangents, *, head_grad: bool,
              chunk_size: int | None = None, interpret=False):
  """(d draft [K, N, d] float32, d head [d, V] in head's dtype or None) for per-row
  cotangents `cot`, recomputing each chunk's logits (the target's only for TV / KL)."""
  del interpret
  vocab = x.head.shape[1]
  d_head = jnp.zeros(x.head.shape, x.head.dtype) if head_grad else None
  if all(c is None for c in cot):
    return jnp.zeros(x.draft.shape, jnp.float32), d_head
  rows = lambda a: None if a is None else a[..., None]
  per_row = dict(lse_p=rows(res.lse_p), below_mass=rows(res.below_mass))
  cot_rows = Cotangents(*map(rows, cot))
  draft_f32 = x.draft.astype(jnp.float32)

  def body(start, size, carry):
    d_draft, d_head = carry
    chunk = _Chunk(x, start, size)
    grad = common.logit_grad(
        chunk.draft(), rows(res.lse_q), rows(res.entropy), cot_rows,
        t=chunk.target() if cot.needs_target else None,
        hits=None if cot.logprob is None else common.token_hits(chunk.columns(),
                                                               x.tokens[..., None]),
        **per_row)
    head_f32 = chunk.head.astype(jnp.float32)
    d_draft = d_draft + jnp.einsum("knc,dc->knd", grad, head_f32)
    if d_head is not None:
      d_chunk = jnp.einsum("knd,knc->dc", draft_f32, grad)
      d_head = lax.dynamic_update_slice_in_dim(d_head, d_chunk.astype(d_head.dtype), start,
                                               axis=1)
    return d_draft, d_head

  return _over_chunks(vocab, _chunk(vocab, chunk_size), body,
                      (jnp.zeros(x.draft.shape, jnp.float32), d_head))


def fused_head(x: HeadInputs, *, chunk_size: int | None = None, interpret=False):
  """The per-row outputs (`api.fused_head`) with the custom VJP of `common`."""
  del interpret
  return common.fused_head_from_passes("xla_blockwise", chunk_size=chunk_size)(*x)
