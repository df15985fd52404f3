"""GRPO-family algorithms as pure jnp functions: group advantages and the clipped policy loss.

Rollouts of one prompt sit in consecutive rows (groups of `group_size`). Shapes: rewards and
advantages [B]; per-token arrays [B, T]; `mask` [B, T] (bool or 0/1) marks the tokens the
policy sampled (prompt, environment replies and padding are 0). The policy loss also takes
per-token advantages [B, T], for rows that pack several rollouts (rl/learner.py); the
per-row aggregations then need the learner's token_weights, computed before packing.

Advantages (`ADVANTAGE_MODES`):
  grpo     (r - mean_g) / (std_g + 1e-6), population std over the group
  drgrpo   r - mean_g                                  (Dr. GRPO: no std normalisation)
  rloo     r - mean of the other G - 1 rewards of the group (leave-one-out baseline)

Truncated completions (`OVERLONG_MODES`, rl.overlong): "keep", "mask" (DAPO's overlong
filtering: out of the loss) or "penalty" (`overlong_penalty`, DAPO's soft punishment added to
the reward).

Policy loss per token, with rho = exp(logprobs - anchor):
  l = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) [* w] [+ kl_coef k3]
      [- entropy_coef H]
  anchor = proximal_logprobs when given (decoupled PPO), else behaviour_logprobs;
  w = stop_gradient(exp(proximal - behaviour)), only with proximal_logprobs (AReaL's
  off-policy correction for stale rollouts); with is_cap set, is_mode "cap" uses
  min(w, is_cap) and "mask" drops the tokens with w > is_cap from the loss (w = 0 there;
  the aggregation's denominators are unchanged);
  k3 = exp(ref - lp) - (ref - lp) - 1, the KL estimator to a frozen reference, when given;
  H = the entropy of the distribution the token was sampled from under the parameters being
  trained (an entropy bonus, over every masked token, when entropy_coef > 0: it raises the
  policy's entropy, the regime in which the paper's acceptance falls).
Tokens outside a policy's support. With top-k or top-p, a token outside the kept set has
log-prob -inf under that policy: a stale token the current (or proximal) policy no longer
keeps, or a token at the nucleus edge that the learner's forward rounds the other way. Such
a token has no ratio (exp(-inf - -inf)) and an infinite k3, so:
  - the policy-gradient term (and the ratio, clip and log-prob-difference metrics) covers
    the masked tokens whose current, anchor and behaviour log-probs are all finite; a token
    outside them contributes 0 to the loss and its gradient (it could only add a constant:
    its ratio is 0, or its weight w is 0 when the proximal policy excludes it);
  - the KL term (and the `kl` metric) covers the masked tokens where the current and the
    reference log-probs are finite;
  - `outside_support_frac` is the fraction of masked tokens left out of the
    policy-gradient term.
Every value is computed from finite inputs (jnp.where before exp), so no NaN reaches the
loss, its gradient or a metric.
Aggregations (`AGGREGATIONS`) over the masked tokens:
  token-mean               sum / number of masked tokens
  seq-mean-token-mean      mean over rows of each row's token mean
  seq-mean-token-sum-norm  sum / norm, Dr. GRPO's constant normaliser: norm = the
                           configured rows per update x the generation budget
                           (max_new_tokens), the same in every step whatever the batch's
                           padded width or the rows dynamic sampling drops
A row with no masked token (a group dropped by dynamic sampling, padding) is absent from the
first two aggregations' denominators.
Metrics: per-token means over the tokens they cover, plus `tokens` (the masked token count,
the weight of a micro-batch's means when micro-batches are combined:
train.metrics.combine); keys ending in "_max" are maxima (combined with max).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")
IS_MODES = ("cap", "mask")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OVERLONG_MODES = ("keep", "mask", "penalty")  # what RL does with truncated completions
GRPO_EPS = 1e-6


def _groups(rewards: jax.Array, group_size: int) -> jax.Array:
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(f"rewards of shape {rewards.shape} do not split into groups of "
                     f"group_size={group_size} consecutive rows")
  return rewards.reshape(-1, group_size)


def advantages(rewards: jax.Array, group_size: int, mode: str = "grpo") -> jax.Array:
  """[B] advantages of rewards [B] (groups of `group_size` consecutive rows); see the module
  docstring for the modes."""
  if mode not in ADVANTAGE_MODES:
    raise ValueError(f"mode={mode!r} is not allowed: one of {ADVANTAGE_MODES}")
  if not isinstance(group_size, int) or group_size < 2:
    raise ValueError(f"group_size={group_size!r} is not allowed: group-relative advantages "
                     "need group_size >= 2 (with 1 every advantage is 0)")
  r = _groups(rewards, group_size)
  mean = jnp.mean(r, axis=1, keepdims=True)
  if mode == "grpo":
    adv = (r - mean) / (jnp.std(r, axis=1, keepdims=True) + GRPO_EPS)
  elif mode == "drgrpo":
    adv = r - mean
  else:  # rloo
    adv = r - (jnp.sum(r, axis=1, keepdims=True) - r) / (group_size - 1)
  return adv.reshape(-1)


def dynamic_sampling_mask(rewards: jax.Array, group_size: int) -> jax.Array:
  """[B] bool: False on every row of a group whose rewards are all equal (DAPO's dynamic
  sampling: such a group has zero advantage and carries no learning signal)."""
  r = _groups(rewards, group_size)
  keep = jnp.max(r, axis=1) > jnp.min(r, axis=1)
  return jnp.repeat(keep, group_size)


def overlong_penalty(lengths: jax.Array, max_new_tokens: int, buffer: int) -> jax.Array:
  """DAPO's soft overlong punishment [B] of completions of `lengths` tokens under the budget
  L = max_new_tokens with a buffer of C = `buffer` tokens: 0 up to L - C tokens, then
  ((L - C) - length) / C, falling linearly to -1 at L (a completion cut by the budget)."""
  room = (max_new_tokens - buffer) - jnp.asarray(lengths, jnp.float32)
  return jnp.clip(room / buffer, -1.0, 0.0)


def aggregation_weights(mask: jax.Array, aggregation: str, norm: float | None = None
                        ) -> jax.Array:
  """[B, T] float32 weights w such that the aggregated loss is sum(w * token_loss).

  `norm` is seq-mean-token-sum-norm's constant (rows per update x max_new_tokens); that
  aggregation requires it, the others ignore it."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation={aggregation!r} is not allowed: one of {AGGREGATIONS}")
  m = jnp.asarray(mask).astype(jnp.float32)
  per_row = jnp.sum(m, axis=1, keepdims=True)
  rows = jnp.maximum(jnp.sum(per_row > 0), 1.0)
  if aggregation == "token-mean":
    return m / jnp.maximum(jnp.sum(m), 1.0)
  if aggregation == "seq-mean-token-mean":
    return m / jnp.maximum(per_row, 1.0) / rows
  if norm is None or norm <= 0:
    raise ValueError(f"aggregation={aggregation!r} needs norm > 0 (Dr. GRPO's constant: "
                     f"rows per update x max_new_tokens), got norm={norm!r}")
  return m / norm


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """Per-token k3 estimator exp(ref - lp) - (ref - lp) - 1 of KL(pi || ref) for tokens
  sampled from pi (log-probs `logprobs`); >= 0, unbiased, low variance."""
  d = ref_logprobs - logprobs
  return jnp.exp(d) - d - 1.0


