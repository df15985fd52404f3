"""Shapes and stops of decoding batches: length buckets, right-padded rows, per-row stop
sets (packing into shared rows is bebop_jax.data.packing).

Every decoding function compiles once per shape, so contexts are right-padded to the
smallest of a few length buckets and batches are padded to a fixed number of rows. Stop
tokens are a static tuple shared by the batch; `row_stops` [B, S] says which of them end a
row's turn (a single-turn task stops at end of sequence only, an agentic one also at the
end of a tool call), held inside the loops as a table of token ids with -1 where off.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
REPLY_BUCKETS = (32, 64, 128, 256)


def bucket(length: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
  """The smallest bucket >= length."""
  for b in buckets:
    if length <= b:
      return b
  raise ValueError(f"a length of {length} tokens is longer than the largest bucket "
                   f"{buckets[-1]} (buckets {tuple(buckets)})")


def pad_rows(rows: Sequence[Sequence[int]], batch_size: int, buckets: Sequence[int], *,
             fill_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [batch_size, P] int32, lengths [batch_size] int32): `rows` right-padded with 0
  to the bucket P of the longest, then rows of the lone token `fill_id` (the tokenizer's
  bos) up to batch_size (decoded and discarded)."""
  if len(rows) > batch_size:
    raise ValueError(f"{len(rows)} rows do not fit a batch of {batch_size}")
  fill = [int(fill_id)]
  rows = [list(r) for r in rows] + [fill] * (batch_size - len(rows))
  p = bucket(max(len(r) for r in rows), buckets)
  tokens = np.zeros((batch_size, p), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return tokens, np.array([len(r) for r in rows], np.int32)


def stop_table(stop_tokens: Sequence[int], row_stops: jax.Array | None, batch: int
               ) -> jax.Array:
  """[B, S] int32: stop_tokens[j] where row b stops at it (row_stops[b, j], default all),
  -1 elsewhere."""
  stops = jnp.asarray(tuple(stop_tokens), jnp.int32).reshape(1, -1)
  if row_stops is None:
    return jnp.broadcast_to(stops, (batch, stops.shape[1]))
  row_stops = jnp.asarray(row_stops, bool)
  if row_stops.shape != (batch, stops.shape[1]):
    raise ValueError(f"row_stops has shape {row_stops.shape}; want [{batch}, "
                     f"{stops.shape[1]}] (rows x stop_tokens={tuple(stop_tokens)})")
  return jnp.where(row_stops, stops, -1)


def turn_limit(lengths: jax.Array, max_new_tokens: int, max_turn_tokens: int | None
               ) -> jax.Array:
  """[B] the output length at which a turn starting at output length `lengths` [B] stops:
  `max_turn_tokens` later (None: no per-turn cap), and never past `max_new_tokens`."""
  if max_turn_tokens is None:
    return jnp.full_like(lengths, max_new_tokens)
  return jnp.minimum(lengths + max_turn_tokens, max_new_tokens)


def hits_stop(tokens: jax.Array, table: jax.Array) -> jax.Array:
  """Whether each token ([B] or [B, C]) is one of its row's stop tokens (table [B, S])."""
  if tokens.ndim == 1:
    return jnp.any(tokens[:, None] == table, axis=-1)
  return jnp.any(tokens[:, :, None] == table[:, None, :], axis=-1)
