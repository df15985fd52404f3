"""Fused LM head: every implementation against the dense reference, values and gradients.

Tiny shapes (K = 2 depths, N = 12 rows, d = 16, V = 37 with chunks of 8, or 16 for Triton
blocks): V is not a multiple of the chunk, the bias masks single columns, a whole chunk and
the tail with -inf, and the Pallas kernels run with interpret=True (pallas_tpu with row blocks
of 8, so the rows are ragged too). Each output's gradient is checked on its own (one cotangent
at a time, the others symbolic zeros) with respect to the draft hidden states and the head.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fused_head import api, pallas_tpu, xla_blockwise

K, N, D, V = 2, 12, 16, 37
MASKED = [3] + list(range(8, 16)) + [36]  # one column, a whole chunk of 8, the tail column
OUTPUTS = ("tv", "kl", "ce", "logprob", "entropy")


def _chunk_for(implementation: str) -> int:
  return 16 if implementation == "pallas_gpu" else 8  # Triton blocks: powers of 2 >= 16


def _case_arrays(name: str, seed: int = 0) -> dict:
  """Keyword arguments of `api.fused_head` (besides the draft and head) for a case."""
  rng = np.random.default_rng(seed)
  bias = np.zeros(V, np.float32)
  bias[MASKED] = -np.inf
  allowed = np.setdiff1d(np.arange(V), MASKED)
  if name == "target_hidden":  # [K, N, d] drafts against [N, d] targets, masked columns
    return dict(target_hidden=jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
                tokens=jnp.asarray(rng.choice(allowed, (K, N))), bias=jnp.asarray(bias))
  if name == "target_logits":  # given target logits with -inf entries of their own
    logits = 3 * rng.normal(size=(N, V)).astype(np.float32)
    logits[:, MASKED] = -np.inf  # p = 0 wherever q = 0 (else KL is infinite)
    logits[rng.random((N, V)) < 0.3] = -np.inf  # p = 0 where q > 0
    logits[:, 20] = 1.0  # each row keeps a finite logit
    return dict(target_logits=jnp.asarray(logits), tokens=jnp.asarray(rng.choice(allowed, (K, N))),
                bias=jnp.asarray(bias))
  assert name == "no_target"  # [N, d] hidden states: log-probs and entropy (the RL learner)
  return dict(tokens=jnp.asarray(rng.integers(0, V, (K * N,))))


CASES = ("target_hidden", "target_logits", "no_target")


def _draft_and_head(name: str, seed: int = 1):
  rng = np.random.default_rng(seed)
  shape = (K * N, D) if name == "no_target" else (K, N, D)
  return (jnp.asarray(rng.normal(size=shape), jnp.float32),
          jnp.asarray(0.8 * rng.normal(size=(D, V)), jnp.float32))


def _outputs_and_grads(implementation: str, case: str) -> dict:
  """{output: value} and {output: (d draft, d head)} of <w, output> for a fixed random w."""
  kwargs = _case_arrays(case)
  draft, head = _draft_and_head(case)
  weights = jnp.asarray(np.random.default_rng(2).normal(size=draft.shape[:-1]), jnp.float32)

  def outputs(d, w):
    return api.fused_head(d, w, implementation=implementation,
                          chunk_size=_chunk_for(implementation), interpret=True, **kwargs)

  @jax.jit
  def run(d, w):
    values = outputs(d, w)
    grads = {name: jax.grad(lambda d, w: jnp.sum(weights * outputs(d, w)[name]),
                            argnums=(0, 1))(d, w) for name in values}
    return values, grads

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(pallas_tpu, "DEFAULT_BLOCK_ROWS", 8)  # ragged row blocks: 12 = 8 + 4
    return jax.device_get(run(draft, head))


@pytest.fixture(scope="module")
def reference_results():
  return {case: _outputs_and_grads("reference", case) for case in CASES}


@pytest.mark.parametrize("implementation", api.IMPLEMENTATIONS[1:])
@pytest.mark.parametrize("case", CASES)
def test_float32_matches_reference(implementation, case, reference_results):
  want_values, want_grads = reference_results[case]
  values, grads = _outputs_and_grads(implementation, case)
  expected = {"entropy", "max_logprob", "logprob", "ce"} | (
      {"tv", "kl"} if case != "no_target" else set())
  assert set(values) == set(want_values) == expected
  for name in expected:
    value, want = values[name], want_values[name]
    assert value.dtype == np.float32 and np.all(np.isfinite(value)), name
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                               err_msg=name)
    for which, got, ref in zip(("draft", "head"), grads[name], want_grads[name]):
      assert np.all(np.isfinite(got)), (name, which)
      np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                                 err_msg=f"d {name} / d {which}")
  if case != "no_target":
    assert np.all((values["tv"] >= 0) & (values["tv"] <= 1))
    for name in OUTPUTS:  # masked columns have probability 0: no gradient reaches them
      assert np.all(grads[name][1][:, MASKED] == 0.0), name


def test_reference_matches_a_float64_numpy_truth():
  """The dense reference itself, at float64 in numpy (softmaxes written out by hand)."""
  kwargs = _case_arrays("target_hidden")
  draft, head = _draft_and_head("target_hidden")
  out = api.fused_head(draft, head, implementation="reference", **kwargs)
  bias = np.asarray(kwargs["bias"], np.float64)
  log_softmax = lambda z: z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1,
                                            keepdims=True)) - z.max(-1, keepdims=True)
  log_q = log_softmax(np.asarray(draft, np.float64) @ np.asarray(head, np.float64) + bias)
  log_p = log_softmax(np.asarray(kwargs["target_hidden"], np.float64) @ np.asarray(
      head, np.float64) + bias)
  q, p = np.exp(log_q), np.exp(log_p)
  with np.errstate(invalid="ignore"):
    want = dict(tv=0.5 * np.abs(p - q).sum(-1),
                kl=np.where(p > 0, p * (log_p - log_q), 0.0).sum(-1),
                entropy=-np.where(q > 0, q * log_q, 0.0).sum(-1), max_logprob=log_q.max(-1),
                ce=-np.take_along_axis(log_q, np.asarray(kwargs["tokens"])[..., None], -1)[..., 0])
  for name, value in want.items():
    np.testing.assert_allclose(out[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("implementation", api.IMPLEMENTATIONS)
def test_logprob_at_least_max_logprob_is_exactly_argmax(implementation):
  """Accuracy without logits: a row's token is the argmax of its logits exactly when
  logprob >= max_logprob (half the rows hold their argmax, half their runner-up), with -inf
  columns, a ragged last chunk and a mode in a later chunk than the first."""
  kwargs = _case_arrays("target_hidden")
  draft, head = _draft_and_head("target_hidden")
  logits = np.asarray(jnp.einsum("knd,dv->knv", draft, head)) + np.asarray(kwargs["bias"])
  order = np.argsort(-logits, axis=-1)
  pick = np.arange(N) % 2  # 0: the argmax, 1: the runner-up
  kwargs["tokens"] = jnp.asarray(np.take_along_axis(order, np.broadcast_to(
      pick[None, :, None], (K, N, 1)), -1)[..., 0])
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(pallas_tpu, "DEFAULT_BLOCK_ROWS", 8)
    out = api.fused_head(draft, head, implementation=implementation,
                         chunk_size=_chunk_for(implementation), interpret=True, **kwargs)
  np.testing.assert_array_equal(np.asarray(out["logprob"] >= out["max_logprob"]),
                                np.broadcast_to(pick == 0, (K, N)))
  np.testing.assert_allclose(out["max_logprob"], np.max(jax.nn.log_softmax(logits), -1),
                             rtol=1e-5, atol=1e-6)


def test_bfloat16_blockwise_matches_reference_loosely():
  kwargs = _case_arrays("target_hidden")
  draft, head = (a.astype(jnp.bfloat16) for a in _draft_and_head("target_hidden"))
  kwargs["target_hidden"] = kwargs["target_hidden"].astype(jnp.bfloat16)

  def loss(implementation):
    def fn(d, w):
      out = api.fused_head(d, w, implementation=implementation, chunk_size=8, **kwargs)
      return jnp.mean(out["tv"]) + jnp.mean(out["ce"]) + jnp.mean(out["kl"]), out
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(draft, head)

  (_, want), want_grads = loss("reference")
  (_, got), grads = loss("xla_blockwise")
  for name in ("tv", "kl", "ce", "entropy"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
  for g, w in zip(grads, want_grads):
    assert g.dtype == jnp.bfloat16
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=1e-2 * np.abs(w).max())


def test_target_is_a_constant():
  kwargs = _case_arrays("target_hidden")
  target = kwargs.pop("target_hidden")
  draft, head = _draft_and_head("target_hidden")

  def loss(t, target_logits):
    out = api.fused_head(draft, head, target_hidden=t, chunk_size=8, **kwargs)
    out2 = api.fused_head(draft, head, target_logits=target_logits, chunk_size=8, **kwargs)
    return sum(jnp.sum(o["tv"] + o["kl"]) for o in (out, out2))

  grads = jax.grad(loss, argnums=(0, 1))(target, jnp.zeros((N, V)))
  assert all(np.all(np.asarray(g) == 0.0) for g in grads)


def test_backward_skips_what_has_no_cotangent(monkeypatch):
  """The head gradient only when the head is differentiated; the target only for TV / KL."""
  calls = []
  real = xla_blockwise.grad_pass
  monkeypatch.setattr(xla_blockwise, "grad_pass", lambda x, res, cot, **kw: calls.append(
      (kw["head_grad"], tuple(c is not None for c in cot))) or real(x, res, cot, **kw))
  kwargs = _case_arrays("target_hidden")
  draft, head = _draft_and_head("target_hidden")

  def loss(d, w, names):
    out = api.fused_head(d, w, implementation="xla_blockwise", chunk_size=8, **kwargs)
    metrics = sum(jnp.sum(jax.lax.stop_gradient(out[n])) for n in OUTPUTS)
    return sum(jnp.sum(out[n]) for n in names) + metrics

  jax.grad(loss)(draft, head, ("ce",))
  jax.grad(loss, argnums=(0, 1))(draft, head, ("tv", "entropy"))
  # Cotangents in Cotangents order: (tv, kl, logprob, entropy).
  assert calls == [(False, (False, False, True, False)), (True, (True, False, False, True))]


def test_default_on_cpu_is_xla_blockwise(monkeypatch):
  assert jax.default_backend() == "cpu"
  used = []
  original = api._implementation_fn  # pylint: disable=protected-access
  monkeypatch.setattr(api, "_implementation_fn", lambda name: used.append(name) or
                      original(name))
  draft, head = _draft_and_head("target_hidden")
  hidden = draft.reshape(2, K, N // 2, D)  # leading dims [2, K, 6] against a [K, 6] target
  target = _case_arrays("target_hidden")["target_hidden"].reshape(K, N // 2, D)
  out = api.fused_head(hidden, head, target_hidden=target, chunk_size=8)
  assert used == ["xla_blockwise"]
  assert out["tv"].shape == (2, K, N // 2) and "ce" not in out
  want = api.fused_head(hidden, head, target_hidden=target, implementation="reference")
  np.testing.assert_allclose(out["tv"], want["tv"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(api.tv_distance(hidden, head, target_hidden=target), want["tv"],
                             rtol=1e-5, atol=1e-6)


def test_wrappers():
  kwargs = _case_arrays("no_target")
  draft, head = _draft_and_head("no_target")
  tokens = kwargs["tokens"]
  logprob, entropy = api.token_logprob_and_entropy(draft, head, tokens, chunk_size=8)
  want = api.fused_head(draft, head, tokens=tokens, implementation="reference")
  np.testing.assert_allclose(logprob, want["logprob"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(entropy, want["entropy"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(api.cross_entropy(draft, head, tokens), -want["logprob"],
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="target_hidden= or target_logits="):
    api.kl_divergence(draft, head)


def test_kernel_that_fails_to_compile_falls_back_once(monkeypatch, caplog):
  """pallas_tpu without interpret cannot lower on CPU: None falls back, warning logged once."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  monkeypatch.setattr(api, "_warned_fallbacks", set())
  kwargs = _case_arrays("target_hidden")
  draft, head = _draft_and_head("target_hidden")
  with caplog.at_level(logging.WARNING):
    first = api.fused_head(draft, head, **kwargs)
    second = api.fused_head(draft * 2, head, **kwargs)
  want = api.fused_head(draft, head, implementation="reference", **kwargs)
  assert np.all(np.isfinite(second["tv"]))
  np.testing.assert_allclose(first["tv"], want["tv"], rtol=1e-5, atol=1e-6)
  warnings = [r for r in caplog.records if "falling back to xla_blockwise" in r.getMessage()]
  assert len(warnings) == 1 and "pallas_tpu" in warnings[0].getMessage()


