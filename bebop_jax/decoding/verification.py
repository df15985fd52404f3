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
  block         d_j ~ q_j, verified jointly (Sun et al., "Block Verification Accelerates
                Speculative Decoding", ICLR 2025): with w_0 = 1 and
                w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)), h_i = S_i / (S_i + 1 - w_i) where
                S_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)), and h_K = w_K, the accepted
                length is the largest i with a uniform eta_i <= h_i (0 if none); the next
                token comes from norm(max(0, w_tau p_{tau+1} - q_{tau+1})), or from the bonus
                p_{K+1} when tau = K. It accepts at least as many drafts in expectation as
                rejection, from the same on-path probabilities.
  exact         temperature 0: accept iff d_j == argmax p_j; the next token is argmax p at
                the first mismatch (or of the bonus). Equals greedy decoding token for token.

`mode` is a name of MODES, or a traced int32 index into SAMPLED_MODES (the modes of
temperature > 0): a switch runs the selected rule only, so a decoding loop compiled once
serves every sampled mode (speculative.py).

Only the distribution a row samples its next token from is built over the vocabulary (the
residual of its first rejected depth, or the bonus); acceptance needs the on-path
probabilities alone, except block verification's h_i (a sum over the vocabulary per depth).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bebop_jax.decoding import sampling

MODES = ("rejection", "greedy_draft", "strict", "block", "exact")
SAMPLED_MODES = MODES[:4]  # the modes a traced index selects; exact needs temperature 0
_RULE = {"strict": "greedy_draft"}  # modes whose verification is another mode's rule
_TINY = 1e-30
_HUGE = 1e30


def _on_path(draft_tokens: jax.Array, probs: jax.Array) -> jax.Array:
  """[B, K] the probability each distribution of `probs` [B, >=K, V] gives its draft."""
  k = draft_tokens.shape[1]
  return jnp.take_along_axis(probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]


