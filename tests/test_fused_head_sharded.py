"""The fused head on a mesh (pallas_kernels/fused_head/sharded.py) against the unsharded dense
reference, on a data 2 x tensor 4 mesh of 8 simulated CPU devices (tests/conftest.py): every
implementation (the Pallas kernels in interpret mode) with rows and the vocabulary split, and
the other layouts with xla_blockwise.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bebop_jax import sharding
from pallas_kernels.fused_head import api
from pallas_kernels.fused_head import sharded as sharded_lib

MESH = ((2, 4), ("data", "tensor"))
K, B, T, D, V = 2, 2, 4, 16, 37  # V = 37 is padded to 40 over 4 vocabulary shards
MASKED = [3] + list(range(10, 20)) + [36]  # columns [10, 20): all of shard 1's real columns
OUTPUTS = ("tv", "kl", "ce", "entropy", "max_logprob")


def _arrays(target: str, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  bias = np.zeros(V, np.float32)
  bias[MASKED] = -np.inf
  allowed = np.setdiff1d(np.arange(V), MASKED)
  arrays = dict(draft=rng.normal(size=(K, B, T, D)).astype(np.float32),
                head=(0.8 * rng.normal(size=(D, V))).astype(np.float32),
                tokens=rng.choice(allowed, (K, B, T)), bias=bias)
  if target == "hidden":
    arrays["target_hidden"] = rng.normal(size=(B, T, D)).astype(np.float32)
  else:
    logits = 3 * rng.normal(size=(B, T, V)).astype(np.float32)
    logits[..., MASKED] = -np.inf
    logits[rng.random((B, T, V)) < 0.3] = -np.inf
    logits[..., 25] = 1.0
    arrays["target_logits"] = logits
  return arrays


def _value_and_grads(arrays, *, implementation, mesh=None, spec=None, argnums=(0, 1)):
  """({output: [K, B, T]}, (d draft, d head)) of a weighted sum of every output (the
  gradients of `argnums` only)."""
  weights = {name: jnp.asarray(np.random.default_rng(i).normal(size=(K, B, T)), jnp.float32)
             for i, name in enumerate(OUTPUTS)}
  rest = {k: v for k, v in arrays.items() if k not in ("draft", "head")}
  chunk = 16 if implementation == "pallas_gpu" else 8

  def loss(draft, head):
    out = api.fused_head(draft, head, implementation=implementation, chunk_size=chunk,
                         interpret=True, mesh=mesh, spec=spec, **rest)
    return sum(jnp.sum(weights[n] * out[n]) for n in OUTPUTS), out

  draft, head = arrays["draft"], arrays["head"]
  if mesh is not None:
    draft = jax.device_put(draft, NamedSharding(mesh, P(*spec[:-1], None)))
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(draft,
                                                                                      head)
  return jax.device_get(out), jax.device_get(grads)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh(*MESH)


@pytest.fixture(scope="module")
def reference():
  return {target: _value_and_grads(_arrays(target), implementation="reference")
          for target in ("hidden", "logits")}


def _check(got, want):
  (out, grads), (want_out, want_grads) = got, want
  for name in OUTPUTS:
    assert np.all(np.isfinite(out[name])), name
    np.testing.assert_allclose(out[name], want_out[name], rtol=1e-5,
                               atol=1e-5 * np.abs(want_out[name]).max(), err_msg=name)
  for which, g, w in zip(("draft", "head"), grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=which)


@pytest.mark.parametrize("implementation", api.IMPLEMENTATIONS)
@pytest.mark.parametrize("target", ["hidden", "logits"])
def test_rows_x_vocab_matches_unsharded_reference(implementation, target, mesh, reference):
  """Rows over data, the vocabulary over tensor: a ragged vocabulary (37 padded to 40),
  one shard with no unmasked column, token ids shifted to each shard's columns."""
  got = _value_and_grads(_arrays(target), implementation=implementation, mesh=mesh,
                         spec=P(None, "data", None, "tensor"))
  _check(got, reference[target])


@pytest.mark.parametrize("spec", [
    P(None, "data", "tensor", None),  # rows only: the head gradient sums over 8 row shards
    P(None, None, None, ("data", "tensor")),  # the vocabulary over all 8 devices
    P("data", None, None, "tensor"),  # the depth axis split: each depth's target replicated
], ids=["rows", "vocab_8", "depths_x_vocab"])
def test_other_layouts_match_unsharded_reference(spec, mesh, reference):
  got = _value_and_grads(_arrays("hidden"), implementation="xla_blockwise", mesh=mesh,
                         spec=spec)
  _check(got, reference["hidden"])


