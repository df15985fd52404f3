"""Speculative generation with MTP drafts on the tiny model."""

import contextlib
import functools
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax.decoding import autoregressive, sampling, speculative
from bebop_jax.decoding import verification as verify_lib
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
import multiple_testing  # tests/ is on sys.path (pytest rootdir conftest)

GRAPHDEF, STATE = policy_lib.init(model_config.preset("tiny"), seed=3)
GRAPHDEF_K = model_config.preset("tiny").num_draft_steps
STOP = (2,)


def _prompts(b=3, p=12, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([5, 12, 8, 3, 10, 7][:b], np.int32)
  tokens = rng.integers(3, 100, (b, p)).astype(np.int32)
  tokens[np.arange(p)[None] >= lengths[:, None]] = 0
  return jnp.asarray(tokens), jnp.asarray(lengths)


def _spec(tokens, lengths, *, mode, temperature, seed=0, max_new=24):
  return speculative.generate(
      GRAPHDEF, STATE, tokens, lengths, jax.random.key(seed), max_new_tokens=max_new,
      cache_length=64, params=sampling.SamplingParams(temperature), mode=mode,
      stop_tokens=STOP)


def test_temperature_zero_equals_greedy_autoregressive():
  tokens, lengths = _prompts()
  ar = autoregressive.generate(GRAPHDEF, STATE, tokens, lengths, jax.random.key(0),
                               max_new_tokens=24, cache_length=64,
                               params=sampling.SamplingParams(0.0), stop_tokens=STOP)
  sp = _spec(tokens, lengths, mode="exact", temperature=0.0)
  np.testing.assert_array_equal(np.asarray(sp.lengths), np.asarray(ar.lengths))
  np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
  # The random model's drafts are mostly wrong, so this exercised rejections.
  acc = np.asarray(sp.accepted).sum() / max(np.asarray(sp.attempted).sum(), 1)
  assert acc < 0.9
  assert int(sp.target_forwards) < 24


@pytest.mark.parametrize("mode", ["rejection", "greedy_draft", "block"])
def test_caches_below_the_draft_window_equal_a_fresh_prefill(mode):
  """The drafting invariant (DESIGN.md 4): every depth-cache entry below the window of the
  last K+1 positions was written with committed tokens. Mostly-wrong drafts of the random
  model make the frontier advance by varied amounts, rejected drafts leave stale entries."""
  tokens, lengths = _prompts(b=4, seed=3)
  k = GRAPHDEF_K
  ds = speculative.start(GRAPHDEF, STATE, tokens, lengths, jax.random.key(2),
                         max_new_tokens=40, cache_length=64,
                         params=sampling.SamplingParams(1.0), mode=mode, stop_tokens=())
  accepted, attempted = np.asarray(ds.out.accepted).sum(), np.asarray(ds.out.attempted).sum()
  assert 0 < accepted < 0.9 * attempted
  n_all = np.asarray(ds.frontier)
  model = nnx.merge(GRAPHDEF, STATE)
  _, h0, fresh = jax.jit(lambda x: model.prefill(model.init_cache(4, 64), x))(
      ds.seq[:, :int(n_all.max()) + 2])
  for row, n in enumerate(n_all):
    np.testing.assert_allclose(np.asarray(ds.hidden[row, :n + 1]), np.asarray(h0[row, :n + 1]),
                               atol=2e-5)
    for name in ("k", "v"):  # [blocks, B, KV, S, D]
      np.testing.assert_allclose(np.asarray(ds.cache.main.stacked(name)[:, row, :, :n + 1]),
                                 np.asarray(fresh.main.stacked(name)[:, row, :, :n + 1]),
                                 atol=2e-5)
      for depth in range(1, k + 1):
        np.testing.assert_allclose(
            np.asarray(ds.cache.mtp.stacked(name)[depth - 1, row, :, :n - k]),
            np.asarray(fresh.mtp.stacked(name)[depth - 1, row, :, :n - k]), atol=2e-5,
            err_msg=f"row {row} depth {depth} {name}")


@pytest.mark.parametrize("mode", ["rejection", "greedy_draft", "strict", "block"])
def test_a_row_does_not_depend_on_the_other_rows(mode):
  tokens, lengths = _prompts(b=4, seed=1)
  other_tokens, other_lengths = _prompts(b=4, seed=2)
  other_tokens = other_tokens.at[0].set(tokens[0])
  other_lengths = other_lengths.at[0].set(lengths[0])
  a = _spec(tokens, lengths, mode=mode, temperature=1.0, seed=7)
  b = _spec(other_tokens, other_lengths, mode=mode, temperature=1.0, seed=7)
  for field in ("tokens", "lengths", "attempted", "accepted"):
    np.testing.assert_array_equal(np.asarray(getattr(a, field))[0],
                                  np.asarray(getattr(b, field))[0])
  assert not np.array_equal(np.asarray(a.tokens)[1:], np.asarray(b.tokens)[1:])


def test_the_sampled_modes_share_one_compiled_loop():
  """rejection, greedy_draft, strict and block run one program (the mode is its argument); exact,
  at temperature 0, is its own. The modes still decode differently from the same key."""
  tokens, lengths = _prompts(b=4, seed=5)
  outs = {"rejection": _spec(tokens, lengths, mode="rejection", temperature=1.0, seed=3)}
  size = speculative.generate._cache_size()  # pylint: disable=protected-access
  for mode in ("greedy_draft", "strict", "block"):
    outs[mode] = _spec(tokens, lengths, mode=mode, temperature=1.0, seed=3)
  assert speculative.generate._cache_size() == size  # pylint: disable=protected-access
  _spec(tokens, lengths, mode="exact", temperature=0.0)
  assert speculative.generate._cache_size() == size + 1  # pylint: disable=protected-access
  # The random model's drafts: greedy_draft drafts argmax q and accepts with p(d), so its
  # acceptance and tokens differ from rejection's on the same key.
  assert not np.array_equal(np.asarray(outs["rejection"].accepted),
                            np.asarray(outs["greedy_draft"].accepted))
  with pytest.raises(ValueError, match="mode='beam' is not allowed"):
    _spec(tokens, lengths, mode="beam", temperature=1.0)


def test_outputs_are_consistent_and_loop_compiles_once():
  tokens, lengths = _prompts()
  out = _spec(tokens, lengths, mode="rejection", temperature=1.0, seed=1)
  size = speculative.generate._cache_size()  # pylint: disable=protected-access
  for seed in (2, 3):
    out = _spec(tokens + seed, lengths, mode="rejection", temperature=1.0, seed=seed)
  assert speculative.generate._cache_size() == size  # pylint: disable=protected-access
  n = np.asarray(out.lengths)
  toks = np.asarray(out.tokens)
  assert ((n >= 1) & (n <= 24)).all()
  for row in range(3):
    assert (toks[row, n[row]:] == 0).all()
    stops = np.isin(toks[row, :n[row]], STOP)
    assert not stops[:-1].any()  # a stop token can only be the last
    assert n[row] == 24 or stops[-1]
  logp = np.asarray(out.logprobs)
  assert (logp[np.arange(24)[None] < n[:, None]] <= 0).all()
  att, acc = np.asarray(out.attempted), np.asarray(out.accepted)
  assert (acc <= att).all() and (att[:, 1:] <= att[:, :1]).all()
  # Every iteration emits accepted + 1 tokens (until the end): tokens = 1 + forwards + accepted.
  assert n.sum() <= 3 + 3 * int(out.target_forwards) + acc[:, 0].sum() + acc[:, 1:].sum()


def test_mismatched_mode_and_temperature_is_a_clear_error():
  tokens, lengths = _prompts()
  with pytest.raises(ValueError, match="temperature 0 needs mode='exact'"):
    _spec(tokens, lengths, mode="rejection", temperature=0.0)
  with pytest.raises(ValueError, match="need a cache of"):
    _spec(tokens, lengths, mode="rejection", temperature=1.0, max_new=60)


@pytest.fixture(scope="module")
def partly_trained():
  """The tiny model after 80 steps on noisy cyclic sequences: drafts partly right."""
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.losses import lm  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import optimizer, trainer  # pylint: disable=g-import-not-at-top
  model = policy_lib.Policy(model_config.preset("tiny"), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tx, schedule = optimizer.make_optimizer(
      config_lib.optim_defaults(learning_rate=1e-2, warmup_steps=5), 80)

  def loss_fn(m, batch):
    out = m(batch, num_draft_steps=3)
    return lm.sft_loss(out, batch, jnp.ones_like(batch), 1.0)

  step = jax.jit(trainer.make_train_step(graphdef, loss_fn, tx, schedule),
                 donate_argnums=(0, 2))
  rng = np.random.default_rng(0)
  opt_state, frozen = tx.init(params), nnx.State({})
  for i in range(80):
    start = rng.integers(0, 7, (32, 1))
    seq = 3 + (start + np.arange(32)[None]) % 7
    noise = rng.random((32, 32)) < 0.25
    seq = np.where(noise, rng.integers(3, 12, (32, 32)), seq).astype(np.int32)
    params, opt_state, _, metrics = step(params, frozen, opt_state, jnp.int32(i), seq)
  return graphdef, params


@pytest.mark.parametrize("mode", ["rejection", "greedy_draft"])
def test_online_acceptance_matches_teacher_forced_expectation(partly_trained, mode):
  from bebop_jax.decoding import diagnostics  # pylint: disable=g-import-not-at-top
  graphdef, params_state = partly_trained
  b = 32
  rng = np.random.default_rng(5)
  lengths = jnp.asarray(rng.integers(3, 9, b).astype(np.int32))
  tokens = jnp.asarray(np.where(np.arange(8)[None] < np.asarray(lengths)[:, None],
                                3 + (rng.integers(0, 7, (b, 1)) + np.arange(8)[None]) % 7,
                                0).astype(np.int32))
  params = sampling.SamplingParams(1.0)
  out = speculative.generate(graphdef, params_state, tokens, lengths, jax.random.key(11),
                             max_new_tokens=48, cache_length=64, params=params, mode=mode,
                             stop_tokens=())
  attempted = np.asarray(out.attempted).sum(0)
  online = np.asarray(out.accepted).sum(0) / attempted
  seq, gen = diagnostics.sequences_from_generation(tokens, lengths, out.tokens, out.lengths)
  tf = diagnostics.teacher_forced_acceptance(graphdef, params_state, seq, gen,
                                             out.frontier_depths, params=params, mode=mode)
  np.testing.assert_array_equal(np.asarray(tf["visits"]), attempted)
  expected = np.asarray(tf["alpha_at_frontiers"])
  assert (0.2 < expected).all() and (expected < 0.95).all()  # partly right drafts
  # Online accepted counts against their exact expectation, within 4 standard deviations.
  accepted = np.asarray(out.accepted).sum(0)
  sd = np.sqrt(np.asarray(tf["accepted_variance"]))
  assert (np.abs(accepted - np.asarray(tf["expected_accepted"])) < 4 * sd + 1).all(), (
      online, expected, attempted)
  # The position-weighted training metric is close to the online rate, not equal.
  assert (np.abs(online - np.asarray(tf["alpha"])) < 0.2).all()
  # The benchmark's version (rows of all batches padded to one length, scored 16 at a time)
  # gives the same sums, here from two batches of different prompt widths.
  from bebop_jax.stages import decode_timing  # pylint: disable=g-import-not-at-top
  halves = (slice(0, 20), slice(20, b))
  batches = [(np.pad(np.asarray(tokens[h]), ((0, 0), (0, 4 * i))), np.asarray(lengths[h]))
             for i, h in enumerate(halves)]
  outputs = [types.SimpleNamespace(tokens=out.tokens[h], lengths=out.lengths[h],
                                   frontier_depths=out.frontier_depths[h]) for h in halves]
  expected_sum, visits = decode_timing._teacher_forced_at_frontiers(  # pylint: disable=protected-access
      graphdef, params_state, batches, outputs, params=params, mode=mode)
  np.testing.assert_array_equal(visits, attempted)
  np.testing.assert_allclose(expected_sum, np.asarray(tf["expected_accepted"]), rtol=1e-5)
  # All modes from one forward give each mode's numbers.
  both = diagnostics.teacher_forced_acceptance_by_mode(
      graphdef, params_state, seq, gen, params=params, modes=("rejection", "greedy_draft"))
  for key in ("alpha", "alpha_unweighted", "positions"):
    np.testing.assert_allclose(np.asarray(both[mode][key]), np.asarray(tf[key]), rtol=1e-6)
  # Packed into shared rows (the MTP and RL stages' diagnostic): the same numbers from one
  # packed forward, and the same plain mean from several.
  from bebop_jax.train import drafter  # pylint: disable=g-import-not-at-top
  ends = np.asarray(lengths + out.lengths)
  rows = [(np.asarray(seq[i, :ends[i]]), np.asarray(gen[i, :ends[i]])) for i in range(b)]
  from bebop_jax.data import packing  # pylint: disable=g-import-not-at-top
  assert len(packing.first_fit_decreasing(ends, 256)) <= b // 3  # rows do share sequences
  for batch_size, keys in ((b, ("alpha", "alpha_unweighted")), (2, ("alpha_unweighted",))):
    packed = drafter.teacher_forced_acceptance(
        graphdef, params_state, rows, temperature=1.0, modes=(mode,), batch_size=batch_size,
        pack_length=256)
    for key in keys:
      np.testing.assert_allclose(packed[mode][key], np.asarray(both[mode][key]), rtol=1e-5,
                                 err_msg=f"{key}, {batch_size} rows per forward")
  # Per-position acceptance of both modes from one forward: its masked means per depth are
  # each mode's unweighted teacher-forced acceptance.
  pos = diagnostics.acceptance_by_position(graphdef, params_state, seq, gen, params=params,
                                           modes=("rejection", "greedy_draft"))
  m = np.asarray(pos["mask"], float)
  for name in ("rejection", "greedy_draft"):
    mean = (np.asarray(pos["alpha"][name]) * m).sum((1, 2)) / m.sum((1, 2))
    np.testing.assert_allclose(mean, np.asarray(both[name]["alpha_unweighted"]), rtol=1e-5)


def test_weights_sliced_inside_the_loop_give_the_same_generation():
  """decode_preslice_weights=False (the pod presets: no second copy of the weights) slices
  the stacked layers inside every step instead of once before the loop: same numbers."""
  graphdef, _ = policy_lib.init(model_config.preset("tiny", decode_preslice_weights=False))
  tokens, lengths = _prompts()
  common = dict(max_new_tokens=16, cache_length=64, params=sampling.SamplingParams(1.0),
                stop_tokens=STOP)
  assert nnx.merge(graphdef, STATE).config.decode_preslice_weights is False
  assert nnx.merge(GRAPHDEF, STATE).config.decode_preslice_weights is True
  # The speculative loop runs every decoding entry point: prefill, step and mtp_step.
  a, b = [speculative.generate(gd, STATE, tokens, lengths, jax.random.key(4), mode="rejection",
                               **common) for gd in (GRAPHDEF, graphdef)]
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)



@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_release_compiled_unmaps_the_generated_code():
  """Each compiled loop maps hundreds of code regions; a long job must be able to drop them
  (vm.max_map_count is 65530), which compilation.release_compiled does."""
  from bebop_jax import compilation  # pylint: disable=g-import-not-at-top
  count = lambda: sum(1 for _ in open("/proc/self/maps"))
  compilation.release_compiled()
  before = count()
  tokens, lengths = _prompts(b=2)
  jax.block_until_ready(_spec(tokens, lengths, mode="rejection", temperature=1.0, max_new=4))
  compiled = count()
  compilation.release_compiled()
  assert compiled - before > 100, (before, compiled)
  assert count() - before < 0.2 * (compiled - before), (before, compiled, count())


# A reduced draft vocabulary that leaves out two of the tokens the partly trained model
# writes most (its cyclic tokens are 3..9): q is 0 there, the verification covers them.
_DRAFT_VOCAB = np.array([0, 1, 2, 3, 4, 5, 6, 9, 10, 11], np.int32)

# ------------------------------------------------------- exactness over whole sequences
# Every sampler must emit the autoregressive law over whole sequences, not only over its
# first tokens: the first token comes from the prefill, and the first bonus token of K = 3
# sits at position 5. One prompt, LAW_ROWS rows, the first LAW_TOKENS tokens (no stop
# token, so every row has them all), against autoregressive sampling of the same policy: a
# two-sample chi-square test of the marginal at every position 1..LAW_TOKENS and of every
# consecutive pair, with Holm's correction over those 23 tests at a family-wise level of
# LAW_ALPHA (fixed before any result was seen). Each sampler's test also runs the same check
# on two deliberately broken verifications, which must fail it at positions beyond 3: a
# rejected draft resampled from p instead of the residual norm(max(p - q, 0)) (block: of
# max(w p - q, 0)), and the bonus token drawn from the last draft's distribution p_K
# instead of p_{K+1}. The intact and the broken runs of a sampler share one compiled
# program: which verification is broken, if any, is an argument of the program
# (`_SwitchableProgram`).

LAW_ROWS = 3072
LAW_TOKENS = 12
LAW_ALPHA = 1e-3
_LAW_PROMPT = (3, 4, 5, 6)
_LAW_SAMPLERS = {  # id: (fixed K = 3, or adaptive with K forced to switch; mode; reduced vocab)
    "rejection": ("fixed", "rejection", False),
    "block": ("fixed", "block", False),
    "rejection-reduced-vocab": ("fixed", "rejection", True),
    "block-reduced-vocab": ("fixed", "block", True),
    "adaptive-rejection": ("adaptive", "rejection", False),
    "adaptive-block": ("adaptive", "block", False),
}
_FORCED_K = (1, 0, 3)  # K of segment i mod 3: 1 -> 0 (autoregressive steps) -> 3 -> 1 ...
_LAW_CACHE = 24  # the prompt, LAW_TOKENS and K + 1 positions of lookahead fit
_BREAKS = (None, "residual", "bonus")  # what `_verification` breaks (None: nothing)


def _law_prompts():
  return (jnp.asarray(np.tile(np.array(_LAW_PROMPT, np.int32), (LAW_ROWS, 1))),
          jnp.full((LAW_ROWS,), len(_LAW_PROMPT), jnp.int32))


@pytest.fixture(scope="module")
def autoregressive_law(partly_trained):
  """[LAW_ROWS, LAW_TOKENS] autoregressive samples of the partly trained policy: every
  sampler's reference."""
  graphdef, params_state = partly_trained
  tokens, lengths = _law_prompts()
  out = autoregressive.generate(graphdef, params_state, tokens, lengths, jax.random.key(2),
                                max_new_tokens=LAW_TOKENS, cache_length=_LAW_CACHE,
                                params=sampling.SamplingParams(1.0), stop_tokens=())
  return np.asarray(out.tokens)


def _law_pvalues(sample: np.ndarray, reference: np.ndarray) -> dict[tuple[int, ...], float]:
  """{positions: p-value} of two-sample chi-square tests (homogeneity of a 2 x cells table)
  of the token at every position 1..L and of every consecutive pair of positions, between
  two [rows, L] samples. Cells seen fewer than 20 times in both samples together are pooled
  into one, itself left out when it is that small too, so that every expected count is
  at least ~10 (a test on the cells kept: equal laws give equal laws on them)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  vocab = int(max(sample.max(), reference.max())) + 1

  def pvalue(a, c):
    cells, index = np.unique(np.concatenate([a, c]), return_inverse=True)
    counts = np.stack([np.bincount(index[:len(a)], minlength=len(cells)),
                       np.bincount(index[len(a):], minlength=len(cells))])
    common = counts.sum(0) >= 20
    table = np.concatenate([counts[:, common], counts[:, ~common].sum(1, keepdims=True)], 1)
    table = table[:, table.sum(0) >= 20]
    return float(stats.chi2_contingency(table)[1]) if table.shape[1] > 1 else 1.0

  length = sample.shape[1]
  tests = {(i + 1,): pvalue(sample[:, i], reference[:, i]) for i in range(length)}
  for i in range(length - 1):
    tests[(i + 1, i + 2)] = pvalue(sample[:, i] * vocab + sample[:, i + 1],
                                   reference[:, i] * vocab + reference[:, i + 1])
  return tests


_SWITCH = {}  # "broken": what the programs break now (host); "traced": its index, traced


class _SwitchableProgram(speculative._ModeArgument):  # pylint: disable=protected-access
  """The decoding function of one of the library's programs (speculative.generate or
  segment) as a program of its own, traced afresh under `_verification`'s patches (the
  library's compiled programs are left alone): the library's code, with which verification
  helper is broken, if any, an argument of the program, not of its compilation. It rides on
  the mode index (index + len(SAMPLED_MODES) * _BREAKS.index(broken)), which the program
  splits again before the decoding function sees it, so one compiled program serves the
  intact run and both broken ones. (Intact, it computes what the library's program does:
  for every sampler below, their tokens were equal bit for bit.)"""

  def __init__(self, library_program, **jit_kwargs):
    fn = library_program._jitted.__wrapped__  # pylint: disable=protected-access
    modes = len(verify_lib.SAMPLED_MODES)

    @functools.wraps(fn)
    def traced_afresh(*args, mode_index, **kwargs):
      _SWITCH["traced"] = mode_index // modes
      try:
        return fn(*args, mode_index=mode_index % modes, **kwargs)
      finally:
        del _SWITCH["traced"]
    super().__init__(jax.jit(traced_afresh, **jit_kwargs))

  @staticmethod
  def _translate(kwargs):
    kwargs = speculative._ModeArgument._translate(kwargs)  # pylint: disable=protected-access
    return dict(kwargs, mode_index=np.int32(
        kwargs["mode_index"] + len(verify_lib.SAMPLED_MODES) * _BREAKS.index(_SWITCH["broken"])))


@pytest.fixture(scope="module")
def law_programs():
  """`speculative.generate` and `speculative.segment` as `_SwitchableProgram`s (the library's
  static arguments), shared by every sampler of the module."""
  return dict(generate=_SwitchableProgram(
                  speculative.generate,
                  static_argnames=speculative._FIRST_STATIC),  # pylint: disable=protected-access
              segment=_SwitchableProgram(
                  speculative.segment,
                  static_argnames=("graphdef", "params", "program", "k", "catch_up_chunk"),
                  donate_argnames=("decode_state",)))


@contextlib.contextmanager
def _verification(programs, broken: str | None):
  """Decoding through `programs`, with the verification intact (broken=None) or with one part
  broken: "residual", a rejected draft resampled from p instead of the residual
  (verification.residual_probs, and block_residual_probs for block), or "bonus", the token
  after K accepted drafts drawn from p_K, the distribution that scored the last draft,
  instead of p_{K+1} (verification.bonus_probs). Each patched helper returns the library
  helper's own result unless its part is the one broken."""
  residual, block_residual, bonus = (verify_lib.residual_probs, verify_lib.block_residual_probs,
                                     verify_lib.bonus_probs)
  now = lambda part: _SWITCH["traced"] == _BREAKS.index(part)  # traced

  def residual_or_p(draft_tokens, draft_probs, target_probs, mode):
    k = draft_tokens.shape[1]
    return jnp.where(now("residual"), target_probs[:, :k],
                     residual(draft_tokens, draft_probs, target_probs, mode))

  def block_residual_or_p(w, draft_probs, target_probs):
    k = draft_probs.shape[1]
    return jnp.where(now("residual"), target_probs[:, :k],
                     block_residual(w, draft_probs, target_probs))

  def bonus_or_the_last_drafts(target_probs):
    return jnp.where(now("bonus"), target_probs[:, -2:-1], bonus(target_probs))

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(verify_lib, "residual_probs", residual_or_p)
    patch.setattr(verify_lib, "block_residual_probs", block_residual_or_p)
    patch.setattr(verify_lib, "bonus_probs", bonus_or_the_last_drafts)
    patch.setattr(speculative, "generate", programs["generate"])
    patch.setattr(speculative, "segment", programs["segment"])
    patch.setitem(_SWITCH, "broken", broken)
    yield


