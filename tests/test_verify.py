"""Speculative verification preserves the target distribution (statistical tests, fixed
seeds) and accepts as many drafts as the closed form predicts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from bebop_jax.decoding import verification as verify_lib

V, K = 6, 3
SAMPLING_MODES = ("rejection", "greedy_draft", "strict")


def _markov(seed, concentration=0.7):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.dirichlet([concentration] * V, size=V), jnp.float32)


P = _markov(0)          # target: P[prev] is the next-token distribution
Q = _markov(1, 2.0)     # a deliberately poor drafter, unrelated to P


@functools.partial(jax.jit, static_argnames=("mode",))
def _spec_step(rng, prev, mode):
  """One speculative step of a Markov 'model' for every row; returns (emitted [B, K+1],
  count [B])."""
  b = prev.shape[0]
  keys = jax.random.split(rng, K + 1)
  drafts, qs, ps = [], [], [P[prev]]
  ctx = prev
  for j in range(K):
    q = Q[ctx]
    d = (jnp.argmax(q, -1) if mode in ("greedy_draft", "exact")
         else jax.random.categorical(keys[j], jnp.log(q), axis=-1)).astype(jnp.int32)
    drafts.append(d)
    qs.append(q)
    ps.append(P[d])
    ctx = d
  drafts = jnp.stack(drafts, 1)
  n, nxt = verify_lib.verify(keys[K], drafts, jnp.stack(qs, 1), jnp.stack(ps, 1), mode)
  emitted = jnp.where(jnp.arange(K + 1)[None] < n[:, None],
                      jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], 1),
                      nxt[:, None])
  return emitted, n + 1


def _first_tokens(mode, num_rows, num_tokens, seed=0):
  """The first num_tokens emitted after token 0, for num_rows independent rows."""
  rng = jax.random.key(seed)
  out = np.zeros((num_rows, 0), np.int32)
  counts = np.zeros(num_rows, np.int64)
  prev = jnp.zeros((num_rows,), jnp.int32)
  rows = []
  while True:
    rng, key = jax.random.split(rng)
    emitted, count = jax.device_get(_spec_step(key, prev, mode))
    rows.append((emitted, count))
    counts += count
    prev = jnp.asarray(emitted[np.arange(num_rows), count - 1])
    if counts.min() >= num_tokens:
      break
  seqs = [np.concatenate([e[i, :c[i]] for e, c in rows]) for i in range(num_rows)]
  return np.stack([s[:num_tokens] for s in seqs])


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_emitted_tokens_follow_the_target_distribution(mode):
  n = 20_000
  pairs = _first_tokens(mode, n, 2, seed=1)
  observed = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
  p = np.asarray(P)
  expected = (p[0][:, None] * p).reshape(-1) * n
  keep = expected > 5  # chi-square validity; pool the rest
  obs = np.append(observed[keep], observed[~keep].sum())
  exp = np.append(expected[keep], expected[~keep].sum())
  _, pvalue = stats.chisquare(obs, exp)
  assert pvalue > 1e-3, (mode, pvalue)
  # And the test has power: the drafter's own distribution is rejected.
  q = np.asarray(Q)
  q_exp = (q[0][:, None] * q).reshape(-1) * n
  _, q_pvalue = stats.chisquare(observed, q_exp * observed.sum() / q_exp.sum())
  assert q_pvalue < 1e-10


def test_exact_mode_emits_the_greedy_chain():
  seqs = _first_tokens("exact", 64, 8)
  p = np.asarray(P)
  chain, tok = [], 0
  for _ in range(8):
    tok = int(np.argmax(p[tok]))
    chain.append(tok)
  assert (seqs == np.array(chain)[None]).all()


@pytest.mark.parametrize("mode", SAMPLING_MODES + ("exact",))
def test_mean_accepted_matches_the_closed_form(mode):
  # Context-independent distributions: every depth has the same alpha.
  rng = np.random.default_rng(3)
  p = jnp.asarray(rng.dirichlet([1.0] * V), jnp.float32)
  q = jnp.asarray(0.5 * np.asarray(p) + 0.5 * rng.dirichlet([1.0] * V), jnp.float32)
  b = 40_000
  keys = jax.random.split(jax.random.key(5), 2)
  if mode in ("greedy_draft", "exact"):
    drafts = jnp.full((b, K), jnp.argmax(q), jnp.int32)
  else:
    drafts = jax.random.categorical(keys[0], jnp.log(q), shape=(b, K)).astype(jnp.int32)
  n, _ = verify_lib.verify(keys[1], drafts, jnp.broadcast_to(q, (b, K, V)),
                           jnp.broadcast_to(p, (b, K + 1, V)), mode)
  alpha = float(verify_lib.per_draft_acceptance(q, p, mode))
  expected = float(verify_lib.expected_accepted(jnp.full((K,), alpha)))
  sem = float(np.std(np.asarray(n))) / np.sqrt(b) + 1e-9
  assert abs(float(np.mean(n)) - expected) < 4 * sem + 1e-6, (mode, np.mean(n), expected)


def test_alpha_ordering_and_identical_distributions():
  rng = np.random.default_rng(4)
  p = jnp.asarray(rng.dirichlet([0.5] * V), jnp.float32)
  q = jnp.asarray(rng.dirichlet([0.5] * V), jnp.float32)
  rej = float(verify_lib.per_draft_acceptance(q, p, "rejection"))
  assert rej >= float(verify_lib.per_draft_acceptance(q, p, "strict"))
  assert float(verify_lib.per_draft_acceptance(p, p, "rejection")) == pytest.approx(1.0)
  # Drafting from the target itself is always accepted under rejection sampling.
  drafts = jax.random.categorical(jax.random.key(0), jnp.log(p), shape=(500, K))
  n, _ = verify_lib.verify(jax.random.key(1), drafts, jnp.broadcast_to(p, (500, K, V)),
                           jnp.broadcast_to(p, (500, K + 1, V)), "rejection")
  assert (np.asarray(n) == K).all()


def test_bad_mode_and_shapes_are_clear_errors():
  d = jnp.zeros((2, K), jnp.int32)
  q = jnp.ones((2, K, V)) / V
  p = jnp.ones((2, K + 1, V)) / V
  with pytest.raises(ValueError, match="mode='typical' is not allowed"):
    verify_lib.verify(jax.random.key(0), d, q, p, "typical")
  with pytest.raises(ValueError, match="want \\[B, K\\+1, V\\]"):
    verify_lib.verify(jax.random.key(0), d, q, q, "rejection")


def test_public_verify_is_the_package_function():
  import bebop_jax.decoding  # pylint: disable=g-import-not-at-top
  assert bebop_jax.decoding.verify is verify_lib.verify
  n, nxt = bebop_jax.decoding.verify(
      jax.random.key(0), jnp.zeros((2, 3), jnp.int32), jnp.full((2, 3, 4), 0.25),
      jnp.full((2, 4, 4), 0.25), "rejection")
  assert n.shape == (2,) and nxt.shape == (2,) and (np.asarray(n) == 3).all()


def _one_row_inputs(v=V, k=2, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.dirichlet([1.0] * v, size=(1, k)), jnp.float32)
  p = jnp.asarray(rng.dirichlet([1.0] * v, size=(1, k + 1)), jnp.float32)
  return jnp.argmax(q, -1).astype(jnp.int32), q, p


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_verify_takes_legacy_and_typed_keys_single_or_per_row(mode):
  drafts, q, p = _one_row_inputs()
  drafts, q, p = (jnp.concatenate([x, x]) for x in (drafts, q, p))  # two identical rows
  typed = jax.random.key(3)
  legacy = jax.random.PRNGKey(3)
  one = verify_lib.verify(typed, drafts, q, p, mode)
  np.testing.assert_array_equal(np.asarray(verify_lib.verify(legacy, drafts, q, p, mode)[0]),
                                np.asarray(one[0]))
  np.testing.assert_array_equal(np.asarray(verify_lib.verify(legacy, drafts, q, p, mode)[1]),
                                np.asarray(one[1]))
  rows_typed = jax.random.split(typed, 2)
  rows_legacy = jax.random.key_data(rows_typed)  # the same keys as raw uint32 [2, 2]
  a = verify_lib.verify(rows_typed, drafts, q, p, mode)
  b = verify_lib.verify(rows_legacy, drafts, q, p, mode)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match="one key or 2"):
    verify_lib.verify(jax.random.split(typed, 3), drafts, q, p, mode)


def test_greedy_draft_scores_the_given_drafts():
  """The caller's drafts are scored, not argmax(q) recomputed: with q tied between tokens 0
  and 1 and the draft 1, a target that puts all mass on 1 accepts every draft."""
  k = 2
  q = jnp.zeros((1, k, V)).at[:, :, :2].set(0.5)
  p = jnp.zeros((1, k + 1, V)).at[:, :, 1].set(1.0)
  drafts = jnp.ones((1, k), jnp.int32)
  for seed in range(20):
    n, nxt = verify_lib.verify(jax.random.key(seed), drafts, q, p, "greedy_draft")
    assert int(n[0]) == k and int(nxt[0]) == 1


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_a_token_of_target_probability_zero_is_never_emitted(mode):
  """A draft with q(d) = 0 and p(d) = 0 is rejected; nothing emitted has p = 0."""
  k = 2
  q = jnp.zeros((1, k, V)).at[:, :, 3].set(1.0)   # q puts no mass on token 0 ...
  p = jnp.zeros((1, k + 1, V)).at[:, :, 4:].set(0.5)  # ... nor does p (only 4 and 5)
  drafts = jnp.zeros((1, k), jnp.int32)           # ... yet the draft is token 0
  for seed in range(50):
    n, nxt = verify_lib.verify(jax.random.key(seed), drafts, q, p, mode)
    assert int(n[0]) == 0 and int(nxt[0]) in (4, 5), (seed, int(n[0]), int(nxt[0]))


def test_a_traced_mode_index_verifies_as_its_mode_does():
  """One compiled verification serves every sampled mode: the index into SAMPLED_MODES
  selects the same rule as the mode's name (rejection's differs from the other two)."""
  assert verify_lib.SAMPLED_MODES == SAMPLING_MODES
  rng = np.random.default_rng(5)
  b = 512
  draft_probs = jnp.asarray(rng.dirichlet([0.7] * V, size=(b, K)), jnp.float32)
  target_probs = jnp.asarray(rng.dirichlet([0.7] * V, size=(b, K + 1)), jnp.float32)
  drafts = jnp.asarray(rng.integers(0, V, (b, K)), jnp.int32)
  by_index = jax.jit(verify_lib.verify)
  results = {}
  for i, mode in enumerate(SAMPLING_MODES):
    want = verify_lib.verify(jax.random.key(3), drafts, draft_probs, target_probs, mode)
    got = by_index(jax.random.key(3), drafts, draft_probs, target_probs, jnp.int32(i))
    for w, g in zip(want, got):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=mode)
    results[mode] = np.asarray(want[0])
  assert not np.array_equal(results["rejection"], results["greedy_draft"])
