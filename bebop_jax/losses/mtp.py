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
  lk      -log alpha_k = -log(1 - TV_k): the LK losses' negative log-acceptance (Samarin et
          al., arXiv 2602.23881), per position, so a draft far from its target (alpha near
          0) gets TV's gradient scaled by 1 / alpha; alpha is floored at LK_MIN_ALPHA.
`depth_weights` (K non-negative numbers) weight the per-depth means of ce / kl / tv / lk and the
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
import numpy as np

from bebop_jax import sharding
from bebop_jax.losses.head import HEADS  # pylint: disable=unused-import  # config.mtp.head
from bebop_jax.losses.head import shift_left_axis1, token_cross_entropy
from bebop_jax.model.model import shift_left
from pallas_kernels.fused_head import fused_head
from pallas_kernels.tv_loss import tv_distance

LOSSES = ("ce", "kl", "tv", "e2e_tv", "lk")
LK_MIN_ALPHA = 1e-6  # lk's floor on alpha: -log alpha stays finite where p and q are disjoint
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


def _fused_terms(out, tokens, k_steps, temperature, implementation, interpret, rows=None):
  """(tv, ce, kl) [K, B, T] streamed over the vocabulary from the final-normed hidden states
  and the head (pallas_kernels.fused_head): no [K, B, T, V] array exists. Depth k + 1 at i
  is compared with p_{i+k+1}: its hidden states are shifted right by k + 1 positions, so
  every depth meets its target at the target's own row (whose logits each vocabulary chunk
  then computes once for all depths) and its token x_{i+k+2} is that row's next token.

  `rows` [B, N] (optional): the target rows to score (`loss_rows`; T marks an unused
  entry). The head then runs on those N rows only, not on all T; the terms of every other
  row are 0 (they are masked out: a row whose next token is not a loss target counts for
  no depth)."""
  head = out["mtp_head"]
  next_tokens = shift_left(tokens, 1)
  target = jax.lax.stop_gradient(out["normed"]) / temperature         # [B, T, E]
  if rows is None:
    draft = jnp.stack([_shift_right_axis1(out["mtp_normed"][k], k + 1)
                       for k in range(k_steps)]) / temperature        # [K, B, T, E]
    next_tokens = jnp.broadcast_to(next_tokens, (k_steps,) + tokens.shape)
  else:
    rows = rows.astype(jnp.int32)
    draft = jnp.stack([_at_rows(out["mtp_normed"][k], rows - (k + 1))
                       for k in range(k_steps)]) / temperature        # [K, B, N, E]
    target = _at_rows(target, rows)                                   # [B, N, E]
    next_tokens = jnp.broadcast_to(_at_rows(next_tokens, rows), (k_steps,) + rows.shape)
  mesh, spec = sharding.current_spec(LOGITS_AXES, draft.shape[:-1] + (head.shape[1],))
  terms = fused_head(draft, head, target_hidden=target, tokens=next_tokens,
                     implementation=implementation, interpret=interpret, mesh=mesh,
                     spec=spec)
  if rows is not None:  # back to [K, B, T]: zeros off the scored rows (dropped at T)
    batch = jnp.arange(rows.shape[0])[:, None]
    terms = {name: jnp.zeros((k_steps,) + tokens.shape, v.dtype).at[:, batch, rows].set(
        v, mode="drop") for name, v in terms.items() if name in ("tv", "ce", "kl")}
  back = lambda x: jnp.stack([shift_left_axis1(x[k], k + 1) for k in range(k_steps)])
  return back(terms["tv"]), back(terms["ce"]), back(terms["kl"])


