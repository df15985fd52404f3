"""TV-distance kernels: every implementation against the dense reference, values and gradients.

The Pallas kernels run with interpret=True on CPU, so their shapes are kept small.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tv_loss import api, reference, xla_blockwise

BLOCKWISE = ("xla_blockwise", "pallas_tpu", "pallas_gpu")
NEG_INF = -np.inf


def _block_for(implementation: str, block: int) -> int:
  """pallas_tpu blocks are multiples of 128 lanes (or the whole vocabulary)."""
  return max(block, 128) if implementation == "pallas_tpu" else block


def _tv_and_grads(implementation, draft, target, cotangent, block):
  """(tv [N], d<cotangent, tv>/d draft, d<cotangent, tv>/d target) as numpy."""
  fn = lambda d, t: api.tv_distance(d, t, implementation=implementation,
                                    block_size=_block_for(implementation, block),
                                    interpret=True)

  @jax.jit
  def run(d, t):
    tv, vjp = jax.vjp(fn, d, t)
    return (tv,) + vjp(cotangent)

  return tuple(np.asarray(x.astype(jnp.float32)) for x in run(draft, target))


def _random_logits(seed, shape, scale=3.0, dtype=jnp.float32):
  key_d, key_t = jax.random.split(jax.random.key(seed))
  return (scale * jax.random.normal(key_d, shape)).astype(dtype), (
      scale * jax.random.normal(key_t, shape)).astype(dtype)


def _special_rows(vocab: int = 300) -> tuple[np.ndarray, np.ndarray]:
  """[8, vocab] float32 rows that stress the edge cases, one case per row."""
  rng = np.random.default_rng(0)
  draft = rng.normal(size=(8, vocab)).astype(np.float32) * 3
  target = rng.normal(size=(8, vocab)).astype(np.float32) * 3
  draft[0] *= 1e4 / 3  # extreme scale: near one-hot, most probabilities underflow to 0
  target[0] *= 1e4 / 3
  draft[1], target[1] = 0.0, 0.0  # one-hot-like, different peaks
  draft[1, 5], target[1, 250] = 40.0, 40.0
  target[2] = draft[2]  # p == q
  draft[3, rng.random(vocab) < 0.3] = NEG_INF  # independently masked entries
  target[3, rng.random(vocab) < 0.3] = NEG_INF
  draft[4, rng.random(vocab) < 0.3] = NEG_INF  # p == q with a shared mask
  target[4] = draft[4]
  draft[5, :256] = NEG_INF  # two whole leading blocks masked in both
  target[5, :256] = NEG_INF
  draft[6], target[6] = 0.0, 0.0  # p == q, one-hot-like
  draft[6, 7] = target[6, 7] = 1e4
  draft[7, 256:] = NEG_INF  # the ragged tail block masked in both
  target[7, 256:] = NEG_INF
  return draft, target


CASES = {
    # name: (draft, target, block), f32 cases checked tightly.
    "ragged_vocab": (*_random_logits(0, (40, 1000)), 256),
    "one_row_tiny_vocab": (*_random_logits(1, (1, 37)), 16),
    "special_rows": (*map(jnp.asarray, _special_rows()), 128),
}
BF16_CASES = {
    "bf16": (*_random_logits(2, (8, 300), dtype=jnp.bfloat16), 128),
    "bf16_draft_f32_target": (_random_logits(3, (8, 300), dtype=jnp.bfloat16)[0],
                              _random_logits(3, (8, 300))[1], 128),
}


def _cotangent(rows: int) -> jax.Array:
  return jnp.linspace(0.5, 2.0, rows, dtype=jnp.float32)


@pytest.mark.parametrize("implementation", api.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_matches_reference(implementation, case):
  draft, target, block = CASES[case]
  cotangent = _cotangent(draft.shape[0])
  want_tv, want_grad, _ = _tv_and_grads("reference", draft, target, cotangent, block)
  tv, grad, target_grad = _tv_and_grads(implementation, draft, target, cotangent, block)
  assert tv.shape == (draft.shape[0],) and tv.dtype == np.float32
  assert np.all(np.isfinite(tv)) and np.all(np.isfinite(grad))
  assert np.all(target_grad == 0.0)
  assert np.all((tv >= 0.0) & (tv <= 1.0))
  np.testing.assert_allclose(tv, want_tv, rtol=1e-5, atol=1e-5)
  compared = np.ones(len(tv), bool)
  if case == "special_rows":
    assert tv[1] == pytest.approx(1.0, abs=1e-6)  # disjoint one-hots
    identical = [2, 4, 6]  # p == q: TV 0
    assert np.all(tv[identical] <= 1e-6)
    # TV is not differentiable at p == q. The dense reference's autodiff gradient there is
    # rounding noise (softmax(z) and softmax(t) differ in the last bit, and sign(p - q)
    # picks +-1/2 per entry); the blockwise kernels see exact ties and return exactly 0.
    compared[identical] = False
    if implementation != "reference":
      assert np.all(grad[identical] == 0.0)
  np.testing.assert_allclose(grad[compared], want_grad[compared], rtol=1e-5,
                             atol=1e-5 * np.abs(want_grad[compared]).max())


@pytest.mark.parametrize("implementation", BLOCKWISE)
@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bfloat16_matches_reference(implementation, case):
  draft, target, block = BF16_CASES[case]
  cotangent = _cotangent(draft.shape[0])
  want_tv, want_grad, _ = _tv_and_grads("reference", draft, target, cotangent, block)
  tv, grad, target_grad = _tv_and_grads(implementation, draft, target, cotangent, block)
  np.testing.assert_allclose(tv, want_tv, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-2, atol=1e-2 * np.abs(want_grad).max())
  assert np.all(target_grad == 0.0)


def _numpy_tv(draft: np.ndarray, target: np.ndarray) -> np.ndarray:
  """Float64 truth for finite differences."""
  softmax = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(
      x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
  return 0.5 * np.abs(softmax(target) - softmax(draft)).sum(-1)


def test_blockwise_gradient_matches_finite_differences():
  rng = np.random.default_rng(1)
  draft = rng.normal(size=(3, 40)) * 2
  target = rng.normal(size=(3, 40)) * 2
  cotangent = np.array([1.0, -0.5, 2.0])
  grad = jax.grad(lambda d: jnp.vdot(
      xla_blockwise.tv_distance(d, jnp.asarray(target, jnp.float32), block_size=16),
      jnp.asarray(cotangent, jnp.float32)))(jnp.asarray(draft, jnp.float32))
  step = 1e-6
  numeric = np.zeros_like(draft)
  for index in np.ndindex(*draft.shape):
    bump = np.zeros_like(draft)
    bump[index] = step
    numeric[index] = cotangent @ (_numpy_tv(draft + bump, target)
                                  - _numpy_tv(draft - bump, target)) / (2 * step)
  np.testing.assert_allclose(np.asarray(grad), numeric, rtol=1e-4, atol=1e-6)


def test_default_on_cpu_is_xla_blockwise(monkeypatch):
  assert jax.default_backend() == "cpu"
  used = []
  original = api._implementation_fn  # pylint: disable=protected-access
  monkeypatch.setattr(api, "_implementation_fn", lambda name: used.append(name) or
                      original(name))
  draft, target = _random_logits(4, (2, 3, 50))
  tv = api.tv_distance(draft, target, block_size=16)
  assert used == ["xla_blockwise"]
  assert tv.shape == (2, 3)  # leading dims are flattened into rows and restored
  np.testing.assert_allclose(tv, reference.tv_distance(draft, target), rtol=1e-5, atol=1e-6)


def test_kernel_that_fails_to_compile_falls_back_once(monkeypatch, caplog):
  """pallas_tpu without interpret cannot lower on CPU: None falls back, warning logged once."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  monkeypatch.setattr(api, "_warned_fallbacks", set())
  draft, target = _random_logits(5, (4, 256))
  with caplog.at_level(logging.WARNING):
    first = api.tv_distance(draft, target)
    second = api.tv_distance(draft * 2, target)
  assert np.all(np.isfinite(first)) and np.all(np.isfinite(second))
  np.testing.assert_allclose(first, reference.tv_distance(draft, target), rtol=1e-5,
                             atol=1e-6)
  warnings = [r for r in caplog.records if "falling back to xla_blockwise" in r.getMessage()]
  assert len(warnings) == 1 and "pallas_tpu" in warnings[0].getMessage()