def _law_sample(policy, programs, sampler: str, broken: str | None = None):
  """(tokens [LAW_ROWS, LAW_TOKENS], per-depth acceptance [3]) of one sampler, its
  verification intact or `broken` (`_verification`)."""
  kind, mode, draft_vocab = _LAW_SAMPLERS[sampler]
  graphdef, params_state = policy
  tokens, lengths = _law_prompts()
  common = dict(max_new_tokens=LAW_TOKENS, cache_length=_LAW_CACHE,
                params=sampling.SamplingParams(1.0), mode=mode, stop_tokens=())
  with _verification(programs, broken):
    if kind == "adaptive":
      from bebop_jax.decoding import adaptive, segments  # pylint: disable=g-import-not-at-top
      out, st = segments.generate(
          graphdef, params_state, tokens, lengths, jax.random.key(1),
          schedule=lambda i: _FORCED_K[i % len(_FORCED_K)],
          settings=adaptive.Settings(k_max=3, segment=1, compact=False), **common)
      assert set(st.k_iterations) == set(_FORCED_K), st.k_iterations
    else:
      out = speculative.generate(
          graphdef, params_state, tokens, lengths, jax.random.key(1),
          draft_vocab=jnp.asarray(_DRAFT_VOCAB) if draft_vocab else None, **common)
  np.testing.assert_array_equal(np.asarray(out.lengths), LAW_TOKENS)
  acceptance = np.asarray(out.accepted).sum(0) / np.asarray(out.attempted).sum(0)
  return np.asarray(out.tokens), acceptance