def block_weights(draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Block verification's (w [B, K+1], h [B, K]) (module docstring): w[:, i] is w_i, with
  w_0 = 1; h[:, i-1] is h_i, the probability that depth i ends the accepted block when no
  later depth does."""
  p = _on_path(draft_tokens, target_probs)
  q = _on_path(draft_tokens, draft_probs)
  # A draft of target probability 0 ends every weight after it (w = 0); q(d) = 0 < p(d)
  # cannot come from sampling q and counts as a ratio above any weight's reach.
  ratio = jnp.where(p > 0, jnp.where(q > 0, p / jnp.maximum(q, _TINY), _HUGE), 0.0)

  def step(prev, r):
    nxt = jnp.minimum(prev * r, 1.0)
    return nxt, nxt
  _, w = jax.lax.scan(step, jnp.ones(ratio.shape[:1], ratio.dtype), ratio.T)
  w = w.T  # [B, K]: w_1 .. w_K
  k = draft_tokens.shape[1]
  # S_i (i < K) from the distributions at the next depth: target_probs[:, i], draft_probs[:, i].
  mass = jnp.sum(jnp.maximum(w[:, :k - 1, None] * target_probs[:, 1:k] - draft_probs[:, 1:k],
                             0.0), axis=-1)
  denom = mass + 1.0 - w[:, :k - 1]
  h_inner = jnp.where(denom > 0, mass / jnp.maximum(denom, _TINY), 1.0)
  h = jnp.concatenate([h_inner, w[:, k - 1:]], axis=1)
  return jnp.concatenate([jnp.ones_like(w[:, :1]), w], axis=1), h


def acceptance_probs(draft_tokens: jax.Array, draft_probs: jax.Array,
                     target_probs: jax.Array, mode: str) -> jax.Array:
  """[B, K] probability of accepting each draft given that all earlier ones were accepted
  (token-wise modes; block verification decides jointly: block_weights)."""
  p = _on_path(draft_tokens, target_probs)
  if mode in ("rejection", "block"):
    q = _on_path(draft_tokens, draft_probs)
    # A token of target probability 0 is never accepted, whatever q says (q(d) = 0 means d
    # was not drawn from q; accept it only if the target allows it).
    return jnp.where(p > 0, jnp.where(q > 0, jnp.minimum(1.0, p / jnp.maximum(q, _TINY)), 1.0),
                     0.0)
  if mode in ("greedy_draft", "strict"):
    return p
  if mode == "exact":
    k = draft_tokens.shape[1]
    return (draft_tokens == jnp.argmax(target_probs[:, :k], axis=-1)).astype(jnp.float32)
  raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")


def residual_probs(draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                   mode: str) -> jax.Array:
  """[B, K, V] the (unnormalised) distribution to sample from after rejecting draft j."""
  k = draft_tokens.shape[1]
  p = target_probs[:, :k]
  if mode == "exact":
    return jax.nn.one_hot(jnp.argmax(p, -1), p.shape[-1], dtype=p.dtype)
  if mode in ("rejection", "block"):  # block: the token-wise rule's (block_residual_probs)
    res = jnp.maximum(p - draft_probs, 0.0)
  elif mode in ("greedy_draft", "strict"):
    res = jnp.where(jax.nn.one_hot(draft_tokens, p.shape[-1], dtype=bool), 0.0, p)
  else:
    raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")
  # p == q cannot reject; guard the all-zero row anyway by falling back to p.
  return jnp.where(jnp.sum(res, -1, keepdims=True) > 0, res, p)


def block_residual_probs(w: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
                         ) -> jax.Array:
  """[B, K, V] block verification's (unnormalised) distribution of the next token when the
  accepted block ends at depth tau < K: max(0, w_tau p_{tau+1} - q_{tau+1}) (w from
  block_weights; tau = 0 gives rejection's residual)."""
  k = draft_probs.shape[1]
  p = target_probs[:, :k]
  res = jnp.maximum(w[:, :k, None] * p - draft_probs, 0.0)
  # Never chosen when empty (h = 0 or the block continues); guard the row anyway.
  return jnp.where(jnp.sum(res, -1, keepdims=True) > 0, res, p)


def bonus_probs(target_probs: jax.Array) -> jax.Array:
  """[B, 1, V] the distribution of the token after all K drafts are accepted: the target's
  at the position after the last draft, p_{K+1} (the last of `target_probs` [B, K+1, V])."""
  return target_probs[:, -1:]


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
  # All of a row's randomness in one PRNG call: K acceptance uniforms, then the uniform of
  # the next-token sample (sampling.categorical).
  u = jax.vmap(lambda key: jax.random.uniform(key, (k + 1,)))(keys)
  uniforms = u[:, :k]
  args = (uniforms, draft_tokens, draft_probs, target_probs)
  if isinstance(mode, str):
    num_accepted, chosen = _decide(mode, *args)
  else:  # a traced index: only the selected rule runs
    mode = jnp.asarray(mode, jnp.int32)
    if mode.ndim:
      raise ValueError(f"a traced mode is one index into SAMPLED_MODES, not shape {mode.shape}")
    # greedy_draft and strict share their rule: one branch for both.
    rules = ("rejection", "greedy_draft", "block")
    branch = jnp.asarray([rules.index(_RULE.get(m, m)) for m in SAMPLED_MODES])[mode]
    num_accepted, chosen = jax.lax.switch(
        branch, [functools.partial(_decide, m) for m in rules], *args)
  return num_accepted, sampling.categorical(u[:, k], chosen)


def _decide(mode: str, uniforms: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
            target_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(num_accepted [B] int32, the unnormalised distribution [B, V] of the next token) under
  the named `mode`, given the K acceptance uniforms [B, K]. Only the distribution the row
  samples from is built: the residual at its first rejection, or the bonus p_{K+1}."""
  k = draft_tokens.shape[1]
  if mode == "block":
    w, h = block_weights(draft_tokens, draft_probs, target_probs)
    # The block ends at the deepest i with eta_i <= h_i (0 when there is none).
    depth = jnp.arange(1, k + 1, dtype=jnp.int32)
    num_accepted = jnp.max(jnp.where(uniforms <= h, depth, 0), axis=1)
  else:
    accept = uniforms < acceptance_probs(draft_tokens, draft_probs, target_probs, mode)
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  num_accepted = num_accepted.astype(jnp.int32)
  # The residual of the first rejected depth j (clipped to K - 1 when all K are accepted,
  # where the bonus is chosen instead), as a K = 1 slice of every input.
  j = jnp.minimum(num_accepted, k - 1)[:, None]
  row = lambda x: jnp.take_along_axis(x, j[..., None], axis=1)  # [B, 1, V]
  p_j, q_j = row(target_probs), row(draft_probs)
  if mode == "block":
    residual = block_residual_probs(jnp.take_along_axis(w, j, axis=1), q_j, p_j)
  else:
    residual = residual_probs(jnp.take_along_axis(draft_tokens, j, axis=1), q_j, p_j, mode)
  bonus = bonus_probs(target_probs)
  if mode == "exact":
    bonus = jax.nn.one_hot(jnp.argmax(bonus, -1), bonus.shape[-1], dtype=bonus.dtype)
  chosen = jnp.where((num_accepted == k)[:, None, None], bonus, residual)
  return num_accepted, chosen[:, 0]


def expected_accepted(alphas: jax.Array) -> jax.Array:
  """sum_{k<=K} prod_{j<=k} alpha_j over the last axis: expected accepted drafts per step."""
  return jnp.sum(jnp.cumprod(alphas, axis=-1), axis=-1)


def per_draft_acceptance(draft_probs: jax.Array, target_probs: jax.Array, mode: str
                         ) -> jax.Array:
  """alpha of each mode from the two distributions [..., V] (DESIGN.md 4). Block
  verification has no per-draft rate of its own (it decides jointly); its alpha is
  rejection's, whose expected accepted length is a lower bound of block's."""
  if mode in ("rejection", "block"):
    return jnp.sum(jnp.minimum(target_probs, draft_probs), axis=-1)
  if mode == "greedy_draft":
    return jnp.take_along_axis(target_probs, jnp.argmax(draft_probs, -1)[..., None], -1)[..., 0]
  if mode == "strict":
    return jnp.sum(target_probs * draft_probs, axis=-1)
  if mode == "exact":
    return (jnp.argmax(draft_probs, -1) == jnp.argmax(target_probs, -1)).astype(jnp.float32)
  raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")
