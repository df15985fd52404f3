"""Speculative verification preserves the target distribution (statistical tests, fixed
seeds) and accepts as many drafts as the closed form predicts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from bebop_jax.decoding import sampling
from bebop_jax.decoding import verification as verify_lib
import multiple_testing  # tests/ is on sys.path (pytest rootdir conftest)

V, K = 6, 3
SAMPLING_MODES = ("rejection", "greedy_draft", "strict", "block")
TOKENWISE_MODES = SAMPLING_MODES[:3]  # per-draft acceptance has a closed form


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


def test_categorical_samples_the_weights_and_never_a_zero_weight_token():
  """sampling.categorical, the sampler of autoregressive and speculative decoding, against
  its weights: a vocabulary of 600 (three blocks of 256, the last padded) with whole zero
  stretches, mass on both sides of a block boundary, and a block that holds one token.
  One-sample chi-square at 1e-3 over 50,000 draws; no zero-weight token ever; u = 0 and the
  largest uniform (and an overshoot, u = 1) give the first and last positive tokens. Power: the same draws reject the
  weights with the mass of token 256 moved to 255 (a block boundary off by one)."""
  rng = np.random.default_rng(0)
  v = 600
  w = np.zeros(v, np.float32)
  w[[0, 3, 255, 256, 300, 511]] = [0.5, 1.0, 2.0, 2.0, 0.25, 1.5]
  w[520:560] = rng.uniform(0.01, 0.1, 40)  # many small weights in the padded last block
  w[599] = 0.3
  u = jax.random.uniform(jax.random.key(0), (50_000,))
  draw = jax.jit(jax.vmap(lambda x: sampling.categorical(x[None], jnp.asarray(w)[None])[0]))
  tokens = np.asarray(draw(u))
  counts = np.bincount(tokens, minlength=v)
  assert counts[w == 0].sum() == 0
  w64 = w.astype(np.float64)
  expected = w64 / w64.sum() * len(tokens)
  assert expected[w > 0].min() > 5  # every cell valid for chi-square
  assert stats.chisquare(counts[w > 0], expected[w > 0]).pvalue > 1e-3
  shifted = w64.copy()
  shifted[255] += shifted[256]
  shifted[256] = 0.0
  expected_shifted = shifted / shifted.sum() * len(tokens)
  assert counts[256] > 0 and expected_shifted[256] == 0  # impossible under the shifted law
  keep = expected_shifted > 5
  assert stats.chisquare(counts[keep], expected_shifted[keep] * counts[keep].sum()
                         / expected_shifted[keep].sum()).pvalue < 1e-10
  # u = 1 is outside the uniforms' range: it stands for a rounding overshoot of the goal.
  edges = np.asarray(draw(jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0)), 1.0])))
  np.testing.assert_array_equal(edges, [0, 599, 599])


def test_exact_mode_emits_the_greedy_chain():
  seqs = _first_tokens("exact", 64, 8)
  p = np.asarray(P)
  chain, tok = [], 0
  for _ in range(8):
    tok = int(np.argmax(p[tok]))
    chain.append(tok)
  assert (seqs == np.array(chain)[None]).all()


@pytest.mark.parametrize("mode", TOKENWISE_MODES + ("exact",))
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
  selects the same rule as the mode's name (rejection's and block's differ from the rest)."""
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
  assert not np.array_equal(results["rejection"], results["block"])


# ----------------------------------------------------------------------------- block


