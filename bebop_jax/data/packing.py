"""Packing variable-length sequences into shared rows of a fixed length.

Items (sequences of `lengths[i]` positions) go into bins first-fit-decreasing
(`first_fit_decreasing`); row r of a packed batch then holds the items of bin r back to
back, each its own segment (segment ids 1, 2, ... within the row; 0 is padding) with
positions restarting at 0 (`pack_layout`), and `pack` fills per-item fields into those
places. Deterministic (a stable sort, then first fit), so the same items give the same rows.

The one packer of the project: the MTP stage's drafter rows (train/drafter.pack_rows,
pack_hidden), the RL learner's update batches (rl/learner.update_batches) and the packed
batches of the teacher-forced diagnostic (decoding/diagnostics.packed_batches). The SFT
pipeline packs with grain's packing instead (data/pipeline.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


def first_fit_decreasing(lengths: np.ndarray, capacity: int, targets: np.ndarray | None = None,
                         target_capacity: int | None = None) -> list[list[int]]:
  """Bins of item indices, longest items first, each into the first bin with room: every
  bin's lengths sum to at most `capacity` (each length must be at most `capacity`) and, with
  `targets` (a second size per item, e.g. its loss targets), their targets to at most
  `target_capacity`."""
  lengths = np.asarray(lengths)
  if targets is not None and (target_capacity is None or np.max(targets, initial=0)
                              > target_capacity):
    raise ValueError(f"every item's targets must be at most target_capacity="
                     f"{target_capacity}; the largest is {np.max(targets, initial=0)}")
  bins: list[list[int]] = []
  free: list[int] = []
  free_targets: list[int] = []
  for i in np.argsort(-lengths, kind="stable"):
    n = int(lengths[i])
    m = 0 if targets is None else int(targets[i])
    for b, room in enumerate(free):
      if n <= room and (targets is None or m <= free_targets[b]):
        bins[b].append(int(i))
        free[b] -= n
        if targets is not None:
          free_targets[b] -= m
        break
    else:
      bins.append([int(i)])
      free.append(capacity - n)
      free_targets.append(0 if targets is None else target_capacity - m)
  return bins


def pack_layout(bins: Sequence[Sequence[int]], lengths: Sequence[int], rows: int, length: int
                ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, slice]]]:
  """Where packed items go: row r of `rows` holds the items `bins[r]` back to back, item i
  its `lengths[i]` positions, each its own segment (1, 2, ... within the row; 0 is padding)
  with positions restarting at 0. Returns (segment_ids [rows, length] int32, positions
  [rows, length] int32, spans: (row, item, slice of the row) per item)."""
  if len(bins) > rows:
    raise ValueError(f"{len(bins)} packed rows do not fit a batch of {rows} rows")
  segment_ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  spans = []
  for r, members in enumerate(bins):
    offset = 0
    for segment, i in enumerate(members, 1):
      n = int(lengths[i])
      if offset + n > length:
        raise ValueError(f"the items {list(members)} ({offset + n}+ tokens) overflow a row "
                         f"of {length} positions")
      span = slice(offset, offset + n)
      segment_ids[r, span] = segment
      positions[r, span] = np.arange(n)
      spans.append((r, int(i), span))
      offset += n
  return segment_ids, positions, spans


def pack(fields: Mapping[str, Sequence[Any]], lengths: Sequence[int],
         bins: Sequence[Sequence[int]], rows: int, length: int,
         dtypes: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """The packed batch of `rows` rows of `length` positions whose row r holds the items
  `bins[r]` (pack_layout): {field: [rows, length, ...] of dtypes[field] for each of
  `fields`, "segment_ids", "positions"}. `fields[k][i]` is item i's value: a scalar fills
  the item's whole span; a sequence (per-position values, any trailing shape) gives its
  first lengths[i] entries from the span's start, a shorter one leaving the rest 0.
  Positions no item holds are 0 in every field."""
  segment_ids, positions, spans = pack_layout(bins, lengths, rows, length)
  out = {}
  for k, values in fields.items():
    trailing = np.shape(values[0])[1:] if len(values) else ()
    out[k] = np.zeros((rows, length) + trailing, dtypes[k])
  for r, i, span in spans:
    for k, values in fields.items():
      value = values[i]
      if np.ndim(value) == 0:
        out[k][r, span] = value
      else:
        value = value[:span.stop - span.start]
        out[k][r, span.start:span.start + len(value)] = value
  return out | {"segment_ids": segment_ids, "positions": positions}