@pytest.mark.parametrize("implementation", api.IMPLEMENTATIONS[1:])
def test_frozen_head_gets_no_gradient_pass(implementation, mesh, reference):
  """Differentiating the draft hidden states only (a frozen head): the backward skips the
  head gradient (its kernel / atomics) and still matches."""
  out, grad = _value_and_grads(_arrays("hidden"), implementation=implementation, mesh=mesh,
                               spec=P(None, "data", None, "tensor"), argnums=0)
  want_out, (want_grad, _) = reference["hidden"]
  _check((out, (grad,)), (want_out, (want_grad,)))


def test_vocab_split_never_gathers(mesh):
  """Each device keeps its head columns and rows (a vocabulary the shards divide, arrays
  placed by the spec): no all-gather in the partitioned program; only per-row statistics
  and gradients are reduced."""
  spec = P(None, "data", None, "tensor")
  vocab = 40
  shardings = dict(draft=NamedSharding(mesh, P(*spec[:-1], None)),
                   head=NamedSharding(mesh, P(None, "tensor")),
                   target=NamedSharding(mesh, P("data", None, None)),
                   tokens=NamedSharding(mesh, P(*spec[:-1])))
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[name]) for name, shape, dtype in (
      ("draft", (K, B, T, D), jnp.float32), ("head", (D, vocab), jnp.float32),
      ("target", (B, T, D), jnp.float32), ("tokens", (K, B, T), jnp.int32))]

  def loss(draft, head, target, tokens):
    out = api.fused_head(draft, head, target_hidden=target, tokens=tokens,
                         implementation="xla_blockwise", mesh=mesh, spec=spec)
    return jnp.sum(out["tv"]) + jnp.sum(out["ce"])

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1)),
                out_shardings=(shardings["draft"], shardings["head"])).lower(*args).compile(
                ).as_text()
  assert "all-gather" not in hlo
  assert "all-reduce" in hlo


def test_spec_errors_name_what_is_wrong(mesh):
  arrays = _arrays("hidden")
  draft, head = arrays["draft"], arrays["head"]
  with pytest.raises(ValueError, match="has 2 entries; the logits"):
    api.fused_head(draft, head, mesh=mesh, spec=P(None, "tensor"))
  with pytest.raises(ValueError, match="names mesh axis 'model'"):
    api.fused_head(draft, head, mesh=mesh, spec=P(None, None, None, "model"))
  with pytest.raises(ValueError, match="uses a mesh axis twice"):
    api.fused_head(draft, head, mesh=mesh, spec=P("tensor", None, None, "tensor"))
  with pytest.raises(ValueError, match="splits dimension 1 of size 2 8 ways"):
    api.fused_head(draft, head, mesh=mesh, spec=P(None, ("data", "tensor"), None, None))
  with pytest.raises(ValueError, match="needs both mesh and spec"):
    api.fused_head(draft, head, mesh=mesh)


def test_local_shapes_pad_the_vocabulary():
  mesh = sharding.make_mesh(*MESH)
  assert sharded_lib.local_shapes(mesh, P(None, "data", None, "tensor"), (K, B, T), 2,
                                  V) == (K, B * T // 2, 10)
  assert sharded_lib.local_shapes(mesh, P("data", None, None, "tensor"), (K, B, T), None,
                                  V) == (1, B * T, 10)


def test_a_kernel_that_fails_to_compile_falls_back_on_a_mesh(monkeypatch, caplog, mesh):
  """The default checks the kernel at the device's block shape: pallas_tpu without interpret
  cannot lower on CPU, so the mesh runs xla_blockwise."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  monkeypatch.setattr(api, "_warned_fallbacks", set())
  used = []
  real = sharded_lib.fused_head
  monkeypatch.setattr(sharded_lib, "fused_head",
                      lambda name, *a, **kw: used.append(name) or real(name, *a, **kw))
  arrays = _arrays("hidden")
  rest = {k: v for k, v in arrays.items() if k not in ("draft", "head")}
  with caplog.at_level(logging.WARNING):
    out = api.fused_head(arrays["draft"], arrays["head"], mesh=mesh,
                         spec=P(None, "data", None, "tensor"), **rest)
  assert used == ["xla_blockwise"]
  want = api.fused_head(arrays["draft"], arrays["head"], implementation="reference", **rest)
  np.testing.assert_allclose(out["tv"], want["tv"], rtol=1e-5, atol=1e-6)
  warnings = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
  assert len(warnings) == 1 and "pallas_tpu" in warnings[0]
