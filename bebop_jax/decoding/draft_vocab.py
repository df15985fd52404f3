"""A reduced draft vocabulary (as in FR-Spec and EAGLE-3): the drafter's head covers only the
V_d tokens the policy itself writes most often.

Drafting through the head's columns of those tokens costs V_d / V of a full head per depth
(on SmolLM2-135M the 49,280-wide head is about a fifth of all weights). Verification stays
exact: the draft distribution q is 0 off the subset, and rejection sampling's and block
verification's residuals put the target's mass there back (speculative._decode). What is
lost is only acceptance, on the positions whose target token lies outside the subset.

  counts = draft_vocab.count_tokens(sequences, masks, vocab_size)  # the policy's own outputs
  ids = draft_vocab.top_tokens(counts, 8192, always=stop_tokens)    # sorted int32 [V_d]
  speculative.generate(..., draft_vocab=jnp.asarray(ids))
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def count_tokens(sequences: Iterable[Sequence[int]], masks: Iterable[Sequence[bool]] | None,
                 vocab_size: int) -> np.ndarray:
  """[vocab_size] int64: how often each token appears where `masks` is True (every position
  when masks is None) in `sequences` (rows of token ids)."""
  counts = np.zeros(vocab_size, np.int64)
  masks = None if masks is None else list(masks)
  for i, seq in enumerate(sequences):
    seq = np.asarray(seq, np.int64).reshape(-1)
    if masks is not None:
      seq = seq[np.asarray(masks[i], bool).reshape(-1)[:len(seq)]]
    if seq.size and (seq.min() < 0 or seq.max() >= vocab_size):
      raise ValueError(f"token ids must be in [0, {vocab_size}); got {seq.min()}..{seq.max()}")
    counts += np.bincount(seq, minlength=vocab_size)
  return counts


def top_tokens(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
  """The `size` most frequent token ids of `counts` (ties: the lower id first), with every id
  of `always` (e.g. the stop tokens, so a draft can end a turn) included; sorted int32."""
  counts = np.asarray(counts)
  v = counts.shape[0]
  always = sorted({int(t) for t in always})
  if not 1 <= size <= v:
    raise ValueError(f"draft vocabulary size={size} is not allowed: must be in [1, {v}]")
  if len(always) > size or any(not 0 <= t < v for t in always):
    raise ValueError(f"always={always} must be at most {size} ids in [0, {v})")
  order = np.lexsort((np.arange(v), -counts))  # by count descending, then id
  chosen = list(always)
  taken = set(chosen)
  for t in order:
    if len(chosen) == size:
      break
    if int(t) not in taken:
      chosen.append(int(t))
      taken.add(int(t))
  return np.sort(np.asarray(chosen, np.int32))


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
  """The share of the counted tokens that `ids` covers."""
  total = float(np.sum(counts))
  return float(np.sum(np.asarray(counts)[np.asarray(ids)]) / total) if total else 0.0
