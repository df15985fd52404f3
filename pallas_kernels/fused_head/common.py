"""Math and plumbing shared by the fused-head implementations (pure jnp, usable in kernels).

Notation, per row: z = h W + b are the draft logits (f32), t the target logits (t = h_p W + b
from target hidden states, or given), q = softmax(z), p = softmax(t), tok a token id.
  lse_q = log sum_v exp z_v                      logprob = z_tok - lse_q
  entropy H = -sum_v q_v log q_v = lse_q - E_q[z]
  alpha = sum_v min(p_v, q_v), TV = 1 - alpha,   S = sum_{v: q_v < p_v} q_v
  KL(p || q) = sum_{v: p_v > 0} p_v (log p_v - log q_v)
Their gradients with respect to the draft logits z_u (the target is a constant):
  d TV / d z_u      = q_u (S - 1[q_u < p_u])     (strict indicator: 0 at a tie, as tv_loss)
  d KL / d z_u      = q_u - p_u
  d logprob / d z_u = 1[u = tok] - q_u
  d H / d z_u       = -q_u (log q_u + H)
so with per-row cotangents c_tv, c_kl, c_lp, c_h the logit gradient of a chunk is
  g = q * (c_tv (S - 1[q < p]) + c_kl - c_lp - c_h (log q + H)) - c_kl p + c_lp 1[u = tok],
and the hidden-state and head gradients are dh = sum_chunks g W_chunk^T, dW_chunk = h^T g.

Pass 1 (`logsumexp_pass`) folds each chunk of logits into a running (max m, sum s = sum
exp(z - m), u = sum exp(z - m) (z - m)) per row: lse = m + log s and H = log s - u / s
(shift-invariant, no cancellation against large logits); m itself gives max_logprob =
m - lse_q = max_v log q_v, the log-probability of the mode (no gradient: an accuracy test
`logprob >= max_logprob`). Pass 2 (`overlap_pass`) needs the
final normalisers: alpha, S and KL. Both passes and the gradient pass recompute each chunk's
logits from h and W; only per-row residuals are kept.

Every implementation module provides `logsumexp_pass`, `overlap_pass` and `grad_pass` with
the signatures of `xla_blockwise`; `forward` and `backward` here compose them, with the
collectives of a vocabulary split across devices when `vocab_axes` is given (`sharded`), and
`make_fused_head` wraps them in a custom VJP.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

NEG_INF = float("-inf")


class HeadInputs(NamedTuple):
  """The arrays one fused-head call works on (flattened by `api`)."""
  draft: jax.Array  # [K, N, d] draft hidden states (after the final norm)
  head: jax.Array  # [d, V] output head W
  bias: jax.Array | None = None  # [V] float32 added to logits made from `head`; -inf masks
  tokens: jax.Array | None = None  # [K, N] int32 in [0, V)
  target_hidden: jax.Array | None = None  # [N, d]: t = target_hidden W (+ bias), constant
  target_logits: jax.Array | None = None  # [N, V]: t given, constant

  @property
  def has_target(self) -> bool:
    return self.target_hidden is not None or self.target_logits is not None


class FirstPass(NamedTuple):
  """Pass 1 per row; on a vocabulary shard, over its columns only."""
  lse_q: jax.Array  # [K, N]
  entropy: jax.Array  # [K, N]
  token_logit: jax.Array | None  # [K, N] z_tok (0 where tok is not among the columns)
  lse_p: jax.Array | None  # [N]
  max_logit: jax.Array  # [K, N] max_v z_v (over the columns at hand)


class Overlap(NamedTuple):
  """Pass 2 per row, [K, N] each: sums over the (local) columns."""
  alpha: jax.Array
  below_mass: jax.Array
  kl: jax.Array


class Residuals(NamedTuple):
  """What the backward needs besides the inputs: per-row statistics only."""
  lse_q: jax.Array  # [K, N]
  entropy: jax.Array  # [K, N]
  below_mass: jax.Array | None  # [K, N] S (with a target)
  lse_p: jax.Array | None  # [N] (with a target)


class Cotangents(NamedTuple):
  """Per-row cotangents [K, N] of the outputs; None is a (symbolic) zero."""
  tv: jax.Array | None = None
  kl: jax.Array | None = None
  logprob: jax.Array | None = None
  entropy: jax.Array | None = None

  @property
  def needs_target(self) -> bool:
    return self.tv is not None or self.kl is not None


# ------------------------------------------------------------------ per-chunk math


def mask_columns(x: jax.Array, valid: jax.Array | None) -> jax.Array:
  return x if valid is None else jnp.where(valid, x, NEG_INF)


def logsumexp_init(shape) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(max, sum, u) of an empty online log-sum-exp."""
  return (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape, jnp.float32))


