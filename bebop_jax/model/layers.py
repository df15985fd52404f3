"""Pure functions of the decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, one block.

Shapes: B batch, T query length, S key length (the cache length when decoding), H query heads,
G = H / KV query heads per key/value head, D head width, E residual width (d_model), F MLP
width. Parameters arrive as plain arrays (one layer's slice of the stacked parameters).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from bebop_jax import sharding

_MASK_VALUE = -1e30  # finite, so a fully masked row (padding) gives a uniform, not NaN


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half form) of x [B, T, H, D] at integer positions [B, T]."""
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)           # [D/2]
  angle = positions.astype(jnp.float32)[..., None] * freq                  # [B, T, D/2]
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention.

  Args:
    q: [B, T, H, D] queries. k, v: [B, S, KV, D]. mask: [B, T, S] bool, True = may attend.
  Returns:
    [B, T, H, D] in q's dtype; softmax in float32.
  """
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d)


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T, T] mask: causal and within the same segment (segment 0 is padding)."""
  t = segment_ids.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal[None] & same


def cache_mask(query_positions: jax.Array, cache_len: int) -> jax.Array:
  """[B, T, S] mask for queries at positions [B, T] over a cache of length S: key s <= pos."""
  return jnp.arange(cache_len)[None, None, :] <= query_positions[:, :, None]


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """Writes new [B, T, KV, D] into one block's cache [B, KV, S, D] at per-token positions
  [B, T]: a scatter into the buffer, so XLA updates it in place (no per-step copy).
  Positions outside [0, S) are dropped (never clamped onto other entries)."""
  b, _, kv, _ = new.shape
  rows = jnp.arange(b)[:, None, None]
  heads = jnp.arange(kv)[None, :, None]
  new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, KV, T, D]
  return cache.at[rows, heads, positions[:, None, :]].set(new, mode="drop")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention of a few queries over one block's cache.

  Args:
    q: [B, T, H, D] queries. k, v: [B, KV, S, D] (the cache layout: every product below is a
      plain batched matmul over (B, KV), so nothing of size S is transposed or copied).
    mask: [B, T, S] bool, True = may attend.
  Returns:
    [B, T, H, D] in q's dtype; softmax in float32.
  """
  b, t, h, d = q.shape
  kv = k.shape[1]
  g = h // kv
  q = jnp.transpose(q.reshape(b, t, kv, g, d), (0, 2, 3, 1, 4)).reshape(b, kv, g * t, d)
  scores = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32)
  scores = scores.reshape(b, kv, g, t, -1) * (d ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv, g * t, -1)
  out = jnp.einsum("bkqs,bksd->bkqd", probs, v).reshape(b, kv, g, t, d)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d)


def dense(x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
  """x [..., I] times w [I, ...] as one 2-D matmul, reshaped to [..., *w.shape[1:]]
  (kwargs go to jnp.matmul, e.g. preferred_element_type).

  Flattening the leading axes matters on CPU: XLA lowers the backward of a 3-D einsum such
  as 'bte,ef->btf' to transposes fused with the surrounding elementwise ops, about 3x slower
  than the same product on [B*T, I] (measured on the SwiGLU MLP).
  """
  lead = x.shape[:-1]
  y = jnp.matmul(x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1), **kwargs)
  return y.reshape(lead + w.shape[1:])


def block(p: Mapping[str, jax.Array], x: jax.Array, positions: jax.Array, *,
          mask: jax.Array | None = None,
          kv_cache: tuple[jax.Array, jax.Array] | None = None,
          kv_len: int | None = None,
          rope_theta: float, eps: float, qk_norm: bool
          ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
  """One pre-norm transformer block: x + Attn(norm x), then + SwiGLU(norm x).

  Args:
    p: one layer's parameters (see model._block_shapes), already in the compute dtype.
    x: [B, T, E] residual stream.
    positions: [B, T] absolute positions (RoPE; cache slots when decoding).
    mask: [B, T, T] self-attention mask (teacher-forced mode, no cache).
    kv_cache: (k, v): this block's caches [B, KV, S, D]; the new keys and values are written
      at `positions` and the queries attend over the cache with a causal-by-position mask.
    kv_len: with kv_cache, attend over the first kv_len cache positions only (static; a
      prefill at positions < kv_len need not read, or mask, the rest of the cache).
  Returns:
    (new x [B, T, E], this block's updated (k, v) caches or None).
  """
  h = rms_norm(x, p["attn_norm"], eps)
  q = dense(h, p["wq"])
  k = dense(h, p["wk"])
  v = dense(h, p["wv"])
  if qk_norm:
    q = rms_norm(q, p["q_norm"], eps)
    k = rms_norm(k, p["k_norm"], eps)
  q = sharding.constrain(rope(q, positions, rope_theta), ("batch", "length", "heads", None))
  k = rope(k, positions, rope_theta)
  if kv_cache is None:
    out = attention(q, k, v, mask)
    new_cache = None
  else:
    k_cache = write_cache(kv_cache[0], k, positions)
    v_cache = write_cache(kv_cache[1], v, positions)
    s_len = k_cache.shape[2] if kv_len is None else kv_len
    out = cached_attention(q, k_cache[:, :, :s_len], v_cache[:, :, :s_len],
                           cache_mask(positions, s_len))
    new_cache = (k_cache, v_cache)
  b, t, heads, d = out.shape
  x = x + dense(out.reshape(b, t, heads * d), p["wo"].reshape(heads * d, -1))
  x = sharding.constrain(x, ("batch", "length", "embed"))
  h = rms_norm(x, p["mlp_norm"], eps)
  hidden = jax.nn.silu(dense(h, p["w_gate"])) * dense(h, p["w_up"])
  hidden = sharding.constrain(hidden, ("batch", "length", "mlp"))
  x = x + dense(hidden, p["w_down"])
  return sharding.constrain(x, ("batch", "length", "embed")), new_cache