def policy_loss(logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array,
                mask: jax.Array, *, clip_low: float = 0.2, clip_high: float = 0.2,
                aggregation: str = "token-mean", proximal_logprobs: jax.Array | None = None,
                is_cap: float | None = None, is_mode: str = "cap",
                ref_logprobs: jax.Array | None = None,
                kl_coef: float = 0.0, token_weights: jax.Array | None = None,
                norm: float | None = None, entropy: jax.Array | None = None,
                entropy_coef: float = 0.0) -> tuple[jax.Array, dict[str, Any]]:
  """(loss, metrics) of the clipped policy-gradient objective; see the module docstring.

  Args:
    logprobs: [B, T] log-probs of the sampled tokens under the parameters being trained
      (-inf where a token is outside the policy's top-k/top-p support).
    behaviour_logprobs: [B, T] the same under the policy that sampled them.
    advantages: [B] per-row advantages, or [B, T] per token (packed rows).
    mask: [B, T] bool or 0/1, the tokens that count.
    token_weights: optional [B, T] aggregation weights replacing `aggregation` (the learner
      computes them over a whole batch, so gradient accumulation over microbatches sums to
      the full-batch loss).
    norm: seq-mean-token-sum-norm's constant (aggregation_weights).
    entropy: optional [B, T] entropy of the distribution each token was sampled from under
      the parameters being trained (a metric, and the bonus's term with entropy_coef).
    entropy_coef: >= 0, the entropy bonus's weight (needs `entropy`).
  Returns:
    loss (scalar) and metrics: clip_frac_low / clip_frac_high (fraction of tokens whose
    clipped branch is active: rho < 1 - clip_low with A < 0, rho > 1 + clip_high with
    A > 0), ratio_mean, kl (k3 to the reference; 0 without one), kl_behaviour (k3 of the
    behaviour policy against the current one), logprob_diff_mean / logprob_diff_max
    (|logprobs - behaviour_logprobs|), outside_support_frac, tokens, and with
    proximal_logprobs is_weight_mean, is_weight_max (before the cap) and is_capped_frac
    (the fraction of tokens with w > is_cap: capped, or masked with is_mode "mask"), and
    with `entropy` its mean over the masked tokens.
    Means are over the tokens each term covers (module docstring); an empty batch gives 0.
  """
  if not 0 <= clip_low < 1:
    raise ValueError(f"clip_low={clip_low} is not allowed: must be in [0, 1)")
  if clip_high < 0:
    raise ValueError(f"clip_high={clip_high} is not allowed: must be >= 0")
  if is_cap is not None and is_cap <= 0:
    raise ValueError(f"is_cap={is_cap} is not allowed: must be > 0 (None = no cap)")
  if is_mode not in IS_MODES:
    raise ValueError(f"is_mode={is_mode!r} is not allowed: one of {IS_MODES}")
  if entropy_coef < 0 or (entropy_coef and entropy is None):
    raise ValueError(f"entropy_coef={entropy_coef} is not allowed: must be >= 0, and > 0 "
                     "only with `entropy`")
  sg = jax.lax.stop_gradient
  masked = jnp.asarray(mask) > 0
  m = masked.astype(jnp.float32)
  lp = jnp.asarray(logprobs, jnp.float32)
  behaviour = jnp.asarray(behaviour_logprobs, jnp.float32)
  prox = None if proximal_logprobs is None else sg(jnp.asarray(proximal_logprobs, jnp.float32))
  anchor = behaviour if prox is None else prox
  finite = jnp.isfinite
  # The policy-gradient term's tokens; every exp below sees finite inputs only.
  support = masked & finite(lp) & finite(anchor) & finite(behaviour)
  s = support.astype(jnp.float32)
  safe = lambda x: jnp.where(support, x, 0.0)
  lp_s, anchor_s, behaviour_s = safe(lp), safe(anchor), safe(behaviour)
  adv = jnp.asarray(advantages, jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv
  ratio = jnp.exp(lp_s - anchor_s)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
  token_loss = -jnp.minimum(unclipped, clipped) * s
  metrics = {}
  count = jnp.maximum(jnp.sum(s), 1.0)
  mean = lambda x: jnp.sum(x * s) / count
  if prox is not None:
    weight = sg(jnp.exp(safe(prox) - behaviour_s))
    metrics["is_weight_mean"] = mean(weight)
    metrics["is_weight_max"] = jnp.max(weight * s)  # weights >= 0: 0 when nothing counts
    if is_cap is not None:
      above = weight > is_cap
      metrics["is_capped_frac"] = mean(above.astype(jnp.float32))
      weight = (jnp.minimum(weight, is_cap) if is_mode == "cap"
                else jnp.where(above, 0.0, weight))
    token_loss = token_loss * weight
  kl = jnp.zeros(())
  if ref_logprobs is not None:
    ref = sg(jnp.asarray(ref_logprobs, jnp.float32))
    in_both = masked & finite(lp) & finite(ref)
    k3 = k3_kl(jnp.where(in_both, lp, 0.0), jnp.where(in_both, ref, 0.0))
    kl = jnp.sum(sg(k3) * in_both) / jnp.maximum(jnp.sum(in_both), 1.0)
    if kl_coef:
      token_loss = token_loss + kl_coef * k3 * in_both
  if entropy_coef:
    token_loss = token_loss - entropy_coef * jnp.where(masked, entropy, 0.0)
  weights = (aggregation_weights(m, aggregation, norm) if token_weights is None
             else token_weights)
  loss = jnp.sum(token_loss * weights * m)
  lp_s = sg(lp_s)
  diff = jnp.abs(lp_s - behaviour_s)
  r = sg(ratio)
  metrics.update(
      clip_frac_low=mean(((r < 1.0 - clip_low) & (adv < 0)).astype(jnp.float32)),
      clip_frac_high=mean(((r > 1.0 + clip_high) & (adv > 0)).astype(jnp.float32)),
      ratio_mean=mean(r), kl=kl, kl_behaviour=mean(k3_kl(behaviour_s, lp_s)),
      logprob_diff_mean=mean(diff), logprob_diff_max=jnp.max(diff * s),
      outside_support_frac=jnp.sum(m - s) / jnp.maximum(jnp.sum(m), 1.0),
      tokens=jnp.sum(m))
  if entropy is not None:
    metrics["entropy"] = jnp.sum(sg(entropy) * m) / jnp.maximum(jnp.sum(m), 1.0)
  return loss, metrics