@pytest.mark.parametrize("implementation,platform", [("pallas_tpu", "tpu"),
                                                     ("pallas_gpu", "cuda")])
def test_pallas_kernels_lower_for_their_hardware(implementation, platform):
  """Forward and backward lower to Mosaic / Triton IR (compiling them needs the device)."""
  loss = lambda d, t: jnp.sum(api.tv_distance(d, t, implementation=implementation,
                                              block_size=256))
  exported = jax.export.export(
      jax.jit(jax.value_and_grad(loss)), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(jax.ShapeDtypeStruct((40, 1000), jnp.bfloat16), jax.ShapeDtypeStruct((40, 1000),
                                                                          jnp.float32))
  kernel_call = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
  assert exported.mlir_module().count(kernel_call) == 2  # stats forward, gradient backward


def test_unknown_implementation_raises():
  draft, target = _random_logits(6, (2, 8))
  with pytest.raises(ValueError, match="pallas_tpu.*pallas_gpu"):
    api.tv_distance(draft, target, implementation="triton")


def test_blockwise_uses_less_temp_memory_than_reference():
  """Compiled forward + backward at N=64, V=32768: no [N, V] float32 temporaries."""
  shape = (64, 32768)
  spec = jax.ShapeDtypeStruct(shape, jnp.float32)

  def temp_bytes(implementation):
    loss = lambda d, t: jnp.mean(api.tv_distance(d, t, implementation=implementation))
    compiled = jax.jit(jax.value_and_grad(loss)).lower(spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  dense_f32 = shape[0] * shape[1] * 4
  reference_bytes = temp_bytes("reference")
  blockwise_bytes = temp_bytes("xla_blockwise")
  assert reference_bytes >= 2 * dense_f32  # p and q
  assert blockwise_bytes < dense_f32
  assert blockwise_bytes * 4 <= reference_bytes
