"""Pure functions of the decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, one block.

Shapes: B batch, T query length, S key length (the cache length when decoding), H query heads,
G = H / KV query heads per key/value head, D head width, E residual width (d_model), F MLP
width. Parameters arrive as plain arrays (one layer's slice of the stacked parameters).
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from bebop_jax import sharding

_MASK_VALUE = -1e30  # finite, so a fully masked row (padding) gives a uniform, not NaN


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float
                ) -> tuple[jax.Array, jax.Array]:
  """(sin, cos) [B, T, 1, D/2] float32 of RoPE at integer positions [B, T]: computed once per
  forward and shared by every block (inside a block they would be recomputed per layer, and
  XLA fuses the sin/cos into the per-head rotation, evaluating them once per head)."""
  freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [D/2]
  angle = positions.astype(jnp.float32)[..., None] * freq                        # [B, T, D/2]
  return jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotary embedding (rotate-half form) of x [B, T, H, D] with tables from rope_tables."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half form) of x [B, T, H, D] at integer positions [B, T]."""
  return apply_rope(x, *rope_tables(positions, x.shape[-1], theta))


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


MAX_QUERY_BLOCKS = 16  # the blocks are unrolled: bound the program's size at long T


def _query_blocks(t: int, block_size: int):
  """(lo, hi) of each query block: the block's queries are lo..hi-1, its keys 0..hi-1.
  At most MAX_QUERY_BLOCKS blocks: a longer sequence gets larger blocks."""
  size = max(block_size, -(-t // MAX_QUERY_BLOCKS))
  return [(lo, min(lo + size, t)) for lo in range(0, t, size)]


def _heads_major(x: jax.Array, kv: int) -> jax.Array:
  """[B, T, H, D] -> [B, KV, G, T, D]."""
  b, t, h, d = x.shape
  return jnp.transpose(x.reshape(b, t, kv, h // kv, d), (0, 2, 3, 1, 4))


def _block_scores(qh, kh, mask, lo, hi, scale):
  """Masked scores [B, KV, G, n, hi] of query block lo..hi-1 against keys 0..hi-1, f32."""
  b, kv, g, _, d = qh.shape
  n = hi - lo
  q = qh[:, :, :, lo:hi].reshape(b, kv, g * n, d)
  s = jnp.einsum("bkqd,bksd->bkqs", q, kh[:, :, :hi], preferred_element_type=jnp.float32)
  return s.reshape(b, kv, g, n, hi) * scale, mask[:, None, None, lo:hi, :hi]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                        block_size: int) -> jax.Array:
  """Causal grouped-query attention by query blocks, equal to `attention` in float tolerance.

  Query block [lo, hi) attends keys [0, hi) only, so the blocks above the diagonal are never
  computed (about half of the dense T x T work at T = 256, block 32). The backward is custom:
  the forward keeps only its output and the per-row log-sum-exp, and the backward recomputes
  each block's probabilities, so no [B, H, T, T] tensor lives between forward and backward.

  Args:
    q: [B, T, H, D]. k, v: [B, T, KV, D] (self-attention: keys at the query positions).
    mask: [B, T, T] bool, True = may attend. It must be causal (keys after a query are never
      read) and let every query attend to itself (true of causal_segment_mask): a row with no
      allowed key would be uniform over its block's prefix, not over all T keys.
    block_size: queries per block (static); raised to T / MAX_QUERY_BLOCKS when smaller.
  Returns:
    [B, T, H, D] in q's dtype; softmax in float32.
  """
  return _blockwise_fwd(q, k, v, mask, block_size)[0]


def _blockwise_fwd(q, k, v, mask, block_size):
  b, t, h, d = q.shape
  kv = k.shape[2]
  scale = d ** -0.5
  qh, kh, vh = _heads_major(q, kv), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  outs, lses = [], []
  for lo, hi in _query_blocks(t, block_size):
    s, m = _block_scores(qh, kh, mask, lo, hi, scale)
    s = jnp.where(m, s, _MASK_VALUE)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - s_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / total).astype(v.dtype)
    g, n = p.shape[2], hi - lo
    o = jnp.einsum("bkqs,bksd->bkqd", p.reshape(b, kv, g * n, hi), vh[:, :, :hi])
    outs.append(o.reshape(b, kv, g, n, d))
    lses.append(s_max + jnp.log(total))
  out = jnp.transpose(jnp.concatenate(outs, axis=3), (0, 3, 1, 2, 4)).reshape(b, t, h, d)
  # Named so that a remat policy (model.REMAT_POLICIES) can keep them: the backward needs
  # nothing else of the forward.
  out = checkpoint_name(out, "attention_out")
  lse = checkpoint_name(jnp.concatenate(lses, axis=3), "attention_lse")  # [B, KV, G, T, 1]
  return out, (q, k, v, mask, out, lse)


def _blockwise_bwd(block_size, residuals, d_out):
  q, k, v, mask, out, lse = residuals
  b, t, h, d = q.shape
  kv = k.shape[2]
  g = h // kv
  scale = d ** -0.5
  qh, kh, vh = _heads_major(q, kv), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  do = _heads_major(d_out, kv).astype(jnp.float32)
  # sum_s P_ts dP_ts = sum_d dO_td O_td: the softmax backward's row term from [T, D] arrays.
  delta = jnp.sum(do * _heads_major(out, kv).astype(jnp.float32), axis=-1, keepdims=True)
  # dK and dV accumulate transposed, [B, KV, D, T]: P^T dO as "bkqd,bkqs->bkds" is a plain
  # batched matmul, about 2x faster on CPU than "bkqs,bkqd->bksd" (which contracts the
  # leading axis of both operands).
  dk_t = jnp.zeros((b, kv, d, t), jnp.float32)
  dv_t = jnp.zeros((b, kv, d, t), jnp.float32)
  dqs = []
  for lo, hi in _query_blocks(t, block_size):
    n = hi - lo
    s, m = _block_scores(qh, kh, mask, lo, hi, scale)
    p = jnp.where(m, jnp.exp(s - lse[:, :, :, lo:hi]), 0.0)            # [B, KV, G, n, hi]
    do_i = do[:, :, :, lo:hi].reshape(b, kv, g * n, d)
    p2 = p.reshape(b, kv, g * n, hi)
    dv_t = dv_t.at[:, :, :, :hi].add(jnp.einsum("bkqd,bkqs->bkds", do_i, p2))
    dp = jnp.einsum("bkqd,bksd->bkqs", do_i, vh[:, :, :hi].astype(jnp.float32))
    ds = (p * (dp.reshape(p.shape) - delta[:, :, :, lo:hi])).reshape(b, kv, g * n, hi) * scale
    dqs.append(jnp.einsum("bkqs,bksd->bkqd", ds, kh[:, :, :hi].astype(jnp.float32)))
    q_i = qh[:, :, :, lo:hi].reshape(b, kv, g * n, d).astype(jnp.float32)
    dk_t = dk_t.at[:, :, :, :hi].add(jnp.einsum("bkqd,bkqs->bkds", q_i, ds))
  dq = jnp.concatenate([x.reshape(b, kv, g, -1, d) for x in dqs], axis=3)
  dq = jnp.transpose(dq, (0, 3, 1, 2, 4)).reshape(b, t, h, d)
  to_btkd = lambda x_t, dtype: jnp.transpose(x_t, (0, 3, 1, 2)).astype(dtype)
  return dq.astype(q.dtype), to_btkd(dk_t, k.dtype), to_btkd(dv_t, v.dtype), None


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)


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
          rope_sincos: tuple[jax.Array, jax.Array] | None = None,
          attention_block_size: int | None = None,
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
    rope_sincos: rope_tables(positions, ...), computed once for all blocks (default: here).
    attention_block_size: teacher-forced mode only: blockwise_attention with query blocks of
      this size (the mask must be causal); None = the dense `attention`.
  Returns:
    (new x [B, T, E], this block's updated (k, v) caches or None).
  """
  h = rms_norm(x, p["attn_norm"], eps)
  # The names mark what model.REMAT_POLICIES may keep for the backward.
  q = checkpoint_name(dense(h, p["wq"]), "q")
  k = checkpoint_name(dense(h, p["wk"]), "k")
  v = checkpoint_name(dense(h, p["wv"]), "v")
  if qk_norm:
    q = rms_norm(q, p["q_norm"], eps)
    k = rms_norm(k, p["k_norm"], eps)
  if rope_sincos is None:
    rope_sincos = rope_tables(positions, q.shape[-1], rope_theta)
  q = sharding.constrain(apply_rope(q, *rope_sincos), ("batch", "length", "heads", None))
  k = apply_rope(k, *rope_sincos)
  if kv_cache is None:
    if attention_block_size is None:
      out = attention(q, k, v, mask)
    else:
      out = blockwise_attention(q, k, v, mask, attention_block_size)
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
  hidden = (jax.nn.silu(checkpoint_name(dense(h, p["w_gate"]), "gate"))
            * checkpoint_name(dense(h, p["w_up"]), "up"))
  hidden = sharding.constrain(hidden, ("batch", "length", "mlp"))
  x = x + dense(hidden, p["w_down"])
  return sharding.constrain(x, ("batch", "length", "embed")), new_cache
