"""Model FLOPs of a training step (analytic) and a matmul baseline measured in-process.

Model FLOPs count what the model needs, not what an implementation spends: 6 per matmul
parameter per token (forward 2, backward 4) plus causal attention, the QK^T and PV products
over the T(T+1)/2 (query, key) pairs of a causal sequence. Remat's recomputation and
attention's skipped or masked blocks do not change them, so the same step gets the same
count on every path and model FLOP/s compare directly. The utilization reported next to
them is against a plain f32 matmul measured on the same device by the same process.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from bebop_jax.model.config import ModelConfig


def train_flops_per_step(c: ModelConfig, batch: int, seq_len: int, mtp_depths: int,
                         trainable_main: bool = True) -> float:
  """Forward + backward model FLOPs of one step on [batch, seq_len] tokens: the main model
  and `mtp_depths` MTP depths (each its 2E -> E projection, one block and the head).

  With a frozen main model (trainable_main False) its backward costs only the activation
  gradients that the MTP chain needs: none when MTP gradients are detached, so 2x not 6x.
  """
  tokens = batch * seq_len
  head = c.d_model * c.vocab_size
  # A block's matmul parameters: q, k, v, o and the SwiGLU MLP (its norms are not matmuls).
  matmul = (c.d_model * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
            + 3 * c.d_model * c.mlp_dim)
  # QK^T and PV: 2 products x 2 FLOPs x H x D per (query, key) pair; (T + 1) / 2 causal
  # keys per query on average.
  attn = 4 * c.num_heads * c.head_dim * (seq_len + 1) / 2
  block = 2 * matmul + attn                         # forward FLOPs per token of one block
  main_fwd = tokens * (c.num_layers * block + 2 * head)
  mtp_fwd = tokens * mtp_depths * (block + 2 * 2 * c.d_model * c.d_model + 2 * head)
  return (3 if trainable_main else 1) * main_fwd + 3 * mtp_fwd


def matmul_flops_per_second(n: int = 1024, repeats: int = 5,
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


@functools.cache
def matmul_calibration() -> float:
  """matmul_flops_per_second(), measured once per process (about 0.3 s on two CPU cores)
  and then reused by every stage of the run."""
  return matmul_flops_per_second()


def utilization(flops_per_step: float, step_time_s: float) -> dict[str, float]:
  """{model_flops_per_s, matmul_flops_per_s, flops_utilization} of a step time."""
  model = flops_per_step / step_time_s
  matmul = matmul_calibration()
  return {"model_flops_per_s": model, "matmul_flops_per_s": matmul,
          "flops_utilization": model / matmul}
