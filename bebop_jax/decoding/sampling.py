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


def entropy(logits: jax.Array) -> jax.Array:
  """Entropy (nats) of softmax(logits) over the last axis, float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * jnp.where(jnp.isfinite(logp), logp, 0.0), axis=-1)


def sample(keys: jax.Array, logprobs: jax.Array) -> jax.Array:
  """One token per row from log-probabilities [B, V] with one key per row (so a row's sample
  does not depend on the batch it is in)."""
  return jax.vmap(lambda key, lp: jax.random.categorical(key, lp))(keys, logprobs).astype(
      jnp.int32)


def sample_with_noise(gumbel: jax.Array, logprobs: jax.Array) -> jax.Array:
  """argmax(logprobs + gumbel) over the last axis: a sample of softmax(logprobs) given
  standard Gumbel noise of the same shape (the Gumbel-max trick). Lets a loop draw the noise
  of several samples with one call to the PRNG: on CPU each call is a rolled threefry loop of
  dozens of tiny ops, which dominates a small model's decode step."""
  return jnp.argmax(logprobs + gumbel, axis=-1).astype(jnp.int32)


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
      entropy=out.entropy.at[rows, slot].set(entropy(logits), mode="drop"),
      lengths=out.lengths + active)
  return out, tok