@pytest.mark.parametrize("sampler", list(_LAW_SAMPLERS))
def test_every_sampler_emits_the_autoregressive_law_over_whole_sequences(
    partly_trained, autoregressive_law, law_programs, sampler):
  """Fixed K = 3 (rejection, block, each also with a reduced draft vocabulary that never
  proposes two of the policy's frequent tokens) and adaptive decoding with K forced to
  switch at every iteration (1, 0, 3, 1, ...: autoregressive steps between drafting ones,
  depths left behind caught up): the marginal of every position 1..12 and of every
  consecutive pair is autoregressive sampling's (the section's comment). The drafts are
  partly right at every depth (acceptance ~0.9 per depth, ~0.6-0.8 with the reduced
  vocabulary; printed), so rejections, residuals and bonus tokens occur at every depth.
  Both broken verifications fail the same check at positions beyond 3."""
  tokens, acceptance = _law_sample(partly_trained, law_programs, sampler)
  print(f"\n{sampler}: acceptance per depth {np.round(acceptance, 3).tolist()}")
  assert ((0.2 < acceptance) & (acceptance < 0.95)).all(), acceptance
  pvalues = _law_pvalues(tokens, autoregressive_law)
  rejected = multiple_testing.holm(pvalues, LAW_ALPHA)
  print(f"  intact: least p-value {min(pvalues.values()):.2g} "
        f"at {min(pvalues, key=pvalues.get)}, rejected {rejected}")
  assert not rejected, {name: pvalues[name] for name in rejected}
  for broken in _BREAKS[1:]:
    pvalues = _law_pvalues(_law_sample(partly_trained, law_programs, sampler, broken)[0],
                           autoregressive_law)
    rejected = multiple_testing.holm(pvalues, LAW_ALPHA)
    beyond = [name for name in rejected if min(name) > 3]
    print(f"  broken {broken}: rejected {len(rejected)} of {len(pvalues)}, beyond position "
          f"3: " + ", ".join(f"{name} p={pvalues[name]:.1g}" for name in beyond))
    assert beyond, (broken, {name: pvalues[name] for name in rejected})


