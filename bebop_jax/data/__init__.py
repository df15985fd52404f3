"""Tokenizer, TFDS builders and grain pipelines."""

from bebop_jax.data.tokenizer import (BaseTokenizer, CharTokenizer, HFTokenizer, Tokenizer,
                                      UnknownCharacterError, UnknownTokenError, get_tokenizer,
                                      load_tokenizer, set_tokenizer, use_tokenizer)


def encode(text: str, **kwargs) -> list[int]:
  """`get_tokenizer().encode`."""
  return get_tokenizer().encode(text, **kwargs)


def decode(ids, **kwargs) -> str:
  """`get_tokenizer().decode`."""
  return get_tokenizer().decode(ids, **kwargs)