def test_bad_arguments_raise():
  draft, head = _draft_and_head("target_hidden")
  target = jnp.zeros((N, D))
  with pytest.raises(ValueError, match="pallas_tpu.*pallas_gpu"):
    api.fused_head(draft, head, implementation="triton")
  with pytest.raises(ValueError, match="head \\[d, V\\]"):
    api.fused_head(draft, head.T)
  with pytest.raises(ValueError, match="not both"):
    api.fused_head(draft, head, target_hidden=target, target_logits=jnp.zeros((N, V)))
  with pytest.raises(ValueError, match="trailing leading dimensions"):
    api.fused_head(draft, head, target_hidden=jnp.zeros((K, D)))
  with pytest.raises(ValueError, match="tokens"):
    api.fused_head(draft, head, tokens=jnp.zeros((N,), jnp.int32))
  with pytest.raises(ValueError, match="bias"):
    api.fused_head(draft, head, bias=jnp.zeros((V + 1,)))


def _export(implementation: str, platform: str, head_dtype, **kwargs):
  """MLIR of value and gradient (draft and head) of every output, exported for `platform`."""

  def loss(d, w):
    out = api.fused_head(d, w, implementation=implementation, chunk_size=256, **kwargs)
    return sum(jnp.sum(v) for v in out.values())

  exported = jax.export.export(
      jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(jax.ShapeDtypeStruct((2, 200, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 1000),
                                                                            head_dtype))
  return exported.mlir_module()


@pytest.mark.parametrize("implementation,platform,kernel_call,calls", [
    ("pallas_tpu", "tpu", "tpu_custom_call", 4),  # pass 1, pass 2, d draft, d head
    ("pallas_gpu", "cuda", "__gpu$xla.gpu.triton", 3),  # pass 1, pass 2, backward
])
def test_pallas_kernels_lower_for_their_hardware(implementation, platform, kernel_call, calls):
  """Every pass lowers to Mosaic / Triton IR (compiling them needs the device): bf16 drafts
  against a f32 head and bf16 target hidden states with tokens and a bias, and f32 target
  logits without."""
  rng = np.random.default_rng(0)
  with_hidden = _export(implementation, platform, jnp.float32,
                        target_hidden=jnp.zeros((200, 128), jnp.bfloat16),
                        tokens=jnp.asarray(rng.integers(0, 1000, (2, 200))),
                        bias=jnp.zeros((1000,)))
  with_logits = _export(implementation, platform, jnp.bfloat16,
                        target_logits=jnp.zeros((200, 1000), jnp.float32))
  assert with_hidden.count(kernel_call) == calls
  assert with_logits.count(kernel_call) == calls


def test_blockwise_temp_memory_is_far_below_dense():
  """Compiled forward + backward (draft and head gradients) of mean TV + CE at N = 64,
  V = 32768, d = 64: the blockwise temp memory holds no [N, V] array."""
  n, d, vocab = 64, 64, 32768
  args = (jax.ShapeDtypeStruct((1, n, d), jnp.float32), jax.ShapeDtypeStruct((d, vocab),
                                                                             jnp.float32),
          jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((1, n), jnp.int32))

  def temp_bytes(implementation):
    def loss(h, w, hp, tokens):
      out = api.fused_head(h, w, target_hidden=hp, tokens=tokens,
                           implementation=implementation, chunk_size=2048)
      return jnp.mean(out["tv"]) + jnp.mean(out["ce"])
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  dense_f32 = n * vocab * 4
  reference_bytes = temp_bytes("reference")
  blockwise_bytes = temp_bytes("xla_blockwise")
  assert reference_bytes >= 2 * dense_f32  # at least the draft and target logits
  assert blockwise_bytes < dense_f32 / 2
  assert blockwise_bytes * 10 <= reference_bytes

