"""Verification of K drafted tokens against the target distributions (DESIGN.md 4).

`verify(rng, draft_tokens, draft_probs, target_probs, mode)`:
  draft_tokens [B, K] int, draft_probs [B, K, V] (the draft distribution q_j each draft was
  drawn from), target_probs [B, K+1, V] (p_j scores draft j; p_K is the bonus distribution),
  both already transformed by temperature / top-k / top-p.
Returns (num_accepted [B] int32 in [0, K], next_token [B] int32): the token emitted after the
accepted prefix, resampled at the first rejection, or drawn from the bonus distribution when
all K drafts are accepted.

Modes, each preserving the target distribution exactly:
  rejection     accept d_j with prob min(1, p(d_j)/q(d_j)); at the first rejection sample
                from norm(max(0, p - q)).           per-draft acceptance 1 - TV(p, q)
  greedy_draft  d_j = argmax q_j; accept with prob p(d_j); on rejection sample from p with
                d_j removed, renormalised.          acceptance p(argmax q)
  strict        d_j ~ q_j; accept iff a sample s ~ p equals d_j; otherwise emit s, i.e. a
                sample of p conditioned on != d_j.  acceptance sum_v p_v q_v
  exact         temperature 0: accept iff d_j == argmax p_j; the next token is argmax p at
                the first mismatch (or of the bonus). Equals greedy decoding token for token.

`mode` is a name of MODES, or a traced int32 index into SAMPLED_MODES (the modes of
temperature > 0): then both verification rules are computed and the index selects one, so a
decoding loop compiled once serves every sampled mode (speculative.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MODES = ("rejection", "greedy_draft", "strict", "exact")
SAMPLED_MODES = MODES[:3]  # the modes a traced index selects; exact needs temperature 0
_TINY = 1e-30


def _by_mode(mode, rule):
  """rule(mode) for a mode name; for a traced index into SAMPLED_MODES, rejection's rule or
  the one greedy_draft and strict share, selected elementwise."""
  if isinstance(mode, str):
    return rule(mode)
  return jnp.where(mode == SAMPLED_MODES.index("rejection"), rule("rejection"),
                   rule("greedy_draft"))


def _categorical(gumbel: jax.Array, probs: jax.Array) -> jax.Array:
  """One sample per row of unnormalised non-negative weights [B, V] given standard Gumbel
  noise [B, V] (Gumbel-max)."""
  logits = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, _TINY)), -jnp.inf)
  return jnp.argmax(logits + gumbel, axis=-1).astype(jnp.int32)


def acceptance_probs(draft_tokens: jax.Array, draft_probs: jax.Array,
                     target_probs: jax.Array, mode: str) -> jax.Array:
  """[B, K] probability of accepting each draft given that all earlier ones were accepted."""
  if not isinstance(mode, str):
    return _by_mode(mode, lambda m: acceptance_probs(draft_tokens, draft_probs, target_probs, m))
  k = draft_tokens.shape[1]
  p = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
  if mode == "rejection":
    q = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    # A token of target probability 0 is never accepted, whatever q says (q(d) = 0 means d
    # was not drawn from q; accept it only if the target allows it).
    return jnp.where(p > 0, jnp.where(q > 0, jnp.minimum(1.0, p / jnp.maximum(q, _TINY)), 1.0),
                     0.0)
  if mode in ("greedy_draft", "strict"):
    return p
  if mode == "exact":
    return (draft_tokens == jnp.argmax(target_probs[:, :k], axis=-1)).astype(jnp.float32)
  raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")


def residual_probs(draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                   mode: str) -> jax.Array:
  """[B, K, V] the (unnormalised) distribution to sample from after rejecting draft j."""
  k = draft_tokens.shape[1]
  p = target_probs[:, :k]
  if isinstance(mode, str) and mode == "exact":
    return jax.nn.one_hot(jnp.argmax(p, -1), p.shape[-1], dtype=p.dtype)
  if isinstance(mode, str) and mode not in SAMPLED_MODES:
    raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")

  def residual(m):
    if m == "rejection":
      return jnp.maximum(p - draft_probs, 0.0)
    return jnp.where(jax.nn.one_hot(draft_tokens, p.shape[-1], dtype=bool), 0.0, p)
  res = _by_mode(mode, residual)
  # p == q cannot reject; guard the all-zero row anyway by falling back to p.
  return jnp.where(jnp.sum(res, -1, keepdims=True) > 0, res, p)


def _row_keys(rng: jax.Array, b: int) -> jax.Array:
  """B typed keys from one key or B keys, typed or legacy uint32."""
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))
  if rng.ndim == 0:
    return jax.random.split(rng, b)
  if rng.shape != (b,):
    raise ValueError(f"rng holds keys of shape {rng.shape}; want one key or {b} (one per row)")
  return rng


def verify(rng: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
           target_probs: jax.Array, mode) -> tuple[jax.Array, jax.Array]:
  """(num_accepted [B], next_token [B]); see the module docstring (`mode`: a name, or a
  traced index into SAMPLED_MODES).

  `rng` is one key, or B keys (one per row: then a row's result depends on its own key and
  inputs only, whatever the rest of the batch holds), typed (`jax.random.key`) or legacy
  uint32 (`jax.random.PRNGKey`, shape [2] or [B, 2]). In `greedy_draft` mode the given
  draft tokens are the ones scored (the caller drafts argmax q); a token of target
  probability 0 is never emitted.
  """
  if isinstance(mode, str) and mode not in MODES:
    raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")
  b, k = draft_tokens.shape
  if draft_probs.shape[:2] != (b, k) or target_probs.shape[:2] != (b, k + 1):
    raise ValueError(f"shapes do not fit: draft_tokens {draft_tokens.shape}, draft_probs "
                     f"{draft_probs.shape} (want [B, K, V]), target_probs "
                     f"{target_probs.shape} (want [B, K+1, V])")
  draft_probs = draft_probs.astype(jnp.float32)
  target_probs = target_probs.astype(jnp.float32)
  draft_tokens = draft_tokens.astype(jnp.int32)
  keys = _row_keys(rng, b)
  # All of a row's randomness in one PRNG call: K acceptance uniforms, then the Gumbel noise
  # of the next-token sample (minval tiny keeps the logs finite).
  v = target_probs.shape[-1]
  u = jax.vmap(lambda key: jax.random.uniform(
      key, (k + v,), minval=jnp.finfo(jnp.float32).tiny))(keys)
  uniforms, gumbel = u[:, :k], -jnp.log(-jnp.log(u[:, k:]))
  accept = uniforms < acceptance_probs(
      draft_tokens, draft_probs, target_probs, mode)
  num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  # Row a of [residuals..., bonus] is the distribution of the token after a accepted drafts.
  bonus = target_probs[:, k:]
  if isinstance(mode, str) and mode == "exact":
    bonus = jax.nn.one_hot(jnp.argmax(bonus, -1), bonus.shape[-1], dtype=bonus.dtype)
  after = jnp.concatenate(
      [residual_probs(draft_tokens, draft_probs, target_probs, mode), bonus], axis=1)
  chosen = jnp.take_along_axis(after, num_accepted[:, None, None], axis=1)[:, 0]
  return num_accepted.astype(jnp.int32), _categorical(gumbel, chosen)


def expected_accepted(alphas: jax.Array) -> jax.Array:
  """sum_{k<=K} prod_{j<=k} alpha_j over the last axis: expected accepted drafts per step."""
  return jnp.sum(jnp.cumprod(alphas, axis=-1), axis=-1)


def per_draft_acceptance(draft_probs: jax.Array, target_probs: jax.Array, mode: str
                         ) -> jax.Array:
  """alpha of each mode from the two distributions [..., V] (DESIGN.md 4)."""
  if mode == "rejection":
    return jnp.sum(jnp.minimum(target_probs, draft_probs), axis=-1)
  if mode == "greedy_draft":
    return jnp.take_along_axis(target_probs, jnp.argmax(draft_probs, -1)[..., None], -1)[..., 0]
  if mode == "strict":
    return jnp.sum(target_probs * draft_probs, axis=-1)
  if mode == "exact":
    return (jnp.argmax(draft_probs, -1) == jnp.argmax(target_probs, -1)).astype(jnp.float32)
  raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")
