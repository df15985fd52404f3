"""Self-consistency diagnostic: teacher-forced per-depth acceptance over generated sequences.

One training-style forward over (prompt + generated) sequences gives, at every position i,
the draft q_i^k of every depth and the target p_{i+k} it is scored against, both transformed
like in decoding; alpha_k(i) is the mode's per-draft acceptance. When depth k was verified at
frontier n online, its drafts d_1..d_{k-1} had been accepted, so they are the committed
tokens and alpha_k(n) is exactly that draft's acceptance probability: the expected online
accepted count at depth k is sum over the visits that verified depth k of alpha_k(n). A
mismatch beyond sampling error means a cache or hidden-state bug.

Without the visited frontiers, `alpha` weights every generated position by the probability
of reaching depth k (prod_{j<k} alpha_j): the training-time metric, close to but not the
same as the online rate (online frontiers follow rejections).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop_jax.data import packing
from bebop_jax.decoding import sampling
from bebop_jax.decoding import verification as verify_lib
from bebop_jax.model.model import shift_left


def padded_batches(sequences, batch_size: int, length: int):
  """Yields (tokens [batch_size, length] int32, generated [batch_size, length] bool[,
  frontier depths [batch_size, length] int32]) numpy batches from (tokens, loss_mask[,
  frontier_depths]) rows: right-padded, the last batch padded with empty rows (which count
  nowhere)."""
  for first in range(0, len(sequences), batch_size):
    rows = sequences[first:first + batch_size]
    seq = np.zeros((batch_size, length), np.int32)
    gen = np.zeros((batch_size, length), bool)
    depths = np.zeros((batch_size, length), np.int32) if len(rows[0]) == 3 else None
    for i, (tokens, mask, *rest) in enumerate(rows):
      seq[i, :len(tokens)], gen[i, :len(mask)] = tokens, np.asarray(mask) > 0
      if rest:
        depths[i, :len(rest[0])] = rest[0]
    yield (seq, gen) if depths is None else (seq, gen, depths)


def packed_batches(sequences, bins: list[list[int]], batch_size: int, length: int,
                   row_step: int = 8):
  """Yields (tokens, generated, segment_ids, positions), [R, length] numpy arrays each, from
  (tokens, loss_mask) rows packed into shared rows: row r of the packing holds the rows
  `bins[r]` back to back (data.packing.first_fit_decreasing), each its own segment with
  positions from 0; `batch_size` packed rows per batch, the last one cut to the smallest
  multiple of `row_step` (or batch_size) that holds its rows."""
  lengths = [len(tokens) for tokens, _ in sequences]
  fields = {"tokens": [tokens for tokens, _ in sequences],
            "generated": [np.asarray(mask) > 0 for _, mask in sequences]}
  for first in range(0, len(bins), batch_size):
    chunk = bins[first:first + batch_size]
    rows = min(batch_size, -(-len(chunk) // row_step) * row_step)
    out = packing.pack(fields, lengths, chunk, rows, length,
                       {"tokens": np.int32, "generated": bool})
    yield out["tokens"], out["generated"], out["segment_ids"], out["positions"]


def sequences_from_generation(prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                              tokens: jax.Array, lengths: jax.Array
                              ) -> tuple[jax.Array, jax.Array]:
  """(sequences [B, P+N] = prompt then generated tokens, generated mask [B, P+N])."""
  b, p = prompt_tokens.shape
  n = tokens.shape[1]
  pos = jnp.arange(p + n)[None, :]
  rows = jnp.arange(b)[:, None]
  seq = jnp.where(pos < prompt_lengths[:, None], jnp.pad(prompt_tokens, ((0, 0), (0, n))), 0)
  gen_pos = prompt_lengths[:, None] + jnp.arange(n)[None, :]
  seq = seq.at[rows, gen_pos].set(tokens, mode="drop")
  generated = (pos >= prompt_lengths[:, None]) & (pos < (prompt_lengths + lengths)[:, None])
  return seq, generated


def _per_position(model, sequences, generated, params, modes, segment_ids=None,
                  positions=None, draft_vocab=None):
  """({mode: alphas [K, B, T]} (per-draft acceptance of depth k's draft at start i), masks
  [K, B, T] (i is a frontier candidate and x_{i+k+1} is generated in its segment), target
  entropy [K, B, T] of the transformed p_{i+k} (nats)), from one forward for all `modes`.
  Without `segment_ids`, a row is one sequence (its nonzero or generated tokens). With
  `draft_vocab` [V_d] the drafts come from those tokens only (q is 0 elsewhere), as a
  drafter with a reduced vocabulary drafts."""
  if segment_ids is None:
    segment_ids = ((sequences > 0) | generated).astype(jnp.int32)
  out = model(sequences, positions, segment_ids)
  logp = sampling.sampling_logprobs(out["logits"], params)                  # p_i
  target = jnp.exp(logp)
  ent = -jnp.sum(jnp.where(target > 0, target * logp, 0.0), axis=-1)        # [B, T]
  k_steps = out["mtp_logits"].shape[0]
  alphas, entropies = {mode: [] for mode in modes}, []
  off_vocab = None
  if draft_vocab is not None:
    v = out["mtp_logits"].shape[-1]
    off_vocab = ~jnp.zeros((v,), bool).at[jnp.asarray(draft_vocab)].set(True)
  for k in range(1, k_steps + 1):
    draft_logits = out["mtp_logits"][k - 1]
    if off_vocab is not None:
      draft_logits = jnp.where(off_vocab, -jnp.inf, draft_logits)
    q = jnp.exp(sampling.sampling_logprobs(draft_logits, params))               # q_i^k
    p_shift = jnp.concatenate([target[:, k:], jnp.zeros_like(target[:, :k])], axis=1)
    for mode in modes:
      alphas[mode].append(verify_lib.per_draft_acceptance(q, p_shift, mode))
    entropies.append(shift_left(ent, k))
  # i is a frontier candidate when x_{i+1} is generated; depth k needs x_{i+k+1} generated.
  masks = jnp.stack([shift_left(generated, k + 1) & shift_left(generated, 1)
                     for k in range(1, k_steps + 1)]) & out["mtp_mask"]
  return {mode: jnp.stack(a) for mode, a in alphas.items()}, masks, jnp.stack(entropies)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "modes"))
def acceptance_by_position(graphdef: nnx.GraphDef, state: nnx.State, sequences: jax.Array,
                           generated: jax.Array, draft_vocab: jax.Array | None = None, *,
                           params: sampling.SamplingParams,
                           modes: tuple[str, ...]) -> dict:
  """{"alpha": {mode: [K, B, T]}, "mask": [K, B, T], "entropy": [K, B, T]}: depth k's
  per-draft acceptance at start position i in each of `modes` (one forward for all),
  whether it counts, and the entropy of the target p_{i+k} it is scored against (after the
  sampling transform). For acceptance-against-entropy plots. `draft_vocab`: as
  `teacher_forced_acceptance_by_mode`."""
  alphas, masks, ent = _per_position(nnx.merge(graphdef, state), sequences, generated, params,
                                     tuple(modes), draft_vocab=draft_vocab)
  return {"alpha": alphas, "mask": masks, "entropy": ent}


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "mode"))
def teacher_forced_acceptance(graphdef: nnx.GraphDef, state: nnx.State, sequences: jax.Array,
                              generated: jax.Array, frontier_depths: jax.Array | None = None,
                              *, params: sampling.SamplingParams,
                              mode: str) -> dict[str, jax.Array]:
  """Per-depth acceptance expected online, from one teacher-forced forward.

  Args:
    sequences: [B, T] prompt + generated tokens (0 after the end).
    generated: [B, T] True at generated positions.
    frontier_depths: [B, T] optional, from SpeculativeOutput (padded to T): depths verified
      at each visited frontier.
  Returns:
    {"alpha": [K] acceptance weighted by the probability of reaching each depth,
     "alpha_unweighted": [K] plain mean over positions, "positions": [K] counts}.
    Position i (a frontier candidate: i+1 generated) counts for depth k when i+k+1 is still
    in the sequence.
  """
  alphas, masks, _ = _per_position(nnx.merge(graphdef, state), sequences, generated, params,
                                   (mode,))
  return _summarise(alphas[mode], masks, frontier_depths)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "modes"))
def teacher_forced_acceptance_by_mode(graphdef: nnx.GraphDef, state: nnx.State,
                                      sequences: jax.Array, generated: jax.Array,
                                      segment_ids: jax.Array | None = None,
                                      positions: jax.Array | None = None,
                                      draft_vocab: jax.Array | None = None, *,
                                      params: sampling.SamplingParams,
                                      modes: tuple[str, ...]) -> dict[str, dict[str, jax.Array]]:
  """{mode: teacher_forced_acceptance's result} for several modes from one forward; with
  `segment_ids` and `positions`, of rows that pack several sequences (`packed_batches`);
  with `draft_vocab`, of a drafter restricted to those tokens."""
  alphas, masks, _ = _per_position(nnx.merge(graphdef, state), sequences, generated, params,
                                   modes, segment_ids, positions, draft_vocab)
  return {mode: _summarise(alphas[mode], masks, None) for mode in modes}


def _summarise(alphas, masks, frontier_depths):
  k_steps = alphas.shape[0]
  reach = jnp.concatenate([jnp.ones_like(alphas[:1]), jnp.cumprod(alphas, axis=0)[:-1]])
  w = reach * masks
  m = masks.astype(jnp.float32)
  result = {}
  if frontier_depths is not None:
    depth_ids = jnp.arange(1, k_steps + 1)[:, None, None]
    visited = (frontier_depths[None] >= depth_ids).astype(jnp.float32)   # [K, B, T]
    result["visits"] = jnp.sum(visited, axis=(1, 2))
    result["expected_accepted"] = jnp.sum(visited * alphas, axis=(1, 2))
    result["accepted_variance"] = jnp.sum(visited * alphas * (1 - alphas), axis=(1, 2))
    result["alpha_at_frontiers"] = result["expected_accepted"] / jnp.maximum(
        result["visits"], 1.0)
  return result | {
      "alpha": jnp.sum(w * alphas, axis=(1, 2)) / jnp.maximum(jnp.sum(w, axis=(1, 2)), 1e-9),
      "alpha_unweighted": jnp.sum(m * alphas, axis=(1, 2)) / jnp.maximum(
          jnp.sum(m, axis=(1, 2)), 1.0),
      "positions": jnp.sum(masks, axis=(1, 2))}


def binomial_interval(successes: int, trials: int, z: float = 1.959963984540054
                      ) -> tuple[float, float]:
  """The Wilson score interval (95% by default) of a binomial rate successes / trials;
  (0, 1) with no trials."""
  if trials <= 0:
    return 0.0, 1.0
  p = successes / trials
  denom = 1.0 + z * z / trials
  centre = (p + z * z / (2 * trials)) / denom
  half = z * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
  return float(max(0.0, centre - half)), float(min(1.0, centre + half))
