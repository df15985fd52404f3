"""Model hyper-parameters: a frozen dataclass built from `config.model`, and size presets."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ATTENTION = ("blockwise", "dense")
REMAT = ("projections", "none", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the Qwen3-style policy with its MTP modules.

  Attributes:
    vocab_size: output vocabulary (the tokenizer's padded size).
    d_model: residual width.
    num_layers: decoder blocks of the main model.
    num_heads: query heads; num_kv_heads divides it (grouped-query attention).
    num_kv_heads: key/value heads.
    head_dim: width of one head.
    mlp_dim: SwiGLU hidden width.
    rope_theta: RoPE base.
    qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3).
    tie_embeddings: output head = embedding transposed.
    num_mtp_modules: M, MTP modules (each a projection and one block).
    num_draft_steps: K >= M, depths of the MTP chain; depths beyond M reuse module M.
    mtp_stop_gradient: MTP losses do not reach embedding, backbone, final norm and head.
    norm_eps: RMSNorm epsilon.
    dtype: compute dtype ("float32" or "bfloat16").
    param_dtype: parameter dtype.
    decode_preslice_weights: decoding loops slice the stacked layer weights per block once,
      before the loop (Policy.decode_weights): fastest where a slice is a copy (CPU, GPU), at
      the price of a second copy of the weights. False slices inside every step instead: no
      extra memory, and on TPU the slice fuses into the matmul.
    attention: teacher-forced attention (training, scoring): "blockwise" (query blocks over
      their causal key prefix, custom backward, no [B, H, T, T] probabilities kept; see
      layers.blockwise_attention) or "dense" (the reference). Decoding always uses the cache.
    attention_block_size: queries per block of "blockwise" attention.
    remat: what the teacher-forced backward keeps of each block's forward (jax.checkpoint
      policies, model.REMAT_POLICIES): "projections" keeps the q/k/v, gate and up matmul
      outputs and the attention output, and recomputes the norms, RoPE, SwiGLU and output
      projections; "none" keeps every intermediate (no jax.checkpoint); "full" keeps only
      the block inputs.
  """
  vocab_size: int = 128
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 128
  rope_theta: float = 10_000.0
  qk_norm: bool = True
  tie_embeddings: bool = True
  num_mtp_modules: int = 1
  num_draft_steps: int = 3
  mtp_stop_gradient: bool = True
  norm_eps: float = 1e-6
  dtype: str = "float32"
  param_dtype: str = "float32"
  decode_preslice_weights: bool = True
  attention: str = "blockwise"
  attention_block_size: int = 32
  remat: str = "projections"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim", "num_mtp_modules", "num_draft_steps",
                 "attention_block_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name}={value!r} is not allowed: must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_kv_heads={self.num_kv_heads} is not allowed: must divide "
                       f"model.num_heads={self.num_heads}")
    if self.num_draft_steps < self.num_mtp_modules:
      raise ValueError(f"model.num_draft_steps={self.num_draft_steps} is not allowed: must be "
                       f">= model.num_mtp_modules={self.num_mtp_modules}")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} is not allowed: RoPE needs it even")
    for name, allowed in (("attention", ATTENTION), ("remat", REMAT)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is not allowed: one of "
                         f"{list(allowed)}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is not allowed: one of "
                         f"{sorted(DTYPES)}")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
      raise ValueError(f"unknown model keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**dict(values))

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  def mtp_module_index(self, depth: int) -> int:
    """0-based module used at 1-based `depth`: depths beyond M reuse module M."""
    return min(depth, self.num_mtp_modules) - 1


def block_param_count(c: ModelConfig) -> int:
  """Parameters of one transformer block (closed form)."""
  attn = c.d_model * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
  norms = 2 * c.d_model + (2 * c.head_dim if c.qk_norm else 0)
  mlp = 3 * c.d_model * c.mlp_dim
  return attn + norms + mlp


def param_count(c: ModelConfig) -> dict[str, int]:
  """Closed-form parameter counts: main model, MTP modules and total."""
  embed = c.vocab_size * c.d_model
  head = 0 if c.tie_embeddings else c.d_model * c.vocab_size
  main = embed + c.num_layers * block_param_count(c) + c.d_model + head
  mtp = c.num_mtp_modules * (2 * c.d_model * c.d_model + 2 * c.d_model + block_param_count(c))
  return {"main": main, "mtp": mtp, "total": main + mtp}


# Presets. "tiny" is for tests (seconds), "small" the CPU quickstart (~1M parameters),
# the pod-scale ones mirror Qwen3-1.7B / Qwen3-8B shapes with one MTP module (their decoding
# does not keep a second, pre-sliced copy of the weights).
PRESETS: dict[str, dict[str, Any]] = {
    # Attention blocks of 128 queries: the tests' sequences are one or two blocks, so their
    # train steps compile about as fast as on the dense path (each block is unrolled). The
    # CPU presets below use 32, the pod presets 512 (each sets it: configs start from tiny).
    "tiny": dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 mlp_dim=64, num_mtp_modules=2, num_draft_steps=3, attention_block_size=128),
    "small": dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                  mlp_dim=384, num_mtp_modules=1, num_draft_steps=3, attention_block_size=32),
    # Same parameter count as "small", twice the depth: a trunk much deeper than its one-block
    # drafter, as in real MTP models (Qwen3-8B: 36 layers, 1 MTP module). On CPU a decode
    # step costs about the same per block, so here one draft depth costs 1/8 of a target
    # forward instead of 1/4 (the quickstart's policy).
    "small_deep": dict(d_model=96, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=24,
                       mlp_dim=288, num_mtp_modules=1, num_draft_steps=3,
                       attention_block_size=32),
    # Qwen3-0.6B's shape with one MTP module: the accelerator benchmark's policy.
    "qwen3_0p6b": dict(vocab_size=151_936, d_model=1024, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0,
                       tie_embeddings=True, num_mtp_modules=1, num_draft_steps=3,
                       dtype="bfloat16", param_dtype="bfloat16", attention_block_size=512),
    "qwen3_1p7b": dict(vocab_size=151_936, d_model=2048, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, mlp_dim=6144, rope_theta=1_000_000.0,
                       tie_embeddings=True, num_mtp_modules=1, num_draft_steps=3,
                       dtype="bfloat16", param_dtype="bfloat16",
                       decode_preslice_weights=False, attention_block_size=512),
    "qwen3_8b": dict(vocab_size=151_936, d_model=4096, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, mlp_dim=12_288, rope_theta=1_000_000.0,
                     tie_embeddings=False, num_mtp_modules=1, num_draft_steps=3,
                     dtype="bfloat16", param_dtype="bfloat16", decode_preslice_weights=False,
                     attention_block_size=512),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
  """A preset's ModelConfig with `overrides` applied."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}")
  return ModelConfig(**{**PRESETS[name], **overrides})
