"""The policy: a Qwen3-style decoder with DeepSeek-V3-style MTP modules (DESIGN.md 3, 4).

Flax NNX holds the parameters (every `nnx.Param` carries `logical_axes` for sharding); the
math is in pure functions of arrays. Use it functionally: split once,

    graphdef, state = nnx.split(Policy(cfg, rngs=nnx.Rngs(0)))

then call jitted functions of `(state, inputs)` that `nnx.merge(graphdef, state)` inside.
Block parameters are stacked along a leading axis (main: num_layers, MTP: num_mtp_modules)
and the teacher-forced model scans over its layers, so compile time does not grow with depth.
Decoding unrolls the layers instead, over per-block slices taken once by `decode_weights`
and per-block caches: a decode step is tiny, and inside a decoding `while_loop` a scan would
copy every layer's weights and cache slice at every step (see `decode_weights`).

Notation (0-based positions 0..T-1): the main model at i gives hidden h0_i and logits of
p_i = P(x_{i+1} | x_{<=i}). MTP depth k = 1..K at position i:

    u_i^k = W_m [RMSNorm_m(h_i^{k-1}); RMSNorm'_m(Emb(x_{i+k}))]    (m = min(k, M) - 1)
    h_i^k = Block_m(u^k)_i                 (causal over positions <= i, its own KV cache)
    q_i^k = Head(FinalNorm(h_i^k))         predicts x_{i+k+1}; target p_{i+k}

valid iff i+k+1 < T and x_{i+k+1} is in the same (non-padding) segment as x_i.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from bebop_jax import sharding
from bebop_jax.model import layers
from bebop_jax.model.config import ModelConfig

# name -> (shape in terms of the config, logical axes). Leading stack axis added per use.
def _block_shapes(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
  shapes = {
      "attn_norm": ((c.d_model,), ("norm",)),
      "wq": ((c.d_model, c.num_heads, c.head_dim), ("embed", "heads", "head_dim")),
      "wk": ((c.d_model, c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim")),
      "wv": ((c.d_model, c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim")),
      "wo": ((c.num_heads, c.head_dim, c.d_model), ("heads", "head_dim", "embed")),
      "mlp_norm": ((c.d_model,), ("norm",)),
      "w_gate": ((c.d_model, c.mlp_dim), ("embed", "mlp")),
      "w_up": ((c.d_model, c.mlp_dim), ("embed", "mlp")),
      "w_down": ((c.mlp_dim, c.d_model), ("mlp", "embed")),
  }
  if c.qk_norm:
    shapes["q_norm"] = ((c.head_dim,), ("head_dim",))
    shapes["k_norm"] = ((c.head_dim,), ("head_dim",))
  return shapes


def _param(rngs: nnx.Rngs, shape, axes, dtype, *, std: float | None) -> nnx.Param:
  """A Param of `shape`: ones when std is None (norm scales), else normal(0, std)."""
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


class StackedBlocks(nnx.Module):
  """`num` transformer blocks with parameters stacked on a leading axis."""

  def __init__(self, c: ModelConfig, num: int, stack_axis: str, rngs: nnx.Rngs):
    fan_in = {"wq": c.d_model, "wk": c.d_model, "wv": c.d_model,
              "wo": c.num_heads * c.head_dim, "w_gate": c.d_model, "w_up": c.d_model,
              "w_down": c.mlp_dim}
    for name, (shape, axes) in _block_shapes(c).items():
      std = fan_in[name] ** -0.5 if name in fan_in else None
      setattr(self, name, _param(rngs, (num,) + shape, (stack_axis,) + axes,
                                 c.weight_dtype, std=std))

  def arrays(self, dtype) -> dict[str, jax.Array]:
    """The stacked parameters as arrays in `dtype`."""
    return {name: var[...].astype(dtype) for name, var in vars(self).items()
            if isinstance(var, nnx.Param)}


class MTPModules(nnx.Module):
  """M MTP modules: input norms, the 2E -> E projection and one block each (stacked)."""

  def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
    m = c.num_mtp_modules
    self.hidden_norm = _param(rngs, (m, c.d_model), ("mtp", "norm"), c.weight_dtype, std=None)
    self.embed_norm = _param(rngs, (m, c.d_model), ("mtp", "norm"), c.weight_dtype, std=None)
    self.proj = _param(rngs, (m, 2 * c.d_model, c.d_model), ("mtp", None, "embed"),
                       c.weight_dtype, std=(2 * c.d_model) ** -0.5)
    self.blocks = StackedBlocks(c, m, "mtp", rngs)


@flax.struct.dataclass
class KVCache:
  """Keys and values of a stack of blocks, one buffer per block: k[i], v[i] [B, KV, S, D].

  Separate buffers (not one stacked array) so a decode step updates and reads each block's
  cache in place; the [KV, S, D] order makes attention's products plain batched matmuls."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def length(self) -> int:
    return self.k[0].shape[2]

  def stacked(self, name: str) -> jax.Array:
    """k or v of every block stacked: [num_blocks, B, KV, S, D] (for tests and inspection)."""
    return jnp.stack(getattr(self, name))


