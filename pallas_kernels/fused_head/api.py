"""Dispatch for the fused LM head: pick an implementation, fall back to XLA if a kernel fails.

    out = fused_head(draft_hidden, head, target_hidden=target_hidden, tokens=tokens)
    out["tv"], out["kl"], out["ce"], out["logprob"], out["entropy"]      # [...] float32
    out["max_logprob"]                        # max_v log q_v: accuracy = logprob >= it
    ce = cross_entropy(hidden, head, tokens)                            # SFT
    logprob, entropy = token_logprob_and_entropy(hidden, head, tokens)  # RL learner

Nothing of shape [..., V] is materialized: every implementation but `reference` streams the
head's vocabulary in chunks (README.md). All return the same values and gradients; the
target is a constant (stop-gradient), gradients reach the draft hidden states and the head.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from pallas_kernels import layout
from pallas_kernels.fused_head import sharded
from pallas_kernels.fused_head.common import HeadInputs

IMPLEMENTATIONS = layout.IMPLEMENTATIONS
FALLBACK = layout.FALLBACK
_BACKEND_DEFAULT = layout.BACKEND_DEFAULT
_warned_fallbacks: set[str] = set()


def _implementation_fn(name: str):
  """The module-level `fused_head` of `pallas_kernels.fused_head.<name>` (imported lazily)."""
  return importlib.import_module(f"pallas_kernels.fused_head.{name}").fused_head


def _abstract(shape, dtype):
  return None if shape is None else jax.ShapeDtypeStruct(shape, dtype)


@functools.lru_cache(maxsize=None)
def _compile_error(name: str, signature: tuple, chunk_size: int | None) -> str | None:
  """Lowers and compiles value and gradient (draft and head) of every output of `name` on
  HeadInputs of `signature` ((shape, dtype) or None per field); the error text or None."""
  fn = _implementation_fn(name)

  def loss(draft, head, *rest):
    out = fn(HeadInputs(draft, head, *rest), chunk_size=chunk_size)
    return sum(jnp.sum(v) for v in out.values())

  try:
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        *(None if s is None else _abstract(*s) for s in signature)).compile()
  except Exception as e:  # pylint: disable=broad-except  # any lowering/compile failure
    return f"{type(e).__name__}: {e}"
  return None


def _pick_implementation(signature: tuple, chunk_size, interpret) -> str:
  name = _BACKEND_DEFAULT.get(jax.default_backend(), FALLBACK)
  if name == FALLBACK or interpret:
    return name
  error = _compile_error(name, signature, chunk_size)
  if error is None:
    return name
  if name not in _warned_fallbacks:
    _warned_fallbacks.add(name)
    logging.warning("fused_head: %s failed to lower/compile for %s (%s); falling back to %s.",
                    name, signature[:2], error.splitlines()[0][:500], FALLBACK)
  return FALLBACK


def _signature(x: HeadInputs) -> tuple:
  return tuple(None if a is None else (tuple(a.shape), jnp.dtype(a.dtype)) for a in x)


def _check(draft_hidden, head, target_hidden, target_logits, tokens, bias):
  if draft_hidden.ndim < 1 or head.ndim != 2 or draft_hidden.shape[-1] != head.shape[0]:
    raise ValueError(f"fused_head needs draft hidden states [..., d] and a head [d, V]; got "
                     f"{draft_hidden.shape} and {head.shape}.")
  if target_hidden is not None and target_logits is not None:
    raise ValueError("fused_head takes target_hidden or target_logits, not both.")
  lead, (d, vocab) = draft_hidden.shape[:-1], head.shape
  if target_hidden is not None and target_hidden.shape[-1:] != (d,):
    raise ValueError(f"target_hidden {target_hidden.shape} must be [..., {d}] like the head.")
  if target_logits is not None and target_logits.shape[-1:] != (vocab,):
    raise ValueError(f"target_logits {target_logits.shape} must be [..., {vocab}] (V of the "
                     "head).")
  target = target_hidden if target_hidden is not None else target_logits
  if target is not None:
    rows = target.shape[:-1]
    if len(rows) > len(lead) or tuple(lead[len(lead) - len(rows):]) != tuple(rows):
      raise ValueError(f"the target's leading dimensions {rows} must be the trailing "
                       f"leading dimensions of the draft hidden states {lead}.")
  if tokens is not None and tuple(tokens.shape) != tuple(lead):
    raise ValueError(f"tokens {tokens.shape} must have the draft's leading shape {lead}.")
  if bias is not None and tuple(bias.shape) != (vocab,):
    raise ValueError(f"bias {bias.shape} must be [V] = [{vocab}].")


def fused_head(draft_hidden: jax.Array, head: jax.Array, *,
               target_hidden: jax.Array | None = None, target_logits: jax.Array | None = None,
               tokens: jax.Array | None = None, bias: jax.Array | None = None,
               implementation: str | None = None, chunk_size: int | None = None,
               interpret: Any = False, mesh: jax.sharding.Mesh | None = None,
               spec: jax.sharding.PartitionSpec | None = None) -> dict[str, jax.Array]:
  """Per-row reductions over the vocabulary of q = softmax(draft_hidden @ head + bias).

  Args:
    draft_hidden: [..., d] hidden states after the final norm (float32 or bfloat16); e.g.
      [K, B, T, d] for K MTP depths.
    head: [d, V] output head W (float32 or bfloat16); differentiable.
    target_hidden: [*R, d] hidden states of the target p = softmax(target_hidden @ head +
      bias), where R is a suffix of the draft's leading shape (e.g. [B, T, d] for a [K, B, T,
      d] draft: every depth is compared with the same target row). A constant.
    target_logits: [*R, V] logits of p, given instead of target_hidden (bias not added).
    tokens: [...] int token ids in [0, V) (the draft's leading shape) for logprob / ce.
    bias: [V] added to every logit made from the head; -inf masks a column (probability 0).
      A constant. Each row needs a finite logit.
    implementation: one of IMPLEMENTATIONS, or None for the backend's best (tpu: pallas_tpu,
      gpu: pallas_gpu, cpu: xla_blockwise); a kernel that fails to lower or compile at this
      shape falls back to xla_blockwise with a warning logged once.
    chunk_size: vocabulary columns per chunk (None: the implementation's default).
    interpret: passed to every `pallas_call` (True, or a Pallas InterpretParams).
    mesh, spec: run on `mesh` with the arrays laid out by `spec`, the PartitionSpec of the
      [..., V] logits (`sharded`); None: one program over the whole arrays.

  Returns:
    A dict of [...] float32 arrays (the draft's leading shape): "entropy" H(q) and
    "max_logprob" = max_v log q_v always; "logprob" = log q[token] and "ce" = -logprob with
    tokens; "tv" = 1/2 sum |p - q| and "kl" = KL(p || q) with a target. Gradients flow to
    draft_hidden and head (custom VJP; the head's gradient is skipped when the head is not
    differentiated, and an output without a cotangent adds nothing to the backward), except
    from max_logprob, a constant (stop-gradient). `logprob >= max_logprob` says the token is
    a mode of q (an argmax; at a tie, any of the tied tokens): both subtract the same
    log-sum-exp from the same float32 logit, so the comparison is exact.

  To compare depth k at row i with target row i + k + 1 (MTP), shift the draft hidden states
  (and tokens) of depth k right by k + 1 rows instead of stacking shifted targets: the
  target's logits are then computed once per chunk for all depths.
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown fused_head implementation {implementation!r}; "
                     f"expected one of {IMPLEMENTATIONS} or None.")
  if chunk_size is not None and chunk_size < 1:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
  if (mesh is None) != (spec is None):
    raise ValueError("fused_head needs both mesh and spec to run sharded, or neither; got "
                     f"mesh={mesh}, spec={spec}.")
  _check(draft_hidden, head, target_hidden, target_logits, tokens, bias)
  if bias is not None:
    bias = bias.astype(jnp.float32)
  if tokens is not None:
    tokens = tokens.astype(jnp.int32)
  lead = draft_hidden.shape[:-1]
  target = target_hidden if target_hidden is not None else target_logits
  if mesh is not None:
    sharded.check_spec(mesh, spec, tuple(lead) + (head.shape[1],))
    if implementation is None:
      k, rows, vocab = sharded.local_shapes(mesh, spec, lead,
                                            None if target is None else target.ndim - 1,
                                            head.shape[1])
      local = _flat_inputs(
          jax.ShapeDtypeStruct((k, rows, head.shape[0]), draft_hidden.dtype),
          jax.ShapeDtypeStruct((head.shape[0], vocab), head.dtype), bias, tokens,
          target_hidden, target_logits, k, rows, vocab)
      implementation = _pick_implementation(_signature(local), chunk_size, interpret)
    outputs = sharded.fused_head(implementation, draft_hidden, head, bias=bias, tokens=tokens,
                                 target_hidden=target_hidden, target_logits=target_logits,
                                 mesh=mesh, spec=spec, chunk_size=chunk_size,
                                 interpret=interpret)
  else:
    rows = math.prod(target.shape[:-1]) if target is not None else math.prod(lead)
    k = math.prod(lead) // rows if rows else 1
    x = HeadInputs(
        draft_hidden.reshape(k, rows, draft_hidden.shape[-1]), head, bias,
        None if tokens is None else tokens.reshape(k, rows),
        None if target_hidden is None else target_hidden.reshape(rows, -1),
        None if target_logits is None else target_logits.reshape(rows, -1))
    if implementation is None:
      implementation = _pick_implementation(_signature(x), chunk_size, interpret)
    outputs = _implementation_fn(implementation)(x, chunk_size=chunk_size, interpret=interpret)
    outputs = {name: value.reshape(lead) for name, value in outputs.items()}
  if "logprob" in outputs:
    outputs["ce"] = -outputs["logprob"]
  outputs["max_logprob"] = jax.lax.stop_gradient(outputs["max_logprob"])
  return outputs


def _flat_inputs(draft, head, bias, tokens, target_hidden, target_logits, k, rows, vocab):
  """Abstract local HeadInputs of a device's block (for the compile check)."""
  spec = lambda shape, a: None if a is None else jax.ShapeDtypeStruct(shape, a.dtype)
  return HeadInputs(draft, head, spec((vocab,), bias), spec((k, rows), tokens),
                    spec((rows, head.shape[0]), target_hidden),
                    spec((rows, vocab), target_logits))


def cross_entropy(hidden: jax.Array, head: jax.Array, tokens: jax.Array,
                  **kwargs) -> jax.Array:
  """-log softmax(hidden @ head)[tokens], [...] float32; kwargs as `fused_head`."""
  return fused_head(hidden, head, tokens=tokens, **kwargs)["ce"]


def token_logprob_and_entropy(hidden: jax.Array, head: jax.Array, tokens: jax.Array,
                              **kwargs) -> tuple[jax.Array, jax.Array]:
  """(log q[tokens], H(q)) of q = softmax(hidden @ head), each [...] float32."""
  out = fused_head(hidden, head, tokens=tokens, **kwargs)
  return out["logprob"], out["entropy"]


def _needs_target(name: str, kwargs) -> None:
  if kwargs.get("target_hidden") is None and kwargs.get("target_logits") is None:
    raise ValueError(f"{name} compares with a target: pass target_hidden= or target_logits=.")


def tv_distance(draft_hidden: jax.Array, head: jax.Array, **kwargs) -> jax.Array:
  """1/2 sum_v |p - q| per row; pass target_hidden= or target_logits= (see `fused_head`)."""
  _needs_target("tv_distance", kwargs)
  return fused_head(draft_hidden, head, **kwargs)["tv"]


def kl_divergence(draft_hidden: jax.Array, head: jax.Array, **kwargs) -> jax.Array:
  """KL(p || q) per row, p the (constant) target; kwargs as `fused_head`."""
  _needs_target("kl_divergence", kwargs)
  return fused_head(draft_hidden, head, **kwargs)["kl"]