def test_a_full_draft_vocabulary_decodes_as_none_and_a_reduced_one_drafts_inside_it(
    partly_trained):
  """draft_vocab = every id decodes bitwise as no draft vocabulary (same shapes, same noise);
  a reduced one never accepts a draft outside it, and mtp_step's sub-head logits are the
  full head's columns."""
  graphdef, params_state = partly_trained
  tokens, lengths = _prompts(b=4, seed=4)
  tokens = jnp.clip(tokens % 12, 3, 11)
  kw = dict(max_new_tokens=24, cache_length=64, params=sampling.SamplingParams(1.0),
            mode="rejection", stop_tokens=())
  vocab = model_config.preset("tiny").vocab_size
  base = speculative.generate(graphdef, params_state, tokens, lengths, jax.random.key(4), **kw)
  full = speculative.generate(graphdef, params_state, tokens, lengths, jax.random.key(4),
                              draft_vocab=jnp.arange(vocab, dtype=jnp.int32), **kw)
  for field in ("tokens", "lengths", "accepted", "attempted"):
    np.testing.assert_array_equal(np.asarray(getattr(full, field)),
                                  np.asarray(getattr(base, field)))
  sub = speculative.generate(graphdef, params_state, tokens, lengths, jax.random.key(4),
                             draft_vocab=jnp.asarray(_DRAFT_VOCAB), **kw)
  assert int(np.asarray(sub.accepted).sum()) > 0
  assert (int(np.asarray(sub.accepted).sum()) < int(np.asarray(base.accepted).sum())), (
      "leaving out frequent tokens should cost acceptance")
  model = nnx.merge(graphdef, params_state)
  cache = model.init_cache(4, 64)
  _, h0, cache = model.prefill(cache, tokens)
  start = jnp.zeros((4,), jnp.int32)
  at = jnp.full((4,), 2, jnp.int32)
  full_logits, _, _ = model.mtp_step(cache, 1, h0[:, :4], tokens[:, 1:5], start, at)
  head = model.decode_weights()["shared"]["head"]
  sub_logits, _, _ = model.mtp_step(cache, 1, h0[:, :4], tokens[:, 1:5], start, at,
                                    draft_head=head[:, _DRAFT_VOCAB])
  np.testing.assert_allclose(np.asarray(sub_logits),
                             np.asarray(full_logits)[:, _DRAFT_VOCAB], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ adaptive draft length


def _adaptive(graphdef, state, tokens, lengths, seed, *, schedule, k_max, segment=1,
              compact=True, max_new=24, cache_length=64, temperature=1.0, mode="rejection",
              stop_tokens=STOP, batch_factor=2):
  from bebop_jax.decoding import adaptive, segments  # pylint: disable=g-import-not-at-top
  return segments.generate(
      graphdef, state, tokens, lengths, jax.random.key(seed), max_new_tokens=max_new,
      cache_length=cache_length, params=sampling.SamplingParams(temperature), mode=mode,
      stop_tokens=stop_tokens, schedule=schedule,
      settings=adaptive.Settings(k_max=k_max, segment=segment, compact=compact,
                                 batch_factor=batch_factor))


def test_adaptive_decoding_at_temperature_zero_is_greedy_decoding_whatever_k_and_batch():
  """exact mode emits argmax p whatever the drafts, so every schedule of K and every
  gathering of the live rows into smaller batches must give greedy decoding's tokens; the
  rows finish at different times (stop token), so the batch shrinks from 4 to 2 and 1."""
  tokens, lengths = _prompts(b=4, seed=6)
  greedy = lambda stops: autoregressive.generate(
      GRAPHDEF, STATE, tokens, lengths, jax.random.key(0), max_new_tokens=24,
      cache_length=64, params=sampling.SamplingParams(0.0), stop_tokens=stops)
  # Stop tokens the greedy rows write at different times.
  free = np.asarray(greedy(()).tokens)
  stops = tuple(sorted({int(free[0, 3]), int(free[1, 9])}))
  ar = greedy(stops)
  out, st = _adaptive(GRAPHDEF, STATE, tokens, lengths, 0, k_max=2, segment=2,
                      schedule=lambda i: (2, 0, 1)[i % 3], temperature=0.0, mode="exact",
                      stop_tokens=stops)
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ar.lengths))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
  assert {batch for _, _, batch in st.segments} > {4}  # rows left the batch
  assert len(set(np.asarray(ar.lengths))) > 2
  n = np.asarray(out.lengths)
  np.testing.assert_array_equal(np.asarray(out.policy_mask).sum(1), n)
  # Every token after the first is emitted by a counted forward.
  np.testing.assert_array_equal(np.asarray(out.emitted_by_forwards), n - 1)
  assert sum(st.k_iterations.values()) == int(out.target_forwards)


