"""MTP drafter objectives over the teacher-forced chain (DESIGN.md 5).

Depth k (1..K) at position i drafts q_i^k for the token x_{i+k+1}; its target distribution is
the policy's p_{i+k} = softmax(logits[i + k]) (stop-gradient). Per depth, over the valid
positions (the chain mask `mtp_mask[k]`, and x_{i+k+1} a loss target):
  ce      -log q_i^k(x_{i+k+1}) on the data tokens
  kl      KL(p_{i+k} || q_i^k)
  tv      TV_k = 1/2 sum_v |p - q| = 1 - alpha_k
  e2e_tv  L = 1 - sum_k w_k prod_{j<=k} alpha_j(i), w_k = 1/K by default: the negative
          normalised expected accepted length of K-step rejection sampling. The product runs
          along the chain at the same start i, so only positions where every depth is valid
          count.
`depth_weights` (K non-negative numbers) weight the per-depth means of ce / kl / tv and the
terms of e2e_tv (normalised to sum to 1). Whatever is trained, the metrics report per depth
alpha_k, tv_k, kl_k, ce_k, and the expected accepted length sum_k prod_{j<=k} alpha_j.
The TV goes through `pallas_kernels.tv_loss.tv_distance` (analytic gradient, streamed over
the vocabulary; `tv_implementation` picks the kernel, None the backend's best, and
`tv_interpret` runs the Pallas kernels in interpret mode, as on CPU). Under a mesh
(`sharding.use_mesh`) the kernel runs in shard_map with the logits' layout from the
logical-axis rules: rows over the batch axes, the vocabulary over the head's vocab axis.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from bebop_jax import sharding
from bebop_jax.losses.head import HEADS  # pylint: disable=unused-import  # config.mtp.head
from bebop_jax.losses.head import shift_left_axis1, token_cross_entropy
from bebop_jax.model.model import shift_left
from pallas_kernels.fused_head import fused_head
from pallas_kernels.tv_loss import tv_distance

LOSSES = ("ce", "kl", "tv", "e2e_tv")
LOGITS_AXES = (None, "batch", "length", "vocab")  # the chain's [K, B, T, V] logits


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _normalised_weights(depth_weights: Sequence[float] | None, k: int) -> jax.Array:
  if depth_weights is None:
    return jnp.full((k,), 1.0 / k, jnp.float32)
  w = jnp.asarray(depth_weights, jnp.float32)
  if w.shape != (k,):
    raise ValueError(f"depth_weights has {w.shape[0] if w.ndim else 0} entries; the chain has "
                     f"K={k} depths")
  return w / jnp.sum(w)


def kl_divergence(target_logits: jax.Array, draft_logits: jax.Array) -> jax.Array:
  """KL(p || q) per position, p = softmax(target), q = softmax(draft); [..., V] -> [...]."""
  logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
  p = jnp.exp(logp)
  return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)


def expected_accepted_length(alphas: jax.Array) -> jax.Array:
  """sum_k prod_{j<=k} alpha_j over the leading (depth) axis: [K, ...] -> [...]."""
  return jnp.sum(jnp.cumprod(alphas, axis=0), axis=0)


def _shift_right_axis1(x: jax.Array, k: int) -> jax.Array:
  """x[:, i - k] at i along axis 1 (zeros before the start), for arrays [B, T, ...]."""
  pad = jnp.zeros((x.shape[0], k) + x.shape[2:], x.dtype)
  return jnp.concatenate([pad, x[:, :x.shape[1] - k]], axis=1)


def _dense_terms(out, tokens, k_steps, temperature, implementation, interpret):
  """(tv, ce, kl) [K, B, T] from the chain's [K, B, T, V] logits."""
  draft = out["mtp_logits"] / temperature                             # [K, B, T, V]
  p_logits = jax.lax.stop_gradient(out["logits"]) / temperature      # p_i
  target = jnp.stack([shift_left_axis1(p_logits, k + 1) for k in range(k_steps)])
  # Invalid positions (padding, chain past a segment end) still go through the kernel but
  # are masked; their target is zeros there (finite), so values and gradients are finite.
  mesh, spec = sharding.current_spec(LOGITS_AXES, draft.shape)
  tv = tv_distance(draft, target, implementation=implementation, interpret=interpret,
                   mesh=mesh, spec=spec)                              # [K, B, T]
  ce = jnp.stack([token_cross_entropy(draft[k], shift_left(tokens, k + 2))
                  for k in range(k_steps)])
  return tv, ce, kl_divergence(target, draft)


