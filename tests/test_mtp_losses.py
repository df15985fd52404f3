"""MTP objectives against independent numpy computations; gradients reach only MTP params."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib

B, T, V, K = 2, 9, 11, 3


def _softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def _fake_out(seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(B, T, V)) * 2
  mtp_logits = logits[None] + rng.normal(size=(K, B, T, V))  # related drafts
  segment_ids = np.ones((B, T), np.int32)
  segment_ids[1, 7:] = 0  # padding
  mask = np.stack([np.asarray(policy_lib.shifted_valid(jnp.asarray(segment_ids), k + 1))
                   for k in range(1, K + 1)])
  tokens = rng.integers(1, V, (B, T)).astype(np.int32)
  loss_mask = np.ones((B, T), np.int32)
  loss_mask[0, :2] = 0  # prompt tokens are not targets
  out = {"logits": jnp.asarray(logits, jnp.float32),
         "mtp_logits": jnp.asarray(mtp_logits, jnp.float32), "mtp_mask": jnp.asarray(mask)}
  return out, tokens, loss_mask, (logits, mtp_logits, mask)


def _numpy_terms(logits, mtp_logits, mask, tokens, loss_mask):
  """Per depth and position: alpha, kl, ce, validity; by loops, from the definitions."""
  alpha = np.zeros((K, B, T)); kl = np.zeros((K, B, T)); ce = np.zeros((K, B, T))
  valid = np.zeros((K, B, T), bool)
  for k in range(1, K + 1):
    for b in range(B):
      for i in range(T):
        if i + k + 1 >= T or not mask[k - 1, b, i] or not loss_mask[b, i + k + 1]:
          continue
        valid[k - 1, b, i] = True
        p = _softmax(logits[b, i + k])
        q = _softmax(mtp_logits[k - 1, b, i])
        alpha[k - 1, b, i] = 0.5 * (2 - np.abs(p - q).sum())  # 1 - TV
        kl[k - 1, b, i] = np.sum(p * (np.log(p) - np.log(q)))
        ce[k - 1, b, i] = -np.log(q[tokens[b, i + k + 1]])
  return alpha, kl, ce, valid


@pytest.mark.parametrize("implementation", ["reference", "xla_blockwise"])
def test_every_loss_equals_an_independent_numpy_computation(implementation):
  out, tokens, loss_mask, (logits, mtp_logits, mask) = _fake_out()
  alpha, kl, ce, valid = _numpy_terms(logits, mtp_logits, mask, tokens, loss_mask)
  per_depth = lambda x: np.array([x[k][valid[k]].mean() for k in range(K)])
  chain = valid.all(0)
  assert 0 < chain.sum() < valid[0].sum()  # the chain mask drops positions
  e2e = np.mean([1 - np.mean([np.prod(alpha[:k + 1, b, i]) for k in range(K)])
                 for b in range(B) for i in range(T) if chain[b, i]])
  expected = {"e2e_tv": e2e, "tv": np.mean(1 - per_depth(alpha)), "kl": np.mean(per_depth(kl)),
              "ce": np.mean(per_depth(ce)), "lk": np.mean(per_depth(-np.log(np.where(valid, alpha, 1.0))))}
  assert set(expected) == set(mtp_losses.LOSSES)
  for loss, value in expected.items():
    got, metrics = mtp_losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(loss_mask),
                                       loss=loss, tv_implementation=implementation)
    np.testing.assert_allclose(float(got), value, rtol=1e-5, err_msg=loss)
    np.testing.assert_allclose([float(metrics[f"alpha_{k}"]) for k in range(1, K + 1)],
                               per_depth(alpha), rtol=1e-5)
    np.testing.assert_allclose([float(metrics[f"kl_{k}"]) for k in range(1, K + 1)],
                               per_depth(kl), rtol=1e-4)
    np.testing.assert_allclose([float(metrics[f"ce_{k}"]) for k in range(1, K + 1)],
                               per_depth(ce), rtol=1e-5)
    accepted = np.mean([sum(np.prod(alpha[:k + 1, b, i]) for k in range(K))
                        for b in range(B) for i in range(T) if chain[b, i]])
    np.testing.assert_allclose(float(metrics["expected_accepted_length"]), accepted, rtol=1e-5)
  # Depth weights: e2e_tv = 1 - sum_k w_k prod_{j<=k} alpha_j with w normalised.
  w = np.array([3.0, 1.0, 0.0])
  got, _ = mtp_losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(loss_mask), loss="e2e_tv",
                               depth_weights=w, tv_implementation=implementation)
  e2e_w = np.mean([1 - sum(w[k] / w.sum() * np.prod(alpha[:k + 1, b, i]) for k in range(K))
                   for b in range(B) for i in range(T) if chain[b, i]])
  np.testing.assert_allclose(float(got), e2e_w, rtol=1e-5)


def test_e2e_tv_gradient_matches_the_dense_reference():
  out, tokens, loss_mask, _ = _fake_out(seed=1)

  def grad(impl):
    f = lambda m: mtp_losses.mtp_loss(out | {"mtp_logits": m}, tokens, loss_mask,
                                      loss="e2e_tv", tv_implementation=impl)[0]
    return jax.grad(f)(out["mtp_logits"])

  np.testing.assert_allclose(np.asarray(grad("xla_blockwise")), np.asarray(grad("reference")),
                             atol=1e-6)
  assert np.abs(np.asarray(grad("reference"))).max() > 1e-4


@pytest.mark.parametrize("implementation", ["reference", "xla_blockwise"])
def test_lk_gradient_equals_the_analytic_gradient_of_minus_log_alpha(implementation):
  """d(-log alpha)/dz_j = -(1/alpha) q_j (1[q_j < p_j] - sum_v 1[q_v < p_v] q_v) for draft
  logits z (q = softmax z, alpha = sum_v min(p_v, q_v)), averaged per depth over its valid
  positions and over depths: by loops, from the definition."""
  out, tokens, loss_mask, (logits, mtp_logits, mask) = _fake_out(seed=2)
  alpha, _, _, valid = _numpy_terms(logits, mtp_logits, mask, tokens, loss_mask)
  want = np.zeros((K, B, T, V))
  for k in range(K):
    for b in range(B):
      for i in range(T):
        if not valid[k, b, i]:
          continue
        p, q = _softmax(logits[b, i + k + 1]), _softmax(mtp_logits[k, b, i])
        below = (q < p).astype(np.float64)
        d_alpha = q * (below - np.sum(below * q))
        want[k, b, i] = -d_alpha / alpha[k, b, i] / valid[k].sum() / K
  f = lambda m: mtp_losses.mtp_loss(out | {"mtp_logits": m}, tokens, loss_mask, loss="lk",
                                    tv_implementation=implementation)[0]
  got = np.asarray(jax.grad(f)(out["mtp_logits"]))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.abs(want).max() > 1e-3


@pytest.mark.parametrize("loss", ["ce", "e2e_tv"])
def test_gradient_reaches_only_mtp_parameters(loss):
  config = dataclasses.replace(model_config.preset("tiny"), mtp_stop_gradient=True)
  graphdef, state = policy_lib.init(config, seed=0)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 100, (2, 16)), jnp.int32)

  def f(state):
    out = nnx.merge(graphdef, state)(tokens)
    return mtp_losses.mtp_loss(out, tokens, jnp.ones_like(tokens), loss=loss)[0]

  grads = jax.jit(jax.grad(f))(state)
  flat = jax.tree_util.tree_leaves_with_path(grads)
  mtp = {jax.tree_util.keystr(p): float(jnp.abs(g).max()) for p, g in flat if "mtp" in
         jax.tree_util.keystr(p)}
  other = {jax.tree_util.keystr(p): float(jnp.abs(g).max()) for p, g in flat if "mtp" not in
           jax.tree_util.keystr(p)}
  assert other and all(v == 0.0 for v in other.values()), other
  assert mtp and all(v > 0.0 for v in mtp.values()), mtp


def test_bad_arguments_are_clear_errors():
  out, tokens, loss_mask, _ = _fake_out()
  with pytest.raises(ValueError, match="loss='mse' is not allowed"):
    mtp_losses.mtp_loss(out, tokens, loss_mask, loss="mse")
  with pytest.raises(ValueError, match="K=3 depths"):
    mtp_losses.mtp_loss(out, tokens, loss_mask, loss="tv", depth_weights=[1.0, 1.0])


def test_the_fused_head_gives_the_dense_heads_values_and_gradients():
  """Every loss and metric, and the gradient of every parameter (the chain not detached, so
  the shared head's gradient goes through the fused backward too), through a real policy's
  forward: the fused head (final-normed hidden states streamed over vocabulary chunks, no
  [K, B, T, V] logits) against the dense one, at temperature 0.7, with padding."""
  config = dataclasses.replace(model_config.preset("tiny"), mtp_stop_gradient=False)
  graphdef, state = policy_lib.init(config, seed=0)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(3, config.vocab_size, (2, 16)), jnp.int32)
  segment_ids = jnp.asarray(np.r_[np.ones(16), np.ones(12), np.zeros(4)].reshape(2, 16),
                            jnp.int32)
  loss_mask = jnp.asarray(rng.integers(0, 2, (2, 16)), jnp.int32).at[:, 4:].set(1)

  @functools.partial(jax.jit, static_argnums=0)
  def run(head, state):  # every loss's value, metrics and gradient: one program per head
    def f(state, loss):
      out = nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids,
                                       logits=head == "dense")
      return mtp_losses.mtp_loss(out, tokens, loss_mask, loss=loss, temperature=0.7)
    return {loss: jax.value_and_grad(f, has_aux=True)(state, loss)
            for loss in mtp_losses.LOSSES}

  fused, dense = run("fused", state), run("dense", state)
  for loss in mtp_losses.LOSSES:
    (v_f, m_f), g_f = fused[loss]
    (v_d, m_d), g_d = dense[loss]
    np.testing.assert_allclose(float(v_f), float(v_d), rtol=1e-5, err_msg=loss)
    for name in m_d:
      np.testing.assert_allclose(float(m_f[name]), float(m_d[name]), rtol=1e-5, atol=1e-7,
                                 err_msg=f"{loss} {name}")
    flat_f = dict(jax.tree_util.tree_leaves_with_path(g_f))
    for path, g in jax.tree_util.tree_leaves_with_path(g_d):
      np.testing.assert_allclose(np.asarray(flat_f[path]), np.asarray(g), rtol=1e-4,
                                 atol=1e-6, err_msg=f"{loss} {jax.tree_util.keystr(path)}")
    # The shared embedding (the tied head) learns from the chain here.
    assert max(float(jnp.abs(g).max()) for p, g in flat_f.items()
               if "embed" in jax.tree_util.keystr(p)) > 0, loss


def test_heads_at_the_loss_rows_only_give_the_dense_masked_loss_and_gradients():
  """The MTP stage's step: the trunk's h0 given as features (`hidden=`, no main layers) and
  the head run only at the rows whose next token is a loss target (`rows=`). Every loss,
  metric and MTP gradient equals the dense forward's over all positions with the mask:
  packed segments, a prompt (no targets) in each, padding, and spare row slots."""
  config = dataclasses.replace(model_config.preset("tiny"), mtp_stop_gradient=True)
  graphdef, state = policy_lib.init(config, seed=0)
  rng = np.random.default_rng(5)
  t = 24
  tokens = jnp.asarray(rng.integers(3, config.vocab_size, (2, t)), jnp.int32)
  segment_ids = np.zeros((2, t), np.int32)
  segment_ids[0, :10], segment_ids[0, 10:24] = 1, 2
  segment_ids[1, :17] = 1
  positions = np.zeros((2, t), np.int32)
  for b in range(2):
    for s in (1, 2):
      idx = np.flatnonzero(segment_ids[b] == s)
      positions[b, idx] = np.arange(len(idx))
  loss_mask = np.zeros((2, t), np.int32)  # completions: the tail of each segment
  loss_mask[0, 6:10], loss_mask[0, 15:24], loss_mask[1, 8:17] = 1, 1, 1
  rows = mtp_losses.loss_rows(loss_mask, 16)
  assert (rows < t).sum() == loss_mask[:, 1:].sum() and (rows == t).any()
  hidden = nnx.merge(graphdef, state)(tokens, jnp.asarray(positions),
                                      jnp.asarray(segment_ids), num_draft_steps=0)["hidden"]
  _, trainable, frozen = nnx.split(nnx.merge(graphdef, state),
                                   nnx.All(nnx.Param, nnx.PathContains("mtp")), ...)

  @functools.partial(jax.jit, static_argnums=0)
  def run(sparse, trainable):
    def f(trainable, loss):
      model = nnx.merge(graphdef, trainable, frozen)
      kw = dict(hidden=hidden, logits=False) if sparse else {}
      out = model(tokens, jnp.asarray(positions), jnp.asarray(segment_ids), **kw)
      return mtp_losses.mtp_loss(out, tokens, jnp.asarray(loss_mask), loss=loss,
                                 rows=jnp.asarray(rows) if sparse else None)
    return {loss: jax.value_and_grad(f, has_aux=True)(trainable, loss)
            for loss in mtp_losses.LOSSES}

  sparse, dense = run(True, trainable), run(False, trainable)
  for loss in mtp_losses.LOSSES:
    (v_s, m_s), g_s = sparse[loss]
    (v_d, m_d), g_d = dense[loss]
    assert float(m_d["positions"]) > 0
    np.testing.assert_allclose(float(v_s), float(v_d), rtol=1e-5, err_msg=loss)
    for name in m_d:
      np.testing.assert_allclose(float(m_s[name]), float(m_d[name]), rtol=1e-5, atol=1e-7,
                                 err_msg=f"{loss} {name}")
    flat_s = dict(jax.tree_util.tree_leaves_with_path(g_s))
    for path, g in jax.tree_util.tree_leaves_with_path(g_d):
      assert float(jnp.abs(g).max()) > 0, (loss, jax.tree_util.keystr(path))
      np.testing.assert_allclose(np.asarray(flat_s[path]), np.asarray(g), rtol=1e-4,
                                 atol=1e-6, err_msg=f"{loss} {jax.tree_util.keystr(path)}")
  with pytest.raises(ValueError, match="num_rows=4"):
    mtp_losses.loss_rows(loss_mask, 4)


def test_a_reduced_draft_vocabulary_against_numpy_and_the_whole_head():
  """The drafter restricted to V_d tokens (draft_vocab=), at the loss rows: per depth the
  acceptance sum_{v in V_d} min(p_v, q_v) with p over the whole vocabulary, KL from p
  renormalised on V_d and CE on the in-vocabulary tokens, from numpy loops over the
  definitions; with V_d the whole vocabulary it is the fused head's loss and gradient."""
  config = dataclasses.replace(model_config.preset("tiny"), mtp_stop_gradient=True)
  graphdef, state = policy_lib.init(config, seed=1)
  rng = np.random.default_rng(7)
  t, v = 20, config.vocab_size
  tokens = rng.integers(3, v, (2, t)).astype(np.int32)
  loss_mask = np.zeros((2, t), np.int32)
  loss_mask[0, 5:], loss_mask[1, 9:] = 1, 1
  vocab = np.sort(rng.choice(v, v // 3, replace=False)).astype(np.int32)
  tokens[0, 12] = vocab[3]  # some targets inside the vocabulary, most outside
  rows = mtp_losses.loss_rows(loss_mask, 20)
  model = nnx.merge(graphdef, state)
  dense = model(jnp.asarray(tokens))
  logits, mtp_logits = np.asarray(dense["logits"], np.float64), np.asarray(
      dense["mtp_logits"], np.float64)
  fused = model(jnp.asarray(tokens), logits=False)
  _, metrics = mtp_losses.mtp_loss(fused, jnp.asarray(tokens), jnp.asarray(loss_mask),
                                   loss="tv", rows=jnp.asarray(rows),
                                   draft_vocab=jnp.asarray(vocab))
  in_v = np.isin(np.arange(v), vocab)
  for k in range(1, K + 1):
    alphas, kls, ces = [], [], []
    for b in range(2):
      for i in range(t - k - 1):
        if not loss_mask[b, i + k + 1]:
          continue
        p = _softmax(logits[b, i + k])
        q = np.zeros(v)
        q[in_v] = _softmax(mtp_logits[k - 1, b, i][in_v])
        alphas.append(np.minimum(p, q).sum())
        pt = p[in_v] / p[in_v].sum()
        kls.append(np.sum(pt * (np.log(pt) - np.log(q[in_v]))))
        x = tokens[b, i + k + 1]
        ces.append(-np.log(q[x]) if in_v[x] else 0.0)
    np.testing.assert_allclose(float(metrics[f"alpha_{k}"]), np.mean(alphas), rtol=1e-4)
    np.testing.assert_allclose(float(metrics[f"kl_{k}"]), np.mean(kls), rtol=1e-4)
    np.testing.assert_allclose(float(metrics[f"ce_{k}"]), np.mean(ces), rtol=1e-4)

  _, trainable, frozen = nnx.split(model, nnx.All(nnx.Param, nnx.PathContains("mtp")), ...)

  def f(trainable, loss, vocab):
    out = nnx.merge(graphdef, trainable, frozen)(jnp.asarray(tokens), logits=False)
    return mtp_losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(loss_mask), loss=loss,
                               rows=jnp.asarray(rows), draft_vocab=vocab)[0]
  whole = jnp.arange(v, dtype=jnp.int32)
  for loss in ("e2e_tv", "kl"):
    (a, ga), (b, gb) = [jax.value_and_grad(f)(trainable, loss, vv) for vv in (whole, None)]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5, err_msg=loss)
    flat = dict(jax.tree_util.tree_leaves_with_path(gb))
    for path, g in jax.tree_util.tree_leaves_with_path(ga):
      np.testing.assert_allclose(np.asarray(g), np.asarray(flat[path]), rtol=1e-4, atol=1e-6,
                                 err_msg=f"{loss} {jax.tree_util.keystr(path)}")
