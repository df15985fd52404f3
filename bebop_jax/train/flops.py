"""Model FLOPs of a training step (analytic) and a matmul baseline measured in-process."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bebop_jax.model.config import ModelConfig, block_param_count


def train_flops_per_step(c: ModelConfig, batch: int, seq_len: int, mtp_depths: int,
                         trainable_main: bool = True) -> float:
  """Forward + backward FLOPs: 6 * (matmul parameters) * tokens + attention score/value
  products (dense T x T, as implemented), for the main model and `mtp_depths` MTP depths.

  With a frozen main model (trainable_main False) its backward costs only the activation
  gradients that the MTP chain needs: none when MTP gradients are detached, so 2x not 6x.
  """
  tokens = batch * seq_len
  head = c.d_model * c.vocab_size
  attn = 4 * seq_len * c.num_heads * c.head_dim  # QK^T and PV per token, forward
  block = block_param_count(c) * 2 + attn          # forward FLOPs per token of one block
  main_fwd = tokens * (c.num_layers * block + 2 * head)
  mtp_fwd = tokens * mtp_depths * (block + 2 * 2 * c.d_model * c.d_model + 2 * head)
  return (3 if trainable_main else 1) * main_fwd + 3 * mtp_fwd


def matmul_flops_per_second(n: int = 2048, repeats: int = 5,
                            dtype=jnp.float32) -> float:
  """FLOP/s of a plain n x n x n matmul on the default device (best of `repeats`)."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best