def logsumexp_update(running_max: jax.Array, running_sum: jax.Array,
                     running_u: jax.Array | None, block: jax.Array):
  """Folds a [..., C] block of logits into (max, sum exp(x - max), sum exp(x - max) (x - max))
  of shape [..., 1]; `running_u` None skips the entropy term (the target needs none).

  NaN-free while every logit seen so far is -inf: the shift is 0 then (as tv_loss).
  """
  new_max = jnp.maximum(running_max, jnp.max(block, axis=-1, keepdims=True))
  shift = jnp.where(new_max == NEG_INF, 0.0, new_max)
  scale = jnp.exp(running_max - shift)
  e = jnp.exp(block - shift)
  new_sum = running_sum * scale + jnp.sum(e, axis=-1, keepdims=True)
  if running_u is None:
    return new_max, new_sum, None
  centred = jnp.where(e > 0, block - shift, 0.0)  # -inf entries add 0, not 0 * -inf
  carried = jnp.where(running_sum > 0,
                      scale * (running_u + (running_max - shift) * running_sum), 0.0)
  return new_max, new_sum, carried + jnp.sum(e * centred, axis=-1, keepdims=True)


def logsumexp_finish(running_max, running_sum, running_u=None):
  """(lse, entropy) from the online state; entropy is None without `running_u`."""
  log_sum = jnp.log(running_sum)
  entropy = None if running_u is None else log_sum - running_u / running_sum
  return running_max + log_sum, entropy


def token_hits(columns: jax.Array, tokens: jax.Array) -> jax.Array:
  """1[column == token] as float32; columns [..., C] (or broadcastable), tokens [..., 1]."""
  return (columns == tokens).astype(jnp.float32)


def overlap_terms(log_q: jax.Array, log_p: jax.Array):
  """Elementwise (min(p, q), 1[q < p] q, p (log p - log q) where p > 0); summed over the
  vocabulary they give alpha, S and KL(p || q)."""
  smaller = jnp.exp(jnp.minimum(log_q, log_p))
  below = jnp.where(log_q < log_p, smaller, 0.0)
  p = jnp.exp(log_p)
  return smaller, below, jnp.where(p > 0, p * (log_p - log_q), 0.0)


def logit_grad(z: jax.Array, lse_q, entropy, cot: Cotangents, *, t=None, lse_p=None,
               below_mass=None, hits=None) -> jax.Array:
  """The chunk's logit gradient g (module docstring), float32 like z.

  z, t: [..., C] logits (-inf where masked); per-row arguments broadcast as [..., 1]:
  lse_q, entropy, lse_p, below_mass and the cotangents; hits: [..., C] 1[u = tok].
  Masked entries (q = 0 there) get 0, except -c_kl p where the target has mass.
  """
  log_q = z - lse_q
  q = jnp.exp(log_q)
  coef = jnp.zeros_like(q)
  extra = None
  if cot.tv is not None:
    below = (log_q < t - lse_p).astype(jnp.float32)
    coef = coef + cot.tv * (below_mass - below)
  if cot.kl is not None:
    coef = coef + cot.kl
    extra = -cot.kl * jnp.exp(t - lse_p)
  if cot.logprob is not None:
    coef = coef - cot.logprob
    term = cot.logprob * hits
    extra = term if extra is None else extra + term
  if cot.entropy is not None:
    coef = coef - cot.entropy * (jnp.where(q > 0, log_q, 0.0) + entropy)
  grad = q * coef
  return grad if extra is None else grad + extra


def tv_from_alpha(alpha: jax.Array) -> jax.Array:
  """TV = 1 - alpha, clipped to [0, 1] against rounding in the sum."""
  return jnp.clip(1.0 - alpha, 0.0, 1.0)