def _fused_terms(out, tokens, k_steps, temperature, implementation, interpret):
  """(tv, ce, kl) [K, B, T] streamed over the vocabulary from the final-normed hidden states
  and the head (pallas_kernels.fused_head): no [K, B, T, V] array exists. Depth k + 1 at i
  is compared with p_{i+k+1}: its hidden states are shifted right by k + 1 positions, so
  every depth meets its target at the target's own row (whose logits each vocabulary chunk
  then computes once for all depths) and its token x_{i+k+2} is that row's next token."""
  head = out["mtp_head"]
  draft = jnp.stack([_shift_right_axis1(out["mtp_normed"][k], k + 1)
                     for k in range(k_steps)]) / temperature          # [K, B, T, E]
  target = jax.lax.stop_gradient(out["normed"]) / temperature         # [B, T, E]
  next_tokens = jnp.broadcast_to(shift_left(tokens, 1), (k_steps,) + tokens.shape)
  mesh, spec = sharding.current_spec(LOGITS_AXES, draft.shape[:-1] + (head.shape[1],))
  terms = fused_head(draft, head, target_hidden=target, tokens=next_tokens,
                     implementation=implementation, interpret=interpret, mesh=mesh,
                     spec=spec)
  back = lambda x: jnp.stack([shift_left_axis1(x[k], k + 1) for k in range(k_steps)])
  return back(terms["tv"]), back(terms["ce"]), back(terms["kl"])


def mtp_loss(out: dict[str, jax.Array], tokens: jax.Array, loss_mask: jax.Array, *,
             loss: str, depth_weights: Sequence[float] | None = None,
             tv_implementation: str | None = None, tv_interpret: bool = False,
             temperature: float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The MTP objective `loss` (one of LOSSES) and per-depth metrics.

  Args:
    out: the teacher-forced forward's outputs (Policy.__call__ with the MTP chain): with
      logits (the dense head: the TV kernel on [K, B, T, V] logits) or, from
      `logits=False`, final-normed hidden states and the head (the fused head: every term
      streamed over vocabulary chunks, `_fused_terms`). Both give the same values and
      gradients (tests/test_mtp_losses.py).
    tokens: [B, T]; loss_mask: [B, T] (1 = token is a target, e.g. a policy-sampled token).
    tv_implementation, tv_interpret: the kernel implementation (of tv_loss or fused_head)
      and Pallas interpret mode.
    temperature: applied to both distributions before comparing them (1 = raw).
  Returns:
    (loss, metrics): metrics has alpha_k, tv_k, kl_k, ce_k per depth (k = 1..K), the
    chain's expected_accepted_length, positions (chain-valid start positions) and loss.
  """
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r} is not allowed: one of {LOSSES}")
  if "mtp_logits" not in out and "mtp_normed" not in out:
    raise ValueError("the forward pass has no MTP chain (num_draft_steps=0)")
  fused = "mtp_normed" in out
  k_steps = out["mtp_mask"].shape[0]
  masks = jnp.stack([out["mtp_mask"][k] & (shift_left(loss_mask, k + 2) > 0)
                     for k in range(k_steps)])                        # [K, B, T]
  tv, ce, kl = (_fused_terms if fused else _dense_terms)(
      out, tokens, k_steps, temperature, tv_implementation, tv_interpret)
  alpha = 1.0 - tv
  w = _normalised_weights(depth_weights, k_steps)
  chain_mask = jnp.all(masks, axis=0)
  prods = jnp.cumprod(alpha, axis=0)                                  # prod_{j<=k} alpha_j
  per_depth = lambda x: jnp.stack([_masked_mean(x[k], masks[k]) for k in range(k_steps)])
  if loss == "e2e_tv":
    value = _masked_mean(1.0 - jnp.einsum("k,kbt->bt", w, prods), chain_mask)
  else:
    value = jnp.sum(w * per_depth({"tv": tv, "ce": ce, "kl": kl}[loss]))

  metrics = {"loss": value, "positions": jnp.sum(chain_mask)}
  sg = jax.lax.stop_gradient
  for k in range(k_steps):
    metrics[f"alpha_{k + 1}"] = _masked_mean(sg(alpha[k]), masks[k])
    metrics[f"tv_{k + 1}"] = _masked_mean(sg(tv[k]), masks[k])
    metrics[f"kl_{k + 1}"] = _masked_mean(sg(kl[k]), masks[k])
    metrics[f"ce_{k + 1}"] = _masked_mean(sg(ce[k]), masks[k])
  metrics["expected_accepted_length"] = _masked_mean(
      expected_accepted_length(sg(alpha)), chain_mask)
  return value, metrics