@flax.struct.dataclass
class Cache:
  """Decoding caches: the main model's, and one per MTP depth (k = 1..K at index k-1)."""
  main: KVCache
  mtp: KVCache

  @property
  def length(self) -> int:
    return self.main.length


CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")  # of each block's buffer

# model.remat -> the jax.checkpoint policy of a teacher-forced block (None: no checkpoint).
# "projections" keeps the q, k, v, gate and up projections (names set in layers.block) and
# blockwise attention's output and log-sum-exp, and recomputes the rest in the backward: the
# norms, RoPE, SwiGLU and the two cheaper output projections. On CPU, where the step is bound
# by memory traffic, that is faster than storing them, and it keeps about a third of the memory.
REMAT_POLICIES = {
    "none": None,
    "projections": jax.checkpoint_policies.save_only_these_names(
        "q", "k", "v", "gate", "up", "attention_out", "attention_lse"),
    "full": jax.checkpoint_policies.nothing_saveable,
}


class Policy(nnx.Module):
  """Qwen3-style decoder with MTP modules. See the module docstring for the math."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = self.config = config
    self.embed = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), c.weight_dtype,
                        std=c.d_model ** -0.5)
    self.layers = StackedBlocks(c, c.num_layers, "layers", rngs)
    self.final_norm = _param(rngs, (c.d_model,), ("norm",), c.weight_dtype, std=None)
    if not c.tie_embeddings:
      self.head = _param(rngs, (c.d_model, c.vocab_size), ("embed", "vocab"), c.weight_dtype,
                         std=c.d_model ** -0.5)
    self.mtp = MTPModules(c, rngs)

  # ---------------------------------------------------------------- shared pieces

  def _block_kwargs(self) -> dict[str, Any]:
    c = self.config
    return dict(rope_theta=c.rope_theta, eps=c.norm_eps, qk_norm=c.qk_norm)

  def _shared(self, stop_gradient: bool) -> dict[str, jax.Array]:
    """Embedding, final norm and head as used by the MTP chain (detached if asked)."""
    dt = self.config.compute_dtype
    shared = {"embed": self.embed[...].astype(dt), "final_norm": self.final_norm[...]}
    shared["head"] = (self.head[...].astype(dt) if not self.config.tie_embeddings
                      else shared["embed"].T)
    if stop_gradient:
      shared = jax.tree.map(jax.lax.stop_gradient, shared)
    return shared

  def _embed(self, table: jax.Array, tokens: jax.Array, *, gather_table: bool = False
             ) -> jax.Array:
    if gather_table:
      # Teacher-forced batches are large: all-gather the table's embed axis first (as FSDP
      # does for every weight at use) so the lookup comes out sharded like its tokens. With
      # the table split over fsdp the lookup runs on the whole batch and, when data and fsdp
      # are both > 1, the partitioner replicates the full [B, T, E] on every device to reach
      # the constraint below. Decoding chunks are small: gathering their token ids is cheaper.
      table = sharding.constrain(table, ("vocab", None))
    x = jnp.take(table, tokens, axis=0)
    return sharding.constrain(x, ("batch", "length", "embed"))

  def _final_norm(self, shared: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    """h [..., E] through the final norm: what the head multiplies."""
    return layers.rms_norm(h, shared["final_norm"], self.config.norm_eps)

  def _logits(self, shared: dict[str, jax.Array], h: jax.Array,
              head: jax.Array | None = None) -> jax.Array:
    """float32 logits [B, T, V] of hidden states h [B, T, E] (through `head` [E, V'] instead
    of the shared head when given: a reduced draft vocabulary)."""
    h = self._final_norm(shared, h)
    head = shared["head"] if head is None else head
    logits = layers.dense(h, head, preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ("batch", "length", "vocab"))

  def _teacher_block(self, *, in_scan: bool):
    """(p, x, positions, mask, rope_sincos) -> x: one teacher-forced block with the config's
    attention and remat policy."""
    c = self.config
    kw = dict(self._block_kwargs(), attention_block_size=(
        c.attention_block_size if c.attention == "blockwise" else None))

    def fn(p, x, positions, mask, sincos):
      return layers.block(p, x, positions, mask=mask, rope_sincos=sincos, **kw)[0]
    policy = REMAT_POLICIES[c.remat]
    if policy is None:
      return fn
    # prevent_cse=False inside scan, as jax.checkpoint's docs recommend there.
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)

  def _main_blocks(self, x, positions, *, mask, sincos, frozen: bool = False):
    """Teacher-forced: a scan over the stacked layers. `frozen`: the layers' weights are
    detached, and the scan slices them as unsigned integers of their width, bitcast back to
    the compute dtype inside the body. XLA's CPU float normalization runs a bfloat16
    dynamic-slice in float32, and then hoists the float32 copy of the whole stack out of the
    loop (3.3 GiB per device at Qwen3-8B on fsdp 2 x tensor 4); an integer slice stays as is.
    """
    fn = self._teacher_block(in_scan=True)
    weights = self.layers.arrays(self.config.compute_dtype)
    dtypes = {n: a.dtype for n, a in weights.items()}
    if frozen:
      weights = {n: jax.lax.bitcast_convert_type(jax.lax.stop_gradient(a), _uint_like(a))
                 for n, a in weights.items()}

    def body(x, p):
      if frozen:
        p = {n: jax.lax.bitcast_convert_type(a, dtypes[n]) for n, a in p.items()}
      return fn(p, x, positions, mask, sincos), None
    x, _ = jax.lax.scan(body, x, weights)
    return x

  def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    c = self.config
    return layers.rope_tables(positions, c.head_dim, c.rope_theta)

  def _main_blocks_cached(self, weights, x, positions, cache: KVCache, kv_len: int | None):
    """Decoding: the layers unrolled, each on its own weight slices and cache buffers."""
    kw = self._block_kwargs()
    sincos = self._rope(positions)
    ks, vs = [], []
    for p, k, v in zip(weights["layers"], cache.k, cache.v):
      x, (k, v) = layers.block(p, x, positions, kv_cache=(k, v), kv_len=kv_len,
                               rope_sincos=sincos, **kw)
      ks.append(k)
      vs.append(v)
    return x, KVCache(k=tuple(ks), v=tuple(vs))

  def loop_weights(self) -> dict[str, Any] | None:
    """What a decoding loop passes as `weights=`: `decode_weights()` taken once before the
    loop, or None (slice inside every step) when config.decode_preslice_weights is False."""
    return self.decode_weights() if self.config.decode_preslice_weights else None

  def _mtp_module(self, module: int) -> dict[str, jax.Array]:
    """MTP module `module`'s parameters in the compute dtype: its input norms and projection
    ("hidden_norm", "embed_norm", "proj") and its block's (the other names)."""
    dt = self.config.compute_dtype
    params = {n: a[module] for n, a in self.mtp.blocks.arrays(dt).items()}
    params.update(hidden_norm=self.mtp.hidden_norm[module], embed_norm=self.mtp.embed_norm[module],
                  proj=self.mtp.proj[module].astype(dt))
    return params

  def _mtp_input(self, p: dict[str, jax.Array], h_prev: jax.Array, emb: jax.Array
                 ) -> jax.Array:
    """u = W_m [RMSNorm(h_prev); RMSNorm(emb)] with module m's parameters p."""
    eps = self.config.norm_eps
    hn = layers.rms_norm(h_prev, p["hidden_norm"], eps)
    en = layers.rms_norm(emb, p["embed_norm"], eps)
    u = layers.dense(jnp.concatenate([hn, en], axis=-1), p["proj"])
    return sharding.constrain(u, ("batch", "length", "embed"))


  def _mtp_chain(self, shared: dict[str, jax.Array], h0: jax.Array, tokens: jax.Array,
                 positions: jax.Array, mask: jax.Array, sincos: tuple[jax.Array, jax.Array],
                 k_steps: int, *, logits: bool) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced MTP chain, depths 1..K: (hidden [K, B, T, E], and per depth logits
    [K, B, T, V] f32 or, with logits=False, the final-normed hidden states [K, B, T, E]).

    A scan over the depths whose body (the depth's embedding, input projection and block) is
    under the config's remat policy: the backward is a loop that recomputes and holds one
    depth at a time. Unrolled, XLA (on CPU) scheduled every depth's recomputation before
    the loss, so all K depths' recomputed activations were live at once (docs/mtp.md).
    """
    c = self.config
    dt = c.compute_dtype
    modules = {**self.mtp.blocks.arrays(dt), "hidden_norm": self.mtp.hidden_norm[...],
               "embed_norm": self.mtp.embed_norm[...], "proj": self.mtp.proj[...].astype(dt)}
    kw = dict(self._block_kwargs(), attention_block_size=(
        c.attention_block_size if c.attention == "blockwise" else None))

    def depth_step(p, h_prev, next_tokens):
      emb = self._embed(shared["embed"], next_tokens, gather_table=True)
      u = self._mtp_input(p, h_prev, emb)
      return layers.block(p, u, positions, mask=mask, rope_sincos=sincos, **kw)[0]
    policy = REMAT_POLICIES[c.remat]
    if policy is not None:
      # prevent_cse=False inside scan, as jax.checkpoint's docs recommend there.
      depth_step = jax.checkpoint(depth_step, policy=policy, prevent_cse=False)

    def body(h_prev, xs):
      module, next_tokens = xs
      p = {n: a[module] for n, a in modules.items()}
      h = depth_step(p, h_prev, next_tokens)
      return h, (h, self._logits(shared, h) if logits else self._final_norm(shared, h))
    depths = range(1, k_steps + 1)
    xs = (jnp.asarray([c.mtp_module_index(d) for d in depths], jnp.int32),
          jnp.stack([shift_left(tokens, d) for d in depths]))
    _, (hidden, out) = jax.lax.scan(body, h0, xs)
    return hidden, out

  def decode_weights(self) -> dict[str, Any]:
    """The parameters as decoding uses them: per-block slices of the stacked layers and MTP
    modules, cast to the compute dtype, and the shared embedding, final norm and head.

    `step`, `mtp_step` and `prefill` take them as `weights=`; a decoding loop computes them
    once, before its `while_loop` (`loop_weights`). Taken inside the loop body, every slice
    (and the tied head's transpose) is a copy of the weights at every step on CPU and GPU:
    XLA does not hoist them.
    """
    dt = self.config.compute_dtype
    stacked = self.layers.arrays(dt)
    return {
        "shared": self._shared(stop_gradient=False),
        "layers": tuple({n: a[i] for n, a in stacked.items()}
                        for i in range(self.config.num_layers)),
        "mtp": tuple(self._mtp_module(m) for m in range(self.config.num_mtp_modules)),
    }

  # ---------------------------------------------------------------- teacher-forced

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, num_draft_steps: int | None = None,
               mtp_stop_gradient: bool | None = None, logits: bool = True,
               frozen_layers: bool = False, hidden: jax.Array | None = None
               ) -> dict[str, jax.Array]:
    """Teacher-forced forward of the main model and the MTP chain.

    Args:
      tokens: [B, T] int.
      positions: [B, T] positions (default arange; packed batches restart per segment).
      segment_ids: [B, T] (default all ones); 0 marks padding.
      num_draft_steps: K (default config.num_draft_steps); 0 skips the MTP chain.
      mtp_stop_gradient: default config.mtp_stop_gradient.
      logits: False returns, instead of logits, the hidden states through the final norm
        and the head they multiply (for losses that stream the head over the vocabulary,
        bebop_jax/losses/head.py, and never hold [B, T, V] logits).
      frozen_layers: the main model's layers are detached (no gradient reaches their
        weights), which lets their scan keep the weights in their own dtype on CPU (see
        `_main_blocks`). The MTP stage sets it: its loss sees the trunk only through
        stop-gradients.
      hidden: [B, T, E] the main model's h0 of these tokens, computed before (the MTP
        stage's cached features, drafter_data.py): the main layers do not run, only the
        final norm and head on it, and the MTP chain. A constant (no gradient reaches it).
    Returns a dict:
      logits [B, T, V] f32: p_i; hidden [B, T, E]: h0_i; mask [B, T] bool: p_i is valid;
      mtp_logits [K, B, T, V] f32: q_i^k at index k-1; mtp_hidden [K, B, T, E];
      mtp_mask [K, B, T] bool: q_i^k is valid. With logits=False: normed [B, T, E] and
      head [E, V] (p_i = softmax(normed_i @ head)) in place of logits, mtp_normed
      [K, B, T, E] and mtp_head [E, V] (the chain's head, detached when the chain's
      shared weights are) in place of mtp_logits.
    """
    c = self.config
    b, t = tokens.shape
    k_steps = c.num_draft_steps if num_draft_steps is None else num_draft_steps
    stop = c.mtp_stop_gradient if mtp_stop_gradient is None else mtp_stop_gradient
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    # Built once per batch and shared by every block: the mask and the RoPE tables.
    attn_mask = layers.causal_segment_mask(segment_ids)
    sincos = self._rope(positions)

    shared = self._shared(stop_gradient=False)
    if hidden is None:
      h0 = self._main_blocks(self._embed(shared["embed"], tokens, gather_table=True),
                             positions, mask=attn_mask, sincos=sincos, frozen=frozen_layers)
    else:
      if hidden.shape != (b, t, c.d_model):
        raise ValueError(f"hidden {hidden.shape} must be [B, T, E] = {(b, t, c.d_model)}")
      h0 = jax.lax.stop_gradient(sharding.constrain(hidden.astype(c.compute_dtype),
                                                    ("batch", "length", "embed")))
    out = {"hidden": h0, "mask": shifted_valid(segment_ids, 1)}
    if logits:
      out["logits"] = self._logits(shared, h0)
    else:
      out.update(normed=self._final_norm(shared, h0), head=shared["head"])
    if k_steps == 0:
      return out

    mtp_shared = self._shared(stop_gradient=stop)
    h_prev = jax.lax.stop_gradient(h0) if stop else h0
    mtp_hidden, mtp_out = self._mtp_chain(mtp_shared, h_prev, tokens, positions, attn_mask,
                                          sincos, k_steps, logits=logits)
    mtp_mask = jnp.stack([shifted_valid(segment_ids, depth + 1)
                          for depth in range(1, k_steps + 1)])
    out.update(mtp_hidden=mtp_hidden, mtp_mask=mtp_mask)
    if logits:
      out["mtp_logits"] = mtp_out
    else:
      out.update(mtp_normed=mtp_out, mtp_head=mtp_shared["head"])
    return out

  # ---------------------------------------------------------------- decoding

  def init_cache(self, batch_size: int, cache_length: int) -> Cache:
    """Zeroed caches for `batch_size` rows of up to `cache_length` positions."""
    c = self.config
    zeros = lambda n: tuple(
        jnp.zeros((batch_size, c.num_kv_heads, cache_length, c.head_dim), c.compute_dtype)
        for _ in range(n))
    return Cache(main=KVCache(k=zeros(c.num_layers), v=zeros(c.num_layers)),
                 mtp=KVCache(k=zeros(c.num_draft_steps), v=zeros(c.num_draft_steps)))

  def step(self, cache: Cache, tokens: jax.Array, start: jax.Array, *,
           attend_len: int | None = None, weights: dict[str, Any] | None = None
           ) -> tuple[jax.Array, jax.Array, Cache]:
    """Main model on a chunk of C tokens per row at positions start[b] + 0..C-1.

    Writes the main cache at those positions; entries past a row's committed frontier are
    overwritten before anything attends to them (DESIGN.md 4).
    Args:
      tokens: [B, C] int. start: [B] int, first position of each row's chunk.
      attend_len: static bound on every position of the chunk + 1 (the prefill's P): the
        queries attend over the first attend_len cache positions only.
      weights: `decode_weights()`, computed once outside a decoding loop (default: here).
    Returns:
      (logits [B, C, V] f32, hidden h0 [B, C, E], cache).
    """
    _check_fits(tokens.shape[1], cache.length, "chunk")
    w = self.decode_weights() if weights is None else weights
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    shared = w["shared"]
    h0, main = self._main_blocks_cached(w, self._embed(shared["embed"], tokens), positions,
                                        cache.main, attend_len)
    return self._logits(shared, h0), h0, cache.replace(main=main)

  def mtp_step(self, cache: Cache, depth: int, h_prev: jax.Array, tokens: jax.Array,
               start: jax.Array, logits_at: jax.Array | None = None, *,
               attend_len: int | None = None, weights: dict[str, Any] | None = None,
               draft_head: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Cache]:
    """MTP depth `depth` (1..K, static) over a window of W positions start[b] + 0..W-1.

    Args:
      h_prev: [B, W, E] hidden states of depth-1 (h0 for depth 1) at the window positions.
      tokens: [B, W] the tokens x_{j+depth} for the window positions j.
      logits_at: optional [B] window index: the logits are needed there only (decoding
        drafts at the frontier), so the head runs on one position per row.
      attend_len, weights: as in `step`.
      draft_head: optional [E, V_d], the shared head's columns of a reduced draft
        vocabulary: the logits are over those V_d tokens (in its order).
    Returns:
      (draft logits [B, W, V] f32, or [B, V] at `logits_at` (V_d with `draft_head`);
      hidden h^depth [B, W, E];
      cache with the depth's entries at the window positions rewritten).
    """
    c = self.config
    if not 1 <= depth <= c.num_draft_steps:
      raise ValueError(f"depth={depth} is not allowed: must be in [1, {c.num_draft_steps}]")
    _check_fits(tokens.shape[1], cache.length, "MTP window")
    w = self.decode_weights() if weights is None else weights
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    p = w["mtp"][c.mtp_module_index(depth)]
    shared = w["shared"]
    u = self._mtp_input(p, h_prev, self._embed(shared["embed"], tokens))
    i = depth - 1
    h, (k, v) = layers.block(p, u, positions, kv_cache=(cache.mtp.k[i], cache.mtp.v[i]),
                             kv_len=attend_len, rope_sincos=self._rope(positions),
                             **self._block_kwargs())
    replace = lambda buffers, new: buffers[:i] + (new,) + buffers[i + 1:]
    mtp = KVCache(k=replace(cache.mtp.k, k), v=replace(cache.mtp.v, v))
    if logits_at is not None:
      at = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)
      return self._logits(shared, at, draft_head)[:, 0], h, cache.replace(mtp=mtp)
    return self._logits(shared, h, draft_head), h, cache.replace(mtp=mtp)

  def prefill(self, cache: Cache, tokens: jax.Array, *, mtp: bool = True,
              weights: dict[str, Any] | None = None) -> tuple[jax.Array, jax.Array, Cache]:
    """Prefills right-padded prompts [B, P] at positions 0..P-1: main cache and every depth.

    Depth k at position j needs x_{j+k}; past a row's prompt that token is not known yet, so
    those entries hold padding until the first MTP window rewrites them (DESIGN.md 4).
    With mtp=False only the main cache is filled (plain autoregressive decoding). `weights`
    as in `step`.
    Returns (logits [B, P, V] f32, hidden h0 [B, P, E], cache).
    """
    _check_fits(tokens.shape[1], cache.length, "prompt")
    b = tokens.shape[0]
    start = jnp.zeros((b,), jnp.int32)
    # Every prompt position is < P: attend over the first P cache entries only.
    p = tokens.shape[1]
    w = self.decode_weights() if weights is None else weights
    logits, h0, cache = self.step(cache, tokens, start, attend_len=p, weights=w)
    h_prev = h0
    for depth in range(1, self.config.num_draft_steps + 1 if mtp else 1):
      _, h_prev, cache = self.mtp_step(cache, depth, h_prev, shift_left(tokens, depth), start,
                                       attend_len=p, weights=w)
    return logits, h0, cache


def _uint_like(x: jax.Array) -> jnp.dtype:
  """The unsigned integer dtype of x's width (bitcast_convert_type keeps the shape)."""
  return jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}")


def _check_fits(length: int, cache_length: int, what: str):
  if length > cache_length:
    raise ValueError(f"a {what} of {length} tokens does not fit the cache of "
                     f"{cache_length} positions; use a longer cache_length")


def shift_left(tokens: jax.Array, k: int, fill: int = 0) -> jax.Array:
  """tokens[:, i + k] at i (fill past the end)."""
  if k == 0:
    return tokens
  pad = jnp.full(tokens.shape[:-1] + (k,), fill, tokens.dtype)
  return jnp.concatenate([tokens[..., k:], pad], axis=-1)[..., :tokens.shape[-1]]


def shifted_valid(segment_ids: jax.Array, k: int) -> jax.Array:
  """[B, T] bool: position i+k exists and is in i's (non-padding) segment."""
  shifted = shift_left(segment_ids, k, fill=0)
  return (segment_ids > 0) & (shifted == segment_ids)


def cache_shardings(cache: Cache, mesh, rules) -> Cache:
  """NamedShardings of a Cache (batch and kv heads sharded per the rules)."""
  spec = lambda x: jax.sharding.NamedSharding(
      mesh, sharding.logical_to_spec(CACHE_AXES, rules, mesh, x.shape))
  return jax.tree.map(spec, cache)


def init(config: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of a freshly initialised Policy."""
  return nnx.split(Policy(config, rngs=nnx.Rngs(seed)))


def abstract_state(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state of ShapeDtypeStructs): nothing is materialised."""
  model = nnx.eval_shape(lambda: Policy(config, rngs=nnx.Rngs(0)))
  return nnx.split(model)


def num_params(state: nnx.State) -> int:
  """Number of parameters in an nnx state."""
  return sum(int(x.size) for x in jax.tree.leaves(state.filter(nnx.Param)))
