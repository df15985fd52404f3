import random

import numpy as np
import pytest

from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.data.tokenizer import CHARACTERS, Tokenizer, UnknownCharacterError
from bebop_jax.tasks import base

TOK = tokenizer_lib.load_tokenizer("char")  # the default data.tokenizer


def test_vocab_is_padded_and_specials_come_first():
  tok = TOK
  assert tok.vocab_size % 128 == 0 and tok.vocab_size >= tok.num_used
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert Tokenizer(pad_to_multiple=64).vocab_size == 128  # 104 used ids -> 128
  assert Tokenizer(pad_to_multiple=1).vocab_size == tok.num_used


def test_round_trip_random_text_with_markers():
  rng = random.Random(0)
  pieces = list(CHARACTERS) + list(base.SPECIAL_MARKERS)
  for _ in range(500):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 80)))
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert all(0 <= i < TOK.vocab_size for i in ids)


def test_markers_are_single_tokens():
  tok = TOK
  for marker in base.SPECIAL_MARKERS:
    assert len(tok.encode(marker)) == 1
  assert tok.encode("<|call|>") == [tok.call_start_id]
  assert tok.encode("<|/call|>") == [tok.call_end_id]
  # A partial marker is plain characters.
  assert len(tok.encode("<|call|")) == len("<|call|")


def test_bos_eos():
  tok = TOK
  ids = tok.encode("ab", add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == 4
  assert tok.decode(ids) == "<|bos|>ab<|eos|>"


@pytest.mark.parametrize("text, bad, pos", [("héllo", "é", 1), ("tab\there", "\t", 3),
                                             ("ok\u2603", "\u2603", 2)])
def test_unknown_character_is_an_error_naming_it(text, bad, pos):
  with pytest.raises(UnknownCharacterError) as e:
    TOK.encode(text)
  assert repr(bad) in str(e.value) and f"position {pos}" in str(e.value)


def test_decode_rejects_out_of_range_ids_and_strips_pad():
  tok = TOK
  with pytest.raises(ValueError, match="token ids must be in"):
    tok.decode([tok.vocab_size])
  ids = np.array([[5, 6, 0, 0], [7, 0, 0, 0]])
  assert tok.decode_batch(ids) == [tok.decode([5, 6]), tok.decode([7])]
  assert tok.decode_batch(ids, lengths=[1, 1]) == [tok.decode([5]), tok.decode([7])]