def _block_law(p_tab, q_tab, prefix, k):
  """{(tau, y): probability} of one block-verification step by enumeration: drafts from the
  chained draft tables, the uniforms integrated out (tau = i with probability
  h_i prod_{j>i} (1 - h_j)), y from the normalised residual. Tables map the last token to
  a distribution (a Markov 'model')."""
  v = p_tab.shape[0]
  law = {}
  for drafts in np.ndindex(*(v,) * k):
    ctx = [prefix, *drafts]
    q_seq = np.prod([q_tab[ctx[j], drafts[j]] for j in range(k)])
    if q_seq == 0:
      continue
    qs = np.stack([q_tab[ctx[j]] for j in range(k)])[None]
    ps = np.stack([p_tab[ctx[j]] for j in range(k + 1)])[None]
    d = jnp.asarray(np.array(drafts)[None], jnp.int32)
    w, h = map(np.asarray, verify_lib.block_weights(d, jnp.asarray(qs), jnp.asarray(ps)))
    res = np.asarray(verify_lib.block_residual_probs(jnp.asarray(w), jnp.asarray(qs),
                                                     jnp.asarray(ps)))[0]
    for tau in range(k + 1):
      p_tau = (h[0, tau - 1] if tau else 1.0) * np.prod(1 - h[0, tau:])
      if p_tau == 0:
        continue
      nxt = ps[0, k] if tau == k else res[tau] / res[tau].sum()
      for y in range(v):
        if nxt[y] > 0:
          key = (*drafts[:tau], y)
          law[key] = law.get(key, 0.0) + q_seq * p_tau * nxt[y]
  return law


def _stream_law(p_tab, q_tab, prefix, n, k):
  """{first n tokens: probability} of the stream block verification emits from `prefix`."""
  if n == 0:
    return {(): 1.0}
  out = {}
  for emitted, prob in _block_law(p_tab, q_tab, prefix, k).items():
    head = emitted[:n]
    rest = _stream_law(p_tab, q_tab, head[-1], n - len(head), k) if len(head) < n else {(): 1}
    for tail, pt in rest.items():
      out[head + tail] = out.get(head + tail, 0.0) + prob * pt
  return out


def _tables(v, kind, seed):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet([0.8] * v, size=v)
  if kind == "random":
    q = rng.dirichlet([0.8] * v, size=v)
  elif kind == "same":
    q = p.copy()
  elif kind == "disjoint":  # p on the first half of the vocabulary, q on the rest
    half = v // 2
    p[:, half:] = 0
    p /= p.sum(1, keepdims=True)
    q = np.zeros_like(p)
    q[:, half:] = rng.dirichlet([0.8] * (v - half), size=v)
  elif kind == "close":  # a good drafter: acceptance well above rejection's floor
    q = 0.7 * p + 0.3 * rng.dirichlet([0.8] * v, size=v)
  return p.astype(np.float32), q.astype(np.float32)


@pytest.mark.parametrize("kind", ["random", "same", "disjoint", "close"])
def test_block_verification_law_is_the_target_law_exactly(kind):
  """Enumerating drafts, uniforms and the residual: the first K + 1 emitted tokens have
  exactly the target chain's law (no sampling error)."""
  v, k = 3, 2
  p, q = _tables(v, kind, seed=11)
  law = _stream_law(p, q, 0, k + 1, k)
  for seq in np.ndindex(*(v,) * (k + 1)):
    ctx = (0, *seq)
    want = np.prod([p[ctx[j], seq[j]] for j in range(k + 1)])
    assert law.get(tuple(seq), 0.0) == pytest.approx(want, abs=2e-6), (kind, seq)


