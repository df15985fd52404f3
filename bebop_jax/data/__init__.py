"""Tokenizer, TFDS builders and grain pipelines."""

from bebop_jax.data.tokenizer import Tokenizer, UnknownCharacterError, get_tokenizer


def encode(text: str, **kwargs) -> list[int]:
  """`get_tokenizer().encode`."""
  return get_tokenizer().encode(text, **kwargs)


def decode(ids, **kwargs) -> str:
  """`get_tokenizer().decode`."""
  return get_tokenizer().decode(ids, **kwargs)