def test_depth_caches_catch_up_after_segments_with_fewer_drafts():
  """After a prefill of the main cache only (as adaptive decoding's), autoregressive steps
  (K = 0) and a segment with one draft, a segment with three first brings every depth up to
  date: all depth-cache entries below the window, the prompt's included, equal a fresh
  prefill of the committed sequence (as the fixed-K invariant test above)."""
  tokens, lengths = _prompts(b=4, seed=3)
  k = GRAPHDEF_K
  params = sampling.SamplingParams(1.0)
  ds = speculative.prefill(GRAPHDEF, STATE, tokens, lengths, jax.random.key(2),
                           max_new_tokens=40, cache_length=64, params=params, stop_tokens=(),
                           draft_prefill=False)
  np.testing.assert_array_equal(np.asarray(ds.synced), 0)
  for depth, iterations in ((0, 7), (1, 3), (k, 3)):
    ds = speculative.segment(GRAPHDEF, STATE, ds, jnp.int32(iterations), k=depth,
                             params=params, mode="rejection")
  n_all = np.asarray(ds.frontier)
  np.testing.assert_array_equal(np.asarray(ds.synced), np.maximum(n_all - k, 0)[:, None]
                                * np.ones((1, k), int))
  model = nnx.merge(GRAPHDEF, STATE)
  _, _, fresh = jax.jit(lambda x: model.prefill(model.init_cache(4, 64), x))(
      ds.seq[:, :int(n_all.max()) + 2])
  for row, n in enumerate(n_all):
    assert n - k > int(lengths[row]) + 7  # the autoregressive steps' positions are checked
    for name in ("k", "v"):
      for depth in range(1, k + 1):
        np.testing.assert_allclose(
            np.asarray(ds.cache.mtp.stacked(name)[depth - 1, row, :, :n - k]),
            np.asarray(fresh.mtp.stacked(name)[depth - 1, row, :, :n - k]), atol=2e-5,
            err_msg=f"row {row} depth {depth} {name}")


