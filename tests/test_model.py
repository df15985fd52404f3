"""Policy model: reference equality, cached decoding, MTP chain, stop-gradient, counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference_model
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib

TOL = dict(atol=2e-4, rtol=2e-4)


def _tiny(**overrides):
  return model_config.preset("tiny", **overrides)


def _model(cfg, seed=0):
  return nnx.merge(*policy_lib.init(cfg, seed))


def _tokens(b, t, seed=0, vocab=100):
  return jax.random.randint(jax.random.key(seed), (b, t), 3, vocab, dtype=jnp.int32)


@pytest.mark.parametrize("overrides", [
    {},  # M=2 < K=3: depth 3 reuses module 2
    {"tie_embeddings": False, "qk_norm": False, "num_mtp_modules": 1, "num_draft_steps": 3},
    {"attention_block_size": 5},  # 12 positions in three query blocks, the last ragged
    {"attention": "dense", "remat": "none"},
])
def test_teacher_forced_chain_matches_hand_unrolled_reference(overrides):
  cfg = _tiny(**overrides)
  model = _model(cfg)
  params = reference_model.params_from_model(model)
  # Two rows: one packed with three segments and padding, one plain.
  seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0],
                  [1] * 12], np.int32)
  pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0], list(range(12))], np.int32)
  toks = np.asarray(_tokens(2, 12, seed=1))
  out = jax.jit(model.__call__)(jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(seg))
  for row in range(2):
    logits, mask, mtp_logits, mtp_mask = reference_model.forward(
        params, cfg, toks[row], seg[row], pos[row], cfg.num_draft_steps)
    np.testing.assert_array_equal(np.asarray(out["mask"][row]), mask)
    np.testing.assert_array_equal(np.asarray(out["mtp_mask"][:, row]), mtp_mask)
    np.testing.assert_allclose(np.asarray(out["logits"][row]), logits, **TOL)
    # Compare the chain where it is valid (elsewhere the inputs are padding by definition).
    for k in range(cfg.num_draft_steps):
      got = np.asarray(out["mtp_logits"][k, row])[mtp_mask[k]]
      np.testing.assert_allclose(got, mtp_logits[k][mtp_mask[k]], **TOL)
  # Masks at sequence and segment ends: depth k at i is valid iff i+k+1 is in i's segment.
  assert out["mtp_mask"][0, 0].tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
  assert out["mtp_mask"][2, 1].tolist() == [1] * 8 + [0] * 4


def test_depths_beyond_m_reuse_module_m():
  cfg = _tiny(num_mtp_modules=1, num_draft_steps=3)
  model = _model(cfg)
  toks = _tokens(1, 10)
  base = jax.jit(model.__call__)(toks)
  # Perturbing module 1 changes every depth; there is no other module to perturb.
  model.mtp.proj[...] = model.mtp.proj[...] * 1.5
  changed = jax.jit(model.__call__)(toks)
  for k in range(3):
    assert not np.allclose(base["mtp_logits"][k], changed["mtp_logits"][k])
  assert cfg.mtp_module_index(1) == cfg.mtp_module_index(3) == 0
  assert _tiny().mtp_module_index(3) == 1


def _mtp_loss(state, graphdef, toks):
  out = nnx.merge(graphdef, state)(toks)
  logq = jax.nn.log_softmax(out["mtp_logits"])
  targets = jax.nn.one_hot(policy_lib.shift_left(toks, 2), logq.shape[-1])
  return -(logq[0] * targets).sum() - (logq[1:] * jax.lax.stop_gradient(
      jax.nn.softmax(out["logits"]))[None]).sum()


@pytest.mark.parametrize("tie", [True, False])
def test_stop_gradient_switch(tie):
  cfg = _tiny(tie_embeddings=tie)
  graphdef, state = policy_lib.init(cfg)
  toks = _tokens(2, 10)
  grads = jax.jit(jax.grad(_mtp_loss), static_argnums=1)(state, graphdef, toks)
  flat = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
  main_keys = [p for p in flat if jax.tree_util.keystr(p).split("'")[1] != "mtp"]
  mtp_keys = [p for p in flat if p not in main_keys]
  assert {jax.tree_util.keystr(p).split("'")[1] for p in main_keys} >= {
      "embed", "layers", "final_norm"} | ({"head"} if not tie else set())
  for p in main_keys:
    assert np.all(np.asarray(flat[p]) == 0), jax.tree_util.keystr(p)
  assert any(np.abs(np.asarray(flat[p])).max() > 0 for p in mtp_keys)
  # With the switch off, the same loss reaches the backbone.
  cfg_off = _tiny(tie_embeddings=tie, mtp_stop_gradient=False)
  graphdef, state = policy_lib.init(cfg_off)
  grads = jax.jit(jax.grad(_mtp_loss), static_argnums=1)(state, graphdef, toks)
  assert np.abs(np.asarray(grads["layers"]["wq"][...])).max() > 0
  assert np.abs(np.asarray(grads["embed"][...])).max() > 0


def test_cached_token_by_token_matches_full_forward_for_main_and_every_depth():
  cfg = _tiny()
  model = _model(cfg)
  b, t, k_steps = 2, 12, cfg.num_draft_steps
  toks = _tokens(b, t)
  ref = jax.jit(model.__call__)(toks)
  step = jax.jit(lambda c, x, s: model.step(c, x, s))
  mtp_steps = {k: jax.jit(lambda c, h, x, s, k=k: model.mtp_step(c, k, h, x, s))
               for k in range(1, k_steps + 1)}
  cache = model.init_cache(b, 16)
  padded = jnp.pad(toks, ((0, 0), (0, k_steps)))
  for n in range(t):
    start = jnp.full((b,), n, jnp.int32)
    logits, h, cache = step(cache, toks[:, n:n + 1], start)
    np.testing.assert_allclose(logits[:, 0], ref["logits"][:, n], **TOL)
    for k in range(1, k_steps + 1):
      q, h, cache = mtp_steps[k](cache, h, padded[:, n + k:n + k + 1], start)
      if n + k + 1 < t:
        np.testing.assert_allclose(q[:, 0], ref["mtp_logits"][k - 1][:, n], **TOL)
  assert step._cache_size() == 1
  assert all(f._cache_size() == 1 for f in mtp_steps.values())


def test_prefill_then_chunks_at_per_row_positions_matches_full_forward():
  """Right-padded prompts of different lengths, then chunks of C tokens per row starting
  at each row's own frontier; MTP windows of 2K positions ending at the frontier."""
  cfg = _tiny()
  model = _model(cfg)
  b, t, k_steps, chunk = 3, 20, cfg.num_draft_steps, 3
  window = 2 * k_steps
  toks = _tokens(b, t, seed=2)
  ref = jax.jit(model.__call__)(toks)
  lengths = np.array([3, 7, 5])
  prompt = jnp.where(jnp.arange(8)[None] < lengths[:, None], toks[:, :8], 0)
  cache = model.init_cache(b, 32)
  logits, h0, cache = jax.jit(model.prefill)(cache, prompt)
  for row in range(b):
    n = lengths[row]
    np.testing.assert_allclose(logits[row, :n], ref["logits"][row, :n], **TOL)
  h0_all = jnp.zeros((b, 32, cfg.d_model)).at[:, :8].set(h0)
  step = jax.jit(model.step)
  mtp = jax.jit(model.mtp_step, static_argnums=1)
  padded = jnp.pad(toks, ((0, 0), (0, 32)))
  rows = jnp.arange(b)[:, None]
  frontier = jnp.asarray(lengths - 1)  # last position whose h0 is known
  for _ in range(4):
    # Every depth recomputes the window [n - W + 1, n] (clipped at 0) with true tokens.
    start = jnp.maximum(frontier - window + 1, 0)
    win = start[:, None] + jnp.arange(window)[None]
    h_prev = h0_all[rows, win]
    for k in range(1, k_steps + 1):
      q, h_prev, cache = mtp(cache, k, h_prev, padded[rows, win + k], start)
      for row in range(b):
        n = int(frontier[row])
        i = n - int(start[row])
        if n + k + 1 < t:
          np.testing.assert_allclose(q[row, i], ref["mtp_logits"][k - 1][row, n], **TOL)
    # A chunk of the true next tokens at each row's own positions.
    logits, h, cache = step(cache, padded[rows, frontier[:, None] + 1 + jnp.arange(chunk)],
                            frontier + 1)
    for row in range(b):
      n = int(frontier[row])
      np.testing.assert_allclose(logits[row], ref["logits"][row, n + 1:n + 1 + chunk], **TOL)
    h0_all = h0_all.at[rows, frontier[:, None] + 1 + jnp.arange(chunk)].set(h)
    # Rows advance by different amounts, as after variable acceptance.
    frontier = frontier + jnp.array([1, 3, 2])
  assert step._cache_size() == 1 and mtp._cache_size() == k_steps