def promote(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Both operands of a product in their common dtype (f32 accumulation is asked for)."""
  dtype = jnp.result_type(a.dtype, b.dtype)
  return a.astype(dtype), b.astype(dtype)


# ------------------------------------------------------------------ collectives


def combine_logsumexp(lse: jax.Array, axes) -> jax.Array:
  """The log-sum-exp over all shards of per-shard log-sum-exps (a shard may be all -inf)."""
  top = jax.lax.pmax(lse, axes)
  shift = jnp.where(top == NEG_INF, 0.0, top)
  return shift + jnp.log(jax.lax.psum(jnp.exp(lse - shift), axes))


def combine_entropy(local_lse: jax.Array, local_entropy: jax.Array, lse: jax.Array,
                    axes) -> jax.Array:
  """H = sum_shards w (H_shard + lse - lse_shard), w = exp(lse_shard - lse): the entropy of
  a mixture of the shards' softmaxes with weights w (a shard of only -inf has w = 0)."""
  weight = jnp.exp(local_lse - lse)
  return jax.lax.psum(
      jnp.where(weight > 0, weight * (local_entropy + lse - local_lse), 0.0), axes)


# ------------------------------------------------------------------ composition


def forward(module, x: HeadInputs, *, vocab_axes: tuple[str, ...] = (), **kw):
  """(outputs, residuals) from `module`'s passes; `vocab_axes` name the mesh axes that
  split the vocabulary (inside shard_map), whose per-shard sums are combined."""
  first = module.logsumexp_pass(x, **kw)
  lse_q, entropy, token_logit, lse_p, max_logit = first
  if vocab_axes:
    max_logit = jax.lax.pmax(max_logit, vocab_axes)
    global_lse_q = combine_logsumexp(lse_q, vocab_axes)
    entropy = combine_entropy(lse_q, entropy, global_lse_q, vocab_axes)
    lse_q = global_lse_q
    if token_logit is not None:
      token_logit = jax.lax.psum(token_logit, vocab_axes)
    if lse_p is not None:
      lse_p = combine_logsumexp(lse_p, vocab_axes)
  # The same subtraction as logprob's: logprob == max_logprob exactly when the token's logit
  # is the largest (a token at the mode; a constant, its cotangent is ignored).
  outputs = {"entropy": entropy, "max_logprob": max_logit - lse_q}
  if x.tokens is not None:
    outputs["logprob"] = token_logit - lse_q
  below_mass = None
  if x.has_target:
    alpha, below_mass, kl = module.overlap_pass(x, lse_q, lse_p, **kw)
    if vocab_axes:
      alpha, below_mass, kl = jax.lax.psum((alpha, below_mass, kl), vocab_axes)
    outputs["tv"] = tv_from_alpha(alpha)
    outputs["kl"] = kl
  return outputs, Residuals(lse_q, entropy, below_mass, lse_p)


def backward(module, x: HeadInputs, res: Residuals, cot: Cotangents, *, head_grad: bool,
             vocab_axes: tuple[str, ...] = (), row_axes: tuple[str, ...] = (), **kw):
  """(d draft [K, N, d] in draft's dtype, d head [d, V] in head's dtype or None). On a mesh
  the draft gradient sums over the vocabulary shards, the head's over the row shards."""
  d_draft, d_head = module.grad_pass(x, res, cot, head_grad=head_grad, **kw)
  if vocab_axes:
    d_draft = jax.lax.psum(d_draft, vocab_axes)
  if head_grad and row_axes:
    d_head = jax.lax.psum(d_head.astype(jnp.float32), row_axes)
  return (d_draft.astype(x.draft.dtype),
          None if d_head is None else d_head.astype(x.head.dtype))


def _value(arg):
  return None if arg is None else arg.value


def _cotangent(ct) -> jax.Array | None:
  return None if ct is None or isinstance(ct, SymbolicZero) else ct


def make_fused_head(forward_fn: Callable[[HeadInputs], Any],
                    backward_fn: Callable[..., Any]) -> Callable[..., dict[str, jax.Array]]:
  """A custom-VJP fused head from forward_fn(x) -> (outputs, residuals) and
  backward_fn(x, residuals, cotangents, head_grad=bool) -> (d draft, d head or None).

  Symbolic zeros decide what the backward computes: an output with no cotangent (unused, or
  behind stop_gradient) adds no term, the target is recomputed only for TV / KL cotangents,
  and the head gradient is computed only when the head is differentiated.
  """

  @jax.custom_vjp
  def fused_head(draft, head, bias, tokens, target_hidden, target_logits):
    x = HeadInputs(draft, head, bias, tokens, target_hidden, target_logits)
    return forward_fn(x)[0]

  def fwd(draft, head, bias, tokens, target_hidden, target_logits):
    x = HeadInputs(*map(_value, (draft, head, bias, tokens, target_hidden, target_logits)))
    outputs, residuals = forward_fn(x)
    return outputs, (x, residuals, () if head.perturbed else None)

  def bwd(saved, cts):
    x, residuals, head_grad = saved
    cot = Cotangents(**{k: _cotangent(cts.get(k)) for k in Cotangents._fields})
    d_draft, d_head = backward_fn(x, residuals, cot, head_grad=head_grad is not None)
    return d_draft, d_head, None, None, None, None  # bias, tokens and target: constants

  fused_head.defvjp(fwd, bwd, symbolic_zeros=True)
  return fused_head


@functools.lru_cache(maxsize=None)
def fused_head_from_passes(module_name: str, **kw) -> Callable[..., dict[str, jax.Array]]:
  """The custom-VJP fused head of an implementation module's passes (unsharded)."""
  module = importlib.import_module(f"pallas_kernels.fused_head.{module_name}")
  return make_fused_head(functools.partial(forward, module, **kw),
                         functools.partial(backward, module, **kw))
