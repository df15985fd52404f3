"""How a loss reaches the vocabulary: the dense head or the fused head.

  dense  the forward's [B, T, V] float32 logits (Policy.__call__ with logits=True), reduced
         with jax.nn;
  fused  the final-normed hidden states and the head (Policy.__call__ with logits=False),
         streamed over vocabulary chunks by pallas_kernels.fused_head: no [B, T, V] array.
Both give the same per-position values and gradients (tests/test_sft.py,
tests/test_rl_learner.py, tests/test_mtp_losses.py). `next_token_terms` is what SFT and the RL
learner need per position; the MTP chain's terms are in losses/mtp.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bebop_jax import sharding
from pallas_kernels.fused_head import fused_head

HEADS = ("fused", "dense")
LOGITS_AXES = ("batch", "length", "vocab")  # the main model's [B, T, V] logits


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """-log softmax(logits)[target] per position; logits [..., V], targets [...] int."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def shift_left_axis1(x: jax.Array, k: int) -> jax.Array:
  """x[:, i + k] at i along axis 1 (zeros past the end), for arrays [B, T, ...]."""
  pad = jnp.zeros((x.shape[0], k) + x.shape[2:], x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)


def check_head(head: str, key: str) -> None:
  """Raises a ValueError naming `key` unless head is one of HEADS."""
  if head not in HEADS:
    raise ValueError(f"{key}={head!r} is not allowed: one of {HEADS}")


def next_token_terms(out: dict[str, jax.Array], targets: jax.Array, *,
                     temperature: float = 1.0) -> dict[str, jax.Array]:
  """Per position i of softmax(main logits_i / temperature) =: q_i, each [B, T] float32:
  logprob = log q_i[targets_i], entropy = H(q_i) and max_logprob = max_v log q_i[v] (no
  gradient; `logprob >= max_logprob` says targets_i is an argmax of the logits).

  Args:
    out: Policy.__call__'s outputs: "logits" (dense) or "normed" and "head" (fused, every
      term streamed over vocabulary chunks; under a mesh (`sharding.use_mesh`) in shard_map
      with the logits' layout from the logical-axis rules).
    targets: [B, T] int token ids in [0, V).
    temperature: > 0; the fused head divides the hidden states (in float32 when it is not 1,
      so a bfloat16 hidden state is not rounded again after the division).
  """
  if "logits" in out:
    logp = jax.nn.log_softmax(out["logits"].astype(jnp.float32) / temperature, axis=-1)
    p = jnp.exp(logp)
    return {"logprob": jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0],
            "entropy": -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1),
            "max_logprob": jax.lax.stop_gradient(jnp.max(logp, axis=-1))}
  hidden, head = out["normed"], out["head"]
  if temperature != 1.0:
    hidden = hidden.astype(jnp.float32) / temperature
  mesh, spec = sharding.current_spec(LOGITS_AXES, hidden.shape[:-1] + (head.shape[1],))
  terms = fused_head(hidden, head, tokens=targets, mesh=mesh, spec=spec)
  return {k: terms[k] for k in ("logprob", "entropy", "max_logprob")}