def test_prompt_longer_than_cache_is_a_clear_error():
  model = _model(_tiny())
  cache = model.init_cache(1, 8)
  with pytest.raises(ValueError, match="a prompt of 9 tokens does not fit the cache of 8"):
    model.prefill(cache, jnp.zeros((1, 9), jnp.int32))


@pytest.mark.parametrize("name", list(model_config.PRESETS))
def test_param_count_matches_closed_form(name):
  cfg = model_config.preset(name)
  _, state = policy_lib.abstract_state(cfg)
  counts = model_config.param_count(cfg)
  assert policy_lib.num_params(state) == counts["total"]
  mtp = sum(int(x.size) for x in jax.tree.leaves(state["mtp"]))
  assert mtp == counts["mtp"]
  if name == "small":
    assert 0.8e6 <= counts["total"] <= 1.3e6


def test_bad_model_config_is_a_clear_error():
  with pytest.raises(ValueError, match="num_kv_heads=3 is not allowed: must divide"):
    _tiny(num_kv_heads=3)
  with pytest.raises(ValueError, match="num_draft_steps=1 is not allowed: must be >= "):
    _tiny(num_mtp_modules=2, num_draft_steps=1)
  with pytest.raises(ValueError, match="dtype='float16' is not allowed"):
    _tiny(dtype="float16")
