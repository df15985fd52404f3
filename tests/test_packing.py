"""The row packer (bebop_jax.data.packing) against a plain reference, and its callers."""

import numpy as np
import pytest

from bebop_jax.data import packing


def _reference_bins(lengths, capacity, targets=None, target_capacity=None):
  """First fit decreasing written out directly: items by decreasing length (ties by index),
  each into the earliest opened bin whose totals stay within both capacities."""
  order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
  targets = [0] * len(lengths) if targets is None else targets
  target_capacity = 0 if target_capacity is None else target_capacity
  bins = []
  for i in order:
    for b in bins:
      if (sum(int(lengths[j]) for j in b) + int(lengths[i]) <= capacity
          and sum(int(targets[j]) for j in b) + int(targets[i]) <= target_capacity):
        b.append(i)
        break
    else:
      bins.append([i])
  return bins


def _reference_rows(items, bins, rows, length):
  """(tokens, segment_ids, positions) [rows, length]: each bin's items concatenated, then
  zero padding; empty rows after the bins."""
  out = []
  for r in range(rows):
    members = bins[r] if r < len(bins) else []
    parts = [(np.asarray(items[i]), np.full(len(items[i]), s), np.arange(len(items[i])))
             for s, i in enumerate(members, 1)]
    row = [np.concatenate([p[k] for p in parts] + [np.zeros(0, int)]) for k in range(3)]
    out.append([np.pad(x, (0, length - len(x))) for x in row])
  return tuple(np.stack([o[k] for o in out]).reshape(rows, length) for k in range(3))


def test_first_fit_decreasing_matches_the_reference():
  rng = np.random.default_rng(0)
  for _ in range(200):
    capacity = int(rng.integers(4, 64))
    lengths = rng.integers(1, capacity + 1, size=int(rng.integers(0, 40)))
    bins = packing.first_fit_decreasing(lengths, capacity)
    assert bins == _reference_bins(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # First fit: no two bins could have been one.
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity
    targets = rng.integers(0, 6, size=len(lengths))
    target_capacity = int(rng.integers(5, 12))
    with_targets = packing.first_fit_decreasing(lengths, capacity, targets, target_capacity)
    assert with_targets == _reference_bins(lengths, capacity, targets, target_capacity)
    assert all(sum(targets[i] for i in b) <= target_capacity for b in with_targets)


def test_first_fit_decreasing_refuses_an_item_over_the_target_capacity():
  with pytest.raises(ValueError, match="target_capacity"):
    packing.first_fit_decreasing([3, 2], 8, targets=[1, 5], target_capacity=4)


def test_pack_matches_the_reference_rows():
  rng = np.random.default_rng(1)
  for _ in range(100):
    length = int(rng.integers(8, 40))
    items = [rng.integers(1, 100, int(rng.integers(1, length + 1))) for _ in
             range(int(rng.integers(1, 20)))]
    lengths = [len(t) for t in items]
    bins = packing.first_fit_decreasing(lengths, length)
    rows = len(bins) + int(rng.integers(0, 3))
    scores = rng.standard_normal(len(items)).astype(np.float32)
    feats = [rng.standard_normal((n + 2, 3)) for n in lengths]  # longer: cut to the item
    short = [t[:max(1, len(t) - 2)] for t in items]              # shorter: the rest is 0
    out = packing.pack({"tokens": items, "score": scores, "feat": feats, "short": short},
                       lengths, bins, rows, length,
                       {"tokens": np.int32, "score": np.float32, "feat": np.float32,
                        "short": np.int32})
    tokens, segment_ids, positions = _reference_rows(items, bins, rows, length)
    np.testing.assert_array_equal(out["tokens"], tokens)
    np.testing.assert_array_equal(out["segment_ids"], segment_ids)
    np.testing.assert_array_equal(out["positions"], positions)
    assert out["tokens"].dtype == out["segment_ids"].dtype == np.int32
    index = _reference_rows([np.full(n, i + 1) for i, n in enumerate(lengths)], bins, rows,
                            length)[0] - 1                     # item at each place, -1: none
    np.testing.assert_array_equal(out["score"], np.where(index >= 0, scores[index], 0))
    assert out["feat"].shape == (rows, length, 3) and out["feat"].dtype == np.float32
    feat = np.zeros((rows, length, 3), np.float32)
    for r, t in zip(*np.nonzero(index >= 0)):
      feat[r, t] = feats[index[r, t]][positions[r, t]]
    np.testing.assert_array_equal(out["feat"], feat)
    short_ref = _reference_rows([np.pad(s, (0, n - len(s))) for s, n in zip(short, lengths)],
                                bins, rows, length)[0]
    np.testing.assert_array_equal(out["short"], short_ref)


def test_pack_refuses_overflow():
  with pytest.raises(ValueError, match="do not fit"):
    packing.pack({}, [2, 2], [[0], [1]], 1, 4, {})
  with pytest.raises(ValueError, match="overflow"):
    packing.pack({}, [3, 2], [[0, 1]], 1, 4, {})


def test_mtp_pack_rows_is_the_reference_packing():
  """The MTP stage's rows: sequences cut to seq_len, packed first-fit-decreasing under the
  targets cap, tokens and loss mask in place."""
  from bebop_jax.train import drafter  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  seq_len, max_targets = 24, 32
  seqs = []
  for _ in range(30):
    n = int(rng.integers(2, 40))
    mask = (rng.random(n) < 0.5).astype(np.int32)
    mask[0] = 0
    seqs.append((rng.integers(1, 50, n).astype(np.int32), mask))
  out = drafter.pack_rows(seqs, seq_len, max_targets)
  cut = [(t[:seq_len], m[:seq_len]) for t, m in seqs]
  bins = _reference_bins([len(t) for t, _ in cut], seq_len,
                         [int(np.sum(m[1:] > 0)) for _, m in cut], max_targets)
  tokens, segment_ids, positions = _reference_rows([t for t, _ in cut], bins, len(bins),
                                                   seq_len)
  np.testing.assert_array_equal(out["tokens"], tokens)
  np.testing.assert_array_equal(out["segment_ids"], segment_ids)
  np.testing.assert_array_equal(out["positions"], positions)
  np.testing.assert_array_equal(out["loss_mask"], _reference_rows(
      [m for _, m in cut], bins, len(bins), seq_len)[0])
