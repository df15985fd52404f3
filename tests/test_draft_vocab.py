"""The reduced draft vocabulary's choice of tokens (decoding/draft_vocab.py); its decoding is
tested in tests/test_speculative.py."""

import numpy as np
import pytest

from bebop_jax.decoding import draft_vocab


def test_count_tokens_counts_the_masked_positions():
  seqs = [[1, 2, 2, 5], [5, 5, 0]]
  masks = [[False, True, True, True], [True, False, True]]
  counts = draft_vocab.count_tokens(seqs, masks, 6)
  np.testing.assert_array_equal(counts, [1, 0, 2, 0, 0, 2])
  np.testing.assert_array_equal(draft_vocab.count_tokens(seqs, None, 6), [1, 1, 2, 0, 0, 3])
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
    draft_vocab.count_tokens(seqs, None, 4)


def test_top_tokens_by_count_then_id_with_the_stop_tokens_always_in():
  counts = np.array([0, 7, 3, 7, 1, 0, 9])
  np.testing.assert_array_equal(draft_vocab.top_tokens(counts, 3), [1, 3, 6])
  # The stop token 5 (never counted) is in; it takes the place of the least frequent pick.
  np.testing.assert_array_equal(draft_vocab.top_tokens(counts, 3, always=(5,)), [1, 5, 6])
  assert draft_vocab.top_tokens(counts, 7).tolist() == list(range(7))
  assert draft_vocab.coverage(counts, np.array([1, 3, 6])) == pytest.approx(23 / 27)
  with pytest.raises(ValueError, match="size=0 is not allowed"):
    draft_vocab.top_tokens(counts, 0)
  with pytest.raises(ValueError, match="always="):
    draft_vocab.top_tokens(counts, 1, always=(1, 2))
