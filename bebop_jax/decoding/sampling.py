"""Sampling transforms, applied identically to target and draft distributions.

`sampling_logprobs(logits, params)` turns raw logits into the log-probabilities of the
distribution actually sampled from: temperature, then top-k, then top-p (nucleus). Entries
removed by top-k/top-p are -inf. Temperature 0 means greedy (argmax of the raw logits); its
"distribution" is one-hot at the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature >= 0 (0 = greedy); top_k 0 = off; top_p 1.0 = off."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} is not allowed: must be >= 0")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} is not allowed: must be >= 0 (0 = off)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} is not allowed: must be in (0, 1]")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sampling_logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probabilities [..., V] (float32) of the sampling distribution of `logits`."""
  x = logits.astype(jnp.float32)
  if params.greedy:
    return jnp.log(jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32))
  x = x / params.temperature
  if 0 < params.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if params.top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    # Keep the smallest prefix whose mass reaches top_p: entries with mass-before < top_p.
    keep_sorted = before < params.top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < threshold, -jnp.inf, x)
  return jax.nn.log_softmax(x, axis=-1)


def entropy(logits: jax.Array, params: SamplingParams | None = None,
            logprobs: jax.Array | None = None) -> jax.Array:
  """Entropy (nats) of softmax(logits) over the last axis, float32. `logprobs`, the sampling
  log-probabilities of the same logits under `params` (sampling_logprobs), are reused when
  those params leave the distribution as it is (temperature 1, no top-k, no top-p)."""
  identity = (params is not None and params.temperature == 1.0 and params.top_k == 0
              and params.top_p == 1.0)
  logp = logprobs if identity and logprobs is not None else jax.nn.log_softmax(
      logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * jnp.where(jnp.isfinite(logp), logp, 0.0), axis=-1)


def sample(keys: jax.Array, logprobs: jax.Array) -> jax.Array:
  """One token per row from log-probabilities [B, V] with one key per row (so a row's sample
  does not depend on the batch it is in)."""
  u = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)
  return categorical(u, jnp.exp(logprobs))


_BLOCK = 256  # categorical's block of the vocabulary


def categorical(u: jax.Array, weights: jax.Array) -> jax.Array:
  """One sample per row of unnormalised non-negative weights [B, V] (int32 [B]) given one
  uniform per row, u [B] in [0, 1): the inverse of the cumulative distribution, in two
  levels (the first block of 256 entries whose running mass exceeds u times the total, then
  the entry inside it). A token of weight 0 is never returned (float cumulative sums of
  non-negative terms never decrease; a rounding overshoot falls back to the last entry of
  positive weight).

  One uniform per row instead of a Gumbel variate per entry (jax.random.categorical): on CPU
  the PRNG's threefry rounds for every entry and Gumbel-max's logarithms cost more than the
  rest of a sample at a large vocabulary (experiments/profile_speculative.py measures both);
  this costs a sum and a short cumulative sum per block."""
  b, v = weights.shape
  nb = -(-v // _BLOCK)
  w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, nb * _BLOCK - v)))
  w = w.reshape(b, nb, _BLOCK)
  mass = jnp.sum(w, axis=-1)  # [B, nb]
  cum = jnp.cumsum(mass, axis=-1)
  goal = u.astype(jnp.float32) * cum[:, -1]
  last = lambda positive: positive.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
  blk = jnp.minimum(jnp.sum(cum <= goal[:, None], axis=-1), last(mass > 0))
  before = jnp.where(blk > 0, jnp.take_along_axis(cum, jnp.maximum(blk - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
  inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
  pos = jnp.sum(jnp.cumsum(inner, axis=-1) <= (goal - before)[:, None], axis=-1)
  pos = jnp.minimum(pos, last(inner > 0))
  return (blk * _BLOCK + pos).astype(jnp.int32)


def row_keys(rng: jax.Array, batch: int) -> jax.Array:
  """Per-row keys [B] derived from one key by row index (independent of the batch size)."""
  return jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(batch))


def split_rows(keys: jax.Array, num: int) -> jax.Array:
  """[num, B] fresh keys from per-row keys [B]."""
  return jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, num))(keys), 0, 1)


def append_sample(out, logits: jax.Array, key: jax.Array, active: jax.Array,
                  params: SamplingParams):
  """(out with one more token per active row, the tokens [B]): samples from `logits` [B, V]
  under `params` with per-row keys [B] and writes the token, its log-prob, the raw entropy
  and a policy-mask True at each active row's next output slot (`out.lengths`); inactive
  rows are left as they are. `out` is a decoding output with tokens, policy_mask, logprobs,
  entropy [B, N] and lengths [B]."""
  rows = jnp.arange(logits.shape[0])
  logp = sampling_logprobs(logits, params)
  tok = sample(key, logp)
  slot = jnp.where(active, out.lengths, out.tokens.shape[1])  # dropped for inactive rows
  out = out.replace(
      tokens=out.tokens.at[rows, slot].set(tok, mode="drop"),
      policy_mask=out.policy_mask.at[rows, slot].set(True, mode="drop"),
      logprobs=out.logprobs.at[rows, slot].set(logp[rows, tok], mode="drop"),
      entropy=out.entropy.at[rows, slot].set(entropy(logits, params, logp), mode="drop"),
      lengths=out.lengths + active)
  return out, tok
