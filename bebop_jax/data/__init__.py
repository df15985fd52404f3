"""Tokenizer, TFDS builders and grain pipelines."""

from bebop_jax.data.tokenizer import (BaseTokenizer, CharTokenizer, HFTokenizer, Tokenizer,
                                      UnknownCharacterError, UnknownTokenError, load_tokenizer)