def _at_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [B, T, ...] at rows idx [B, N] (clipped into range) -> [B, N, ...]."""
  idx = jnp.clip(idx, 0, x.shape[1] - 1)
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _reduced_terms(out, tokens, k_steps, temperature, rows, vocab):
  """(tv, ce, kl) [K, B, T] of a drafter restricted to the reduced vocabulary `vocab` [V_d]
  (decoding/draft_vocab.py): q = softmax over the head's V_d columns, 0 elsewhere, as
  decoding drafts it. Dense at the target rows `rows` [B, N] only: the target's [B, N, V]
  logits (no gradient) and the drafts' [K, B, N, V_d].
    tv  1/2 sum_v |p - q| over the whole vocabulary = 1 - sum_{v in V_d} min(p_v, q_v)
        (p keeps its mass off V_d, which q never matches);
    kl  KL(p~ || q), p~ = p renormalised on V_d (finite where KL(p || q) is not);
    ce  -log q(x) where x is in V_d, 0 where it is not."""
  head = out["mtp_head"]
  vocab = jnp.asarray(vocab, jnp.int32)
  sg = jax.lax.stop_gradient
  target = sg(_at_rows(out["normed"], rows)).astype(jnp.float32)          # [B, N, E]
  logp = jax.nn.log_softmax(
      _dense_f32(target, sg(head)) / temperature, axis=-1)              # [B, N, V]
  logp_sub = jnp.take(logp, vocab, axis=-1)                               # [B, N, V_d]
  draft = jnp.stack([_at_rows(out["mtp_normed"][k], rows - (k + 1))
                     for k in range(k_steps)]).astype(jnp.float32)        # [K, B, N, E]
  logq = jax.nn.log_softmax(
      _dense_f32(draft, jnp.take(head, vocab, axis=1)) / temperature, axis=-1)
  p, q = jnp.exp(logp_sub), jnp.exp(logq)
  alpha = jnp.sum(jnp.minimum(p[None], q), axis=-1)
  logp_renorm = logp_sub - jax.nn.logsumexp(logp_sub, axis=-1, keepdims=True)
  kl = jnp.sum(jnp.exp(logp_renorm)[None] * (logp_renorm[None] - logq), axis=-1)
  index = jnp.full((head.shape[1],), -1, jnp.int32).at[vocab].set(
      jnp.arange(vocab.shape[0], dtype=jnp.int32))
  x = jnp.take(index, _at_rows(shift_left(tokens, 1), rows))              # [B, N]
  ce = jnp.where(x[None] >= 0, -jnp.take_along_axis(
      logq, jnp.maximum(x, 0)[None, ..., None], axis=-1)[..., 0], 0.0)
  batch = jnp.arange(rows.shape[0])[:, None]
  scatter = lambda v: jnp.zeros((k_steps,) + tokens.shape, v.dtype).at[:, batch, rows].set(
      v, mode="drop")
  back = lambda x: jnp.stack([shift_left_axis1(x[k], k + 1) for k in range(k_steps)])
  return back(scatter(1.0 - alpha)), back(scatter(ce)), back(scatter(kl))


def _dense_f32(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., E] @ w [E, V] in float32."""
  return jnp.einsum("...e,ev->...v", x, w.astype(x.dtype),
                    preferred_element_type=jnp.float32)


def loss_rows(loss_mask, num_rows: int):
  """[B, num_rows] int32 (numpy): the rows r of each batch row whose next token is a loss
  target (loss_mask[r + 1] = 1), in order, padded with T (no row). The MTP terms need the
  head at those rows only (`mtp_loss(..., rows=)`). Raises if a row has more."""
  mask = np.asarray(loss_mask) > 0
  b, t = mask.shape
  out = np.full((b, num_rows), t, np.int32)
  for i in range(b):
    r = np.flatnonzero(mask[i, 1:])
    if len(r) > num_rows:
      raise ValueError(f"row {i} has {len(r)} loss targets; the batch scores at most "
                       f"num_rows={num_rows}")
    out[i, :len(r)] = r
  return out