def test_block_verification_accepts_the_papers_example_and_never_less_than_rejection():
  """Sun et al.'s binary example (p = (1/3, 2/3), q = (2/3, 1/3), two drafts): 11/9
  expected accepted drafts against token-wise rejection's 10/9; and on random Markov
  tables block's expected accepted length is never below rejection's."""
  p = np.array([[1 / 3, 2 / 3]] * 2, np.float32)
  q = np.array([[2 / 3, 1 / 3]] * 2, np.float32)

  def mean_accepted(p_tab, q_tab, k):
    law = _block_law(p_tab, q_tab, 0, k)
    return sum(prob * (len(seq) - 1) for seq, prob in law.items())

  def rejection_mean(p_tab, q_tab, k, prefix=0):
    # Token-wise: accept draft d w.p. min(1, p/q), stop at the first rejection.
    total = 0.0
    for drafts in np.ndindex(*(p_tab.shape[0],) * k):
      ctx = [prefix, *drafts]
      prob = np.prod([q_tab[ctx[j], drafts[j]] for j in range(k)])
      acc, run = 1.0, 0.0
      for j in range(k):
        acc *= min(1.0, p_tab[ctx[j], drafts[j]] / q_tab[ctx[j], drafts[j]])
        run += acc
      total += prob * run
    return total

  assert mean_accepted(p, q, 2) == pytest.approx(11 / 9, abs=1e-5)
  assert rejection_mean(p, q, 2) == pytest.approx(10 / 9, abs=1e-5)
  for seed in range(4):
    pt, qt = _tables(4, "random", seed)
    assert mean_accepted(pt, qt, 3) >= rejection_mean(pt, qt, 3) - 1e-5, seed


def _block_step_tables(p_tab, q_tab, k):
  """A jitted block-verification step of the Markov 'model' (p_tab, q_tab): drafts chained
  through q_tab from each row's last token, verified by verify(mode="block"); returns
  (emitted [B, K+1], count [B]). Traced on its first call, with the module's functions as
  they are then."""
  p_tab, q_tab = jnp.asarray(p_tab), jnp.asarray(q_tab)

  @jax.jit
  def step(rng, prev):
    keys = jax.random.split(rng, k + 1)
    drafts, qs, ps, ctx = [], [], [p_tab[prev]], prev
    for j in range(k):
      q = q_tab[ctx]
      d = jax.random.categorical(keys[j], jnp.log(q), axis=-1).astype(jnp.int32)
      drafts.append(d)
      qs.append(q)
      ps.append(p_tab[d])
      ctx = d
    drafts = jnp.stack(drafts, 1)
    n, nxt = verify_lib.verify(keys[k], drafts, jnp.stack(qs, 1), jnp.stack(ps, 1), "block")
    b = prev.shape[0]
    emitted = jnp.where(jnp.arange(k + 1)[None] < n[:, None],
                        jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], 1),
                        nxt[:, None])
    return emitted, n + 1
  return step


def _block_streams(p_tab, q_tab, k, rows, length, seed=2):
  """[rows, length] tokens emitted by repeated block-verification steps after token 0."""
  step = _block_step_tables(p_tab, q_tab, k)
  rng, prev = jax.random.key(seed), jnp.zeros((rows,), jnp.int32)
  out = np.zeros((rows, length + k + 1), np.int32)
  filled = np.zeros(rows, np.int64)
  index = np.arange(rows)
  while filled.min() < length:
    rng, key = jax.random.split(rng)
    emitted, count = jax.device_get(step(key, prev))
    for j in range(k + 1):
      at = j < count
      out[index[at], np.minimum(filled[at] + j, out.shape[1] - 1)] = emitted[at, j]
    filled += count
    prev = jnp.asarray(emitted[index, count - 1])
  return out[:, :length]


def _chain_pvalues(seqs, p_tab, joint):
  """{positions: p-value} of one-sample chi-square tests of `seqs` [rows, L] (emitted after
  token 0) against the Markov chain p_tab: the marginal of every position, every
  consecutive pair, and the joint law of the first `joint` tokens. Cells of expected count
  below 5 are pooled; a token of probability 0 is a failure outright (p-value 0)."""
  rows, length = seqs.shape
  v = p_tab.shape[0]
  p = p_tab.astype(np.float64)
  marginals = [p[0]]
  for _ in range(length - 1):
    marginals.append(marginals[-1] @ p)

  def pvalue(cells, probs):
    observed = np.bincount(cells, minlength=probs.size)
    expected = probs.reshape(-1) * rows
    if observed[expected == 0].sum():
      return 0.0
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum())[1])

  tests = {(i + 1,): pvalue(seqs[:, i], marginals[i]) for i in range(length)}
  for i in range(length - 1):
    tests[(i + 1, i + 2)] = pvalue(seqs[:, i] * v + seqs[:, i + 1],
                                   marginals[i][:, None] * p)
  first = p[0]  # the law of the first `joint` tokens, flattened in row-major order
  for _ in range(joint - 1):
    first = (first.reshape(-1, v)[:, :, None] * p[None]).reshape(-1)
  tests[tuple(range(1, joint + 1))] = pvalue(
      np.ravel_multi_index(seqs[:, :joint].T, (v,) * joint), first)
  return tests


