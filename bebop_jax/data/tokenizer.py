"""Character-level tokenizer with special tokens.

Ids: the special markers of `bebop_jax.tasks.base` first (pad = 0, bos = 1, eos = 2, ...), then
'\\n' and the printable ASCII characters (32..126), then unused padding ids so the vocabulary
size is a multiple of `pad_to_multiple` (128 by default, which shards evenly over tensor axes
of 2, 4 or 8 and fills MXU/tensor-core tiles).

`encode` is exact: `decode(encode(s)) == s` for every string made of the character set and the
markers; a character outside the set is an error at encode time, never dropped.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import numpy as np

from bebop_jax.tasks import base

CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))


class UnknownCharacterError(ValueError):
  """Raised by `encode` for a character outside the tokenizer's character set."""


class Tokenizer:
  """Character-level tokenizer; special markers such as '<|eos|>' are single tokens."""

  def __init__(self, pad_to_multiple: int = 128):
    if pad_to_multiple < 1:
      raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    self.specials = base.SPECIAL_MARKERS
    self._pieces = list(self.specials) + list(CHARACTERS)
    self._id = {piece: i for i, piece in enumerate(self._pieces)}
    self.num_used = len(self._pieces)
    self.vocab_size = -(-self.num_used // pad_to_multiple) * pad_to_multiple
    # Longest markers first so that no marker is split into a shorter one.
    self._split = re.compile("(" + "|".join(
        re.escape(m) for m in sorted(self.specials, key=len, reverse=True)) + ")")
    self._decode_table = np.array(self._pieces + [""] * (self.vocab_size - self.num_used),
                                  dtype=object)

  pad_id = property(lambda self: self._id[base.PAD_MARKER])
  bos_id = property(lambda self: self._id[base.BOS_MARKER])
  eos_id = property(lambda self: self._id[base.EOS_MARKER])
  answer_id = property(lambda self: self._id[base.ANSWER_MARKER])
  call_start_id = property(lambda self: self._id[base.CALL_START])
  call_end_id = property(lambda self: self._id[base.CALL_END])
  result_start_id = property(lambda self: self._id[base.RESULT_START])
  result_end_id = property(lambda self: self._id[base.RESULT_END])

  def token_id(self, piece: str) -> int:
    """The id of one character or special marker."""
    if piece not in self._id:
      raise UnknownCharacterError(f"{piece!r} is not a token of the vocabulary")
    return self._id[piece]

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text`; markers such as '<|call|>' become one token each.

    Raises:
      UnknownCharacterError: naming the first character outside the character set, its
        position, and the allowed set.
    """
    ids = [self.bos_id] if add_bos else []
    for i, part in enumerate(self._split.split(text)):
      if i % 2:  # a marker
        ids.append(self._id[part])
        continue
      for c in part:
        tid = self._id.get(c)
        if tid is None or len(c) != 1:
          pos = text.find(c)
          raise UnknownCharacterError(
              f"character {c!r} (U+{ord(c):04X}) at position {pos} of the text is not in the "
              "tokenizer's character set: allowed are '\\n', printable ASCII (U+0020..U+007E) "
              f"and the markers {', '.join(self.specials)}")
        ids.append(tid)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int] | np.ndarray, *, strip_pad: bool = False) -> str:
    """Text of `ids`. Unused padding ids decode to ''; out-of-range ids are an error."""
    arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
      raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range "
                       f"[{arr.min()}, {arr.max()}]")
    if strip_pad:
      arr = arr[arr != self.pad_id]
    return "".join(self._decode_table[arr].tolist())

  def decode_batch(self, ids: np.ndarray, lengths: Sequence[int] | None = None) -> list[str]:
    """Decodes each row of a [B, L] array, up to `lengths[b]` tokens when given."""
    ids = np.asarray(ids)
    if lengths is None:
      return [self.decode(row, strip_pad=True) for row in ids]
    return [self.decode(row[:n]) for row, n in zip(ids, lengths)]


_DEFAULT: Tokenizer | None = None


def get_tokenizer() -> Tokenizer:
  """The project's tokenizer (one shared instance)."""
  global _DEFAULT
  if _DEFAULT is None:
    _DEFAULT = Tokenizer()
  return _DEFAULT