def mtp_terms(out: dict[str, jax.Array], tokens: jax.Array, loss_mask: jax.Array, *,
              tv_implementation: str | None = None, tv_interpret: bool = False,
              temperature: float = 1.0, rows: jax.Array | None = None,
              draft_vocab: jax.Array | None = None) -> dict[str, jax.Array]:
  """Per depth and start position, each [K, B, T]: "tv", "ce", "kl" of q_i^k against
  p_{i+k} (after `temperature`), and "mask" (the depth counts at i: its chain is valid and
  x_{i+k+1} is a loss target). Arguments as `mtp_loss`."""
  if draft_vocab is not None and (rows is None or "mtp_normed" not in out):
    raise ValueError("draft_vocab= needs rows= and the fused form of the forward")
  if "mtp_logits" not in out and "mtp_normed" not in out:
    raise ValueError("the forward pass has no MTP chain (num_draft_steps=0)")
  fused = "mtp_normed" in out
  if rows is not None and not fused:
    raise ValueError("rows= needs the fused form of the forward (Policy.__call__ with "
                     "logits=False): dense logits exist at every row already")
  k_steps = out["mtp_mask"].shape[0]
  masks = jnp.stack([out["mtp_mask"][k] & (shift_left(loss_mask, k + 2) > 0)
                     for k in range(k_steps)])                        # [K, B, T]
  if draft_vocab is not None:
    tv, ce, kl = _reduced_terms(out, tokens, k_steps, temperature,
                                jnp.asarray(rows, jnp.int32), draft_vocab)
  elif fused:
    tv, ce, kl = _fused_terms(out, tokens, k_steps, temperature, tv_implementation,
                              tv_interpret, rows)
  else:
    tv, ce, kl = _dense_terms(out, tokens, k_steps, temperature, tv_implementation,
                              tv_interpret)
  return {"tv": tv, "ce": ce, "kl": kl, "mask": masks}


def mtp_loss(out: dict[str, jax.Array], tokens: jax.Array, loss_mask: jax.Array, *,
             loss: str, depth_weights: Sequence[float] | None = None,
             tv_implementation: str | None = None, tv_interpret: bool = False,
             temperature: float = 1.0, rows: jax.Array | None = None,
             draft_vocab: jax.Array | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
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
    rows: optional [B, N] `loss_rows(loss_mask, N)`: the head runs at those rows only (the
      fused form), the same loss and gradients as without it (tests/test_mtp_losses.py).
    draft_vocab: optional [V_d] token ids (with `rows`): the drafter drafts from those
      tokens only, as decoding with a reduced draft vocabulary does (`_reduced_terms`).
  Returns:
    (loss, metrics): metrics has alpha_k, tv_k, kl_k, ce_k per depth (k = 1..K), the
    chain's expected_accepted_length, positions (chain-valid start positions) and loss.
  """
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r} is not allowed: one of {LOSSES}")
  terms = mtp_terms(out, tokens, loss_mask, tv_implementation=tv_implementation,
                    tv_interpret=tv_interpret, temperature=temperature, rows=rows,
                    draft_vocab=draft_vocab)
  tv, ce, kl, masks = terms["tv"], terms["ce"], terms["kl"], terms["mask"]
  k_steps = masks.shape[0]
  alpha = 1.0 - tv
  w = _normalised_weights(depth_weights, k_steps)
  chain_mask = jnp.all(masks, axis=0)
  prods = jnp.cumprod(alpha, axis=0)                                  # prod_{j<=k} alpha_j
  per_depth = lambda x: jnp.stack([_masked_mean(x[k], masks[k]) for k in range(k_steps)])
  if loss == "e2e_tv":
    value = _masked_mean(1.0 - jnp.einsum("k,kbt->bt", w, prods), chain_mask)
  else:
    per_position = {"tv": tv, "ce": ce, "kl": kl}.get(loss)
    if loss == "lk":
      per_position = -jnp.log(jnp.maximum(alpha, LK_MIN_ALPHA))
    value = jnp.sum(w * per_depth(per_position))

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