def _unweighted_block_residual(w, draft_probs, target_probs):
  """A broken block rule: the residual after a block that ends at tau without the weight
  w_tau, max(0, p_{tau+1} - q_{tau+1}) (token-wise rejection's)."""
  k = draft_probs.shape[1]
  res = jnp.maximum(target_probs[:, :k] - draft_probs, 0.0)
  return jnp.where(jnp.sum(res, -1, keepdims=True) > 0, res, target_probs[:, :k])


def _block_weights_with_tokenwise_h(block_weights):
  """A broken block rule: the block ends at depth i with probability w_i (no residual mass
  S_i in h_i), the weights themselves right."""
  def broken(draft_tokens, draft_probs, target_probs):
    w, _ = block_weights(draft_tokens, draft_probs, target_probs)
    return w, w[:, 1:]
  return broken


@pytest.mark.parametrize("kind", ["random", "close", "same", "disjoint"])
def test_block_verification_samples_the_target_chain_over_several_steps(kind, monkeypatch):
  """verify(mode="block") on Markov tables over 4 tokens (p and q random Dirichlet rows;
  q a mixture 0.7 p + 0.3 Dirichlet; and the edge cases q = p and disjoint supports),
  chained step after step: the first 10 tokens emitted after token 0 by 30,000 rows
  (several K = 3 steps each) against the target chain, by one-sample chi-square tests of
  the marginal at every position, of every consecutive pair and of the joint law of the
  first K + 1 tokens, with Holm's correction at a family-wise level of 1e-3. Power: on the
  non-trivial tables broken block rules fail the same test: the block ending at depth i
  with probability w_i (h_i without the residual mass S_i), and (random tables) the
  residual without the weight, max(0, p - q) for max(0, w_tau p - q). The latter differs
  only after a block that ends at tau >= 1 with w_tau < 1, rare when q is close to p."""
  v, k, rows, length, alpha = 4, 3, 30_000, 10, 1e-3
  p, q = _tables(v, kind, seed=7)
  pvalues = _chain_pvalues(_block_streams(p, q, k, rows, length), p, joint=k + 1)
  rejected = multiple_testing.holm(pvalues, alpha)
  print(f"\n{kind}: least p-value {min(pvalues.values()):.2g}, rejected {rejected}")
  assert not rejected, (kind, {name: pvalues[name] for name in rejected})
  broken_rules = {
      "h_i = w_i": ("block_weights", _block_weights_with_tokenwise_h(verify_lib.block_weights)),
      "residual without w_tau": ("block_residual_probs", _unweighted_block_residual),
  }
  must_fail = {"random": ("h_i = w_i", "residual without w_tau"), "close": ("h_i = w_i",)}
  for name in must_fail.get(kind, ()):  # q = p keeps every draft, disjoint none: no power
    attribute, broken = broken_rules[name]
    with monkeypatch.context() as patch:
      patch.setattr(verify_lib, attribute, broken)
      pvalues = _chain_pvalues(_block_streams(p, q, k, rows, length), p, joint=k + 1)
    rejected = multiple_testing.holm(pvalues, alpha)
    print(f"  broken, {name}: rejected " +
          ", ".join(f"{t} p={pvalues[t]:.1g}" for t in rejected))
    assert rejected, (kind, name, pvalues)
