"""Decoding: sampling transforms, verification, autoregressive and speculative generation.

`bebop_jax.decoding.verify(rng, draft_tokens, draft_probs, target_probs, mode)` is the public
verification function (see `verification.py`).
"""

from bebop_jax.decoding.verification import MODES, verify

__all__ = ["MODES", "verify"]
