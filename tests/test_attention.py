"""Blockwise attention and the remat policies against the dense reference path.

The dense `layers.attention` with every intermediate kept (model.attention="dense",
model.remat="none") is the reference: the training path must equal it in value and gradient
within float32 tolerance, and keep much less for the backward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax.losses import lm
from bebop_jax.model import config as model_config
from bebop_jax.model import layers
from bebop_jax.model import model as policy_lib


def _packed_segments(b, t, rng):
  """[B, T] segment ids: 1-4 segments per row, then padding (segment 0) in some rows."""
  seg = np.zeros((b, t), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t - 1), rng.integers(0, 4), replace=False))
    end = t - rng.integers(0, t // 4) if row % 2 else t
    for i, (lo, hi) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, end])):
      seg[row, lo:hi] = i + 1
  return jnp.asarray(seg)


@pytest.mark.parametrize("block_size", [5, 16, 64])
def test_blockwise_attention_matches_dense_in_value_and_gradient(block_size):
  b, t, h, kv, d = 3, 37, 4, 2, 8   # T = 37: the last block is ragged for every size
  rng = np.random.default_rng(block_size)
  q, k, v, cot = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in
                  ((b, t, h, d), (b, t, kv, d), (b, t, kv, d), (b, t, h, d)))
  mask = layers.causal_segment_mask(_packed_segments(b, t, rng))

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * cot)
  blockwise = lambda q, k, v, m: layers.blockwise_attention(q, k, v, m, block_size)
  want, want_grads = jax.value_and_grad(loss(layers.attention), argnums=(0, 1, 2))(q, k, v)
  got, got_grads = jax.jit(jax.value_and_grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(np.asarray(blockwise(q, k, v, mask)),
                             np.asarray(layers.attention(q, k, v, mask)), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for name, g, w in zip("qkv", got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4,
                               err_msg=f"d{name}")


def _sft_grads(cfg, tokens, positions, segments):
  graphdef, state = policy_lib.init(cfg, seed=0)

  def loss(state):
    out = nnx.merge(graphdef, state)(tokens, positions, segments)
    return lm.sft_loss(out, tokens, (segments > 0).astype(jnp.int32), 0.3)[0]
  return jax.jit(jax.value_and_grad(loss))(state)


def test_training_path_equals_dense_reference():
  """SFT loss (main + MTP chain) and every parameter's gradient: blockwise attention with
  each remat policy against dense attention without remat."""
  b, t = 4, 96
  rng = np.random.default_rng(0)
  segments = _packed_segments(b, t, rng)
  starts = np.maximum.accumulate(
      np.where(np.diff(np.asarray(segments), prepend=-1, axis=1) != 0, np.arange(t), 0), axis=1)
  positions = jnp.asarray(np.arange(t) - starts, jnp.int32)
  tokens = jnp.asarray(rng.integers(3, 100, (b, t)), jnp.int32)
  base = dict(num_mtp_modules=1, num_draft_steps=2, attention_block_size=16)
  (want, want_g) = _sft_grads(
      model_config.preset("tiny", **base, attention="dense", remat="none"),
      tokens, positions, segments)
  for remat in model_config.REMAT:
    got, got_g = _sft_grads(model_config.preset("tiny", **base, remat=remat),
                                   tokens, positions, segments)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g),
                            jax.tree.leaves(want_g)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-6, rtol=1e-4,
                                 err_msg=f"{remat}: {jax.tree_util.keystr(path)}")