def _dots(fn, *args, **kwargs) -> int:
  """dot_general equations in fn's jaxpr, sub-jaxprs (loops, conditionals) included."""
  def count(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
      total += eqn.primitive.name == "dot_general"
      for sub in jax.core.jaxprs_in_params(eqn.params):
        total += count(sub)
    return total
  return count(jax.make_jaxpr(functools.partial(fn, **kwargs))(*args).jaxpr)


def test_k_zero_is_the_autoregressive_step_with_no_speculative_ops():
  """The K = 0 segment's program holds exactly the matmuls of one target forward over one
  token (no MTP depth, no draft head); K = 1 adds a depth's."""
  tokens, lengths = _prompts(b=2)
  params = sampling.SamplingParams(1.0)
  ds = speculative.prefill(GRAPHDEF, STATE, tokens, lengths, jax.random.key(0),
                           max_new_tokens=8, cache_length=32, params=params, stop_tokens=())
  model = nnx.merge(GRAPHDEF, STATE)
  one_step = _dots(lambda c, t, p: model.step(c, t, p, weights=model.loop_weights()),
                   ds.cache, tokens[:, :1], lengths)
  seg = lambda k: _dots(speculative._segment, GRAPHDEF, STATE, ds, jnp.int32(4),  # pylint: disable=protected-access
                        k=k, params=params, program="sampled", mode_index=jnp.int32(0))
  assert seg(0) == one_step
  assert seg(1) > one_step


def test_adaptive_decoding_calibrates_once_and_compiles_one_program_per_k_and_batch():
  from bebop_jax.decoding import adaptive, segments  # pylint: disable=g-import-not-at-top
  tokens, lengths = _prompts(b=2, seed=8)
  settings = adaptive.Settings(k_max=1, segment=2, calibration_iterations=2, host_fraction=1.0)
  run = lambda seed, schedule=None: segments.generate(
      GRAPHDEF, STATE, tokens, lengths, jax.random.key(seed), max_new_tokens=24,
      cache_length=64, params=sampling.SamplingParams(1.0), mode="rejection",
      stop_tokens=STOP, settings=settings, schedule=schedule)
  # Every call's seconds count towards its K's call residual, the first call's too: no
  # program may be traced or compiled inside a call's timed span, only in the calibration
  # before it.
  traced = []
  listener = lambda event, _, **kw: (traced.append(time.perf_counter())
                                     if event.startswith("/jax/core/compile/") else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    out, st = run(0)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  call = st.table.pending  # the call's measurement, settled during the next call
  assert traced and call.k_iterations == st.k_iterations and call.end > call.start
  assert max(traced) < call.start  # the calibration compiled, before the call's span
  assert {(e["k"], e["rows"]) for e in st.table.to_json()} == {(0, 1), (0, 2), (1, 1), (1, 2)}
  assert st.calibration_s > 0
  # pylint: disable=protected-access
  sizes = lambda: (speculative.segment._cache_size(), segments._rows._cache_size(),
                   segments._put_rows._cache_size())
  before = sizes()
  runs = [run(seed) for seed in (1, 2)]
  # Calls with K = 1 and 0 by force (the rule's choices and segment lengths depend on
  # timings), so that rows finish at different segments and leave the batch.
  forced = [run(seed, schedule=lambda i: (i + 1) % 2) for seed in (3, 4, 5, 6)]
  out2, st2 = runs[0]
  assert st2.table is st.table  # cached for the run and shape
  # ... and for the model: a new graphdef of it (a restarted stage) reuses the calibration.
  graphdef2, state2 = nnx.split(nnx.merge(GRAPHDEF, STATE))
  assert graphdef2 is not GRAPHDEF
  _, st3 = segments.generate(
      graphdef2, state2, tokens, lengths, jax.random.key(7), max_new_tokens=24,
      cache_length=64, params=sampling.SamplingParams(1.0), mode="rejection",
      stop_tokens=STOP, settings=settings)
  assert st3.table is st.table and st3.calibration_s == 0
  assert set(st.table.overhead) == {1, 2} and st.table.overhead[1] > 0
  # Nothing compiles in steady state: segments, and the gathers and puts of compaction
  # (compiled with the calibration).
  assert sizes() == before
  assert any(batch == 1 for _, st_ in forced for _, _, batch in st_.segments)  # rows left
  for out_, st_ in runs + forced:
    assert sum(st_.k_iterations.values()) == int(out_.target_forwards)
    assert all(0 <= k <= 1 for k in st_.k_iterations)
  # Every call the rule chose for is counted by its first K and its measured seconds
  # correct the model (call residuals); the prefill was timed with the table.
  table = st.table  # the calls the rule chose for: runs 0-2 settled, the new graphdef's pending
  assert sum(table.calls.values()) == 3 and table.pending is not None
  assert set(table.planned) == {None}  # the next call's first choice, made during this one
  table.settle()
  assert sum(table.calls.values()) == 4 and table.prefill > 0 and table.pending is None
  assert {k: len(m) for k, m in table.call_misses.items()} == table.calls


def test_a_new_prompt_bucket_starts_from_the_nearest_buckets_call_experience():
  """`segments._table` per prompt bucket (cache length): a new bucket's table takes the
  nearest existing bucket's call length and call misses as its prior, copied; tables of
  other calls (another batch) are not its siblings."""
  from bebop_jax.decoding import adaptive, segments  # pylint: disable=g-import-not-at-top
  settings = adaptive.Settings(k_max=2, calibrate=False)
  params = sampling.SamplingParams(1.0)
  table = lambda cache_length, batch=3: segments._table(  # pylint: disable=protected-access
      GRAPHDEF, STATE, None, settings=settings, rows=[batch], params=params,
      mode="block", draft_vocab=None, cache_length=cache_length, batch=batch,
      max_new_tokens=17, depths=2)[0]
  short, long = table(101), table(301)
  assert long.tokens_per_row is None and not long.call_misses  # nothing to seed from yet
  short.observe_call(9.0, 0.5, k=1, seconds=2.0, modelled=1.0)
  long.observe_call(30.0, 0.5, k=2, seconds=5.0, modelled=1.0)
  near_long = table(251)
  assert near_long.tokens_per_row == 30.0 and near_long.call_misses == {2: [4.0]}
  near_long.call_misses[2].append(0.0)
  assert long.call_misses == {2: [4.0]}  # a copy
  assert table(121).call_misses == {1: [1.0]}
  assert table(101) is short  # cached
  assert table(251, batch=5).tokens_per_row is None  # another batch: no sibling
