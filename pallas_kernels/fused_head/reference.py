"""Dense truth: the [K, N, V] logits materialized in float32, outputs by jax.nn, plain autodiff.

`logsumexp_pass`, `overlap_pass` and `grad_pass` are the same math as dense pieces for a
vocabulary split across devices (`sharded`); there the gradient is the analytic one of
`common` (the same as autodiff off ties, see tv_loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fused_head import common
from pallas_kernels.fused_head.common import Cotangents, FirstPass, HeadInputs, Overlap, Residuals


def _logits(hidden: jax.Array, head: jax.Array, bias: jax.Array | None) -> jax.Array:
  hidden, head = common.promote(hidden, head)
  z = jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)
  return z if bias is None else z + bias


def _target_logits(x: HeadInputs) -> jax.Array:
  if x.target_logits is not None:
    return jax.lax.stop_gradient(x.target_logits).astype(jnp.float32)
  return _logits(jax.lax.stop_gradient(x.target_hidden), jax.lax.stop_gradient(x.head),
                 x.bias)


def fused_head(x: HeadInputs, *, chunk_size: int | None = None,
               interpret=False) -> dict[str, jax.Array]:
  """Per-row entropy, max_logprob, logprob (with tokens), tv and kl (with a target), each
  [K, N] float32.

  The target is a constant (stop-gradient); gradients reach the draft hidden states and the
  head by autodiff. `chunk_size` and `interpret` are unused.
  """
  del chunk_size, interpret
  log_q = jax.nn.log_softmax(_logits(x.draft, x.head, x.bias), axis=-1)
  q = jnp.exp(log_q)
  outputs = {"entropy": -jnp.sum(q * jnp.where(q > 0, log_q, 0.0), axis=-1),
             "max_logprob": jax.lax.stop_gradient(jnp.max(log_q, axis=-1))}
  if x.tokens is not None:
    outputs["logprob"] = jnp.take_along_axis(log_q, x.tokens[..., None], axis=-1)[..., 0]
  if x.has_target:
    log_p = jax.nn.log_softmax(_target_logits(x), axis=-1)
    p = jnp.exp(log_p)
    outputs["tv"] = 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
    outputs["kl"] = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
  return outputs


# The passes, densely over the columns at hand (one vocabulary shard under `sharded`).


def _columns(x: HeadInputs) -> jax.Array:
  return jnp.arange(x.head.shape[1])


def logsumexp_pass(x: HeadInputs, *, chunk_size=None, interpret=False) -> FirstPass:
  del chunk_size, interpret
  z = _logits(x.draft, x.head, x.bias)
  lse_q, entropy = common.logsumexp_finish(
      *common.logsumexp_update(*common.logsumexp_init(z.shape[:-1] + (1,)), z))
  token_logit = None
  if x.tokens is not None:
    hit = _columns(x) == x.tokens[..., None]
    token_logit = jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
  lse_p = None
  if x.has_target:
    lse_p = jax.nn.logsumexp(_target_logits(x), axis=-1)
  return FirstPass(lse_q[..., 0], entropy[..., 0], token_logit, lse_p, jnp.max(z, axis=-1))


def overlap_pass(x: HeadInputs, lse_q, lse_p, *, chunk_size=None, interpret=False) -> Overlap:
  del chunk_size, interpret
  terms = common.overlap_terms(_logits(x.draft, x.head, x.bias) - lse_q[..., None],
                               _target_logits(x) - lse_p[:, None])
  return Overlap(*(jnp.sum(term, axis=-1) for term in terms))


def grad_pass(x: HeadInputs, res: Residuals, cot: Cotangents, *, head_grad: bool,
              chunk_size=None, interpret=False):
  del chunk_size, interpret
  rows = lambda a: None if a is None else a[..., None]
  grad = common.logit_grad(
      _logits(x.draft, x.head, x.bias), rows(res.lse_q), rows(res.entropy),
      Cotangents(*map(rows, cot)),
      t=_target_logits(x) if cot.needs_target else None, lse_p=rows(res.lse_p),
      below_mass=rows(res.below_mass),
      hits=None if cot.logprob is None else common.token_hits(_columns(x),
                                                             x.tokens[..., None]))
  d_draft = jnp.einsum("knv,dv->knd", grad, x.head.astype(jnp.float32))
  d_head = None
  if head_grad:
    d_head = jnp.einsum("knd,knv->dv", x.draft.astype(jnp.float32), grad).astype(x.head.dtype)
  return d_draft, d_head
