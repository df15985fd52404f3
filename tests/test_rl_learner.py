"""The RL learner's batch arithmetic and bookkeeping against definitions: Dr. GRPO's constant
normaliser, gradient accumulation over packed rows, how metrics of micro-batches and
updates combine, truncated completions (rl.overlong), the policy-version bookkeeping of
interrupt mode, and the weight copies the rollout side keeps alive."""

import contextlib
import gc
import logging
import weakref

import jax
import numpy as np
import pytest

from bebop_jax.stages import config as config_lib
from bebop_jax import rollout
from bebop_jax import settings_base
from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data.tokenizer import load_tokenizer
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.rl import algorithms, async_loop, learner
from bebop_jax.rl import placement as placement_lib
from bebop_jax.rl.settings import PlacementSettings, RLSettings
from bebop_jax.stages import rl as stage
from bebop_jax.train import metrics as metrics_lib

CONFIG = model_config.preset("tiny")
MESH = sharding.make_mesh((1,), ("data",), devices=jax.devices()[:1])
RULES = tuple(tuple(r) for r in sharding.DEFAULT_RULES)
CHAR = load_tokenizer("char")  # the tokenizer the engines here are handed
G = 4


def _rl_settings(**overrides) -> RLSettings:
  """The default RL settings with 6 prompts of G rollouts, 32-token prompts and
  completions, and `overrides` by dotted key (the section alone: the learners here run on
  one device, not on the config's mesh)."""
  rl = config_lib.base_config().rl
  rl.prompts_per_batch, rl.group_size = 6, G
  rl.max_prompt_len = 32
  rl.rollout.max_new_tokens = 32
  for key, value in overrides.items():
    target = rl
    *path, last = key.split(".")
    for part in path:
      target = target[part]
    target[last] = value
  return settings_base.build(RLSettings, rl.to_dict(), "rl")


def _rollouts(rows, max_new_tokens=32, seed=0):
  """Math rollouts from a scripted policy: right and wrong answers of different lengths in
  every group (a wrong answer padded with digits until the budget cuts it)."""
  math = tasks_lib.get_task("math")
  exs = [math.sample(i // G) for i in range(rows)]

  def answer(ex, row, _):
    if row % 3 == 0:
      return ex.demonstration
    return "=1\n<|answer|>" + str(row) * (1 + 12 * (row % 2))

  return rollout.MockEngine({"math": math}, answer, rollout.RolloutSettings(
      engine="autoregressive", max_new_tokens=max_new_tokens), tokenizer=CHAR).generate(
          exs, jax.random.key(seed))


# ----------------------------------------------------------------------------- Dr. GRPO


@pytest.mark.parametrize("packing", [False, True])
def test_dr_grpo_weights_do_not_depend_on_padding_or_dropped_groups(packing):
  """seq-mean-token-sum-norm gives every token 1 / (rows per update x max_new_tokens): the
  same batch padded to two widths, and with groups dropped, weighs each remaining token
  the same."""
  rl = _rl_settings(aggregation="seq-mean-token-sum-norm", packing=packing)
  r = _rollouts(rl.prompts_per_batch * G)
  lengths = r.prompt_lengths + r.lengths
  adv = np.asarray(algorithms.advantages(r.rewards, G))
  keep = np.ones(len(lengths), bool)
  keep[G:3 * G] = False  # two groups dropped (e.g. by dynamic sampling)
  want = 1.0 / (rl.prompts_per_batch * G * rl.rollout.max_new_tokens)
  policy_tokens = r.policy_mask.sum(1)
  for width, kept in ((64, None), (128, None), (64, keep)):
    full = learner.learner_batch(r, adv, width, kept)
    parts = learner.update_batches(rl, full, lengths, seq_len=128,
                                   rows_buckets=learner.row_buckets(len(lengths)))
    weights = np.concatenate([p["token_weights"][p["mask"] > 0] for p in parts])
    rows = np.ones(len(lengths), bool) if kept is None else kept
    assert len(weights) == policy_tokens[rows].sum()
    np.testing.assert_allclose(weights, want, rtol=1e-6)
  assert learner.drgrpo_norm(rl) == rl.prompts_per_batch * G * rl.rollout.max_new_tokens


def test_dr_grpo_without_its_constant_is_an_error():
  with pytest.raises(ValueError, match="needs norm"):
    algorithms.aggregation_weights(np.ones((2, 3)), "seq-mean-token-sum-norm")


# --------------------------------------------------------------- metrics of micro-batches


def test_combine_takes_maxima_sums_counts_and_weights_means_by_tokens():
  parts = {"loss": np.array([0.5, 1.5, 0.0]), "ratio_mean": np.array([1.0, 2.0, 0.0]),
           "logprob_diff_max": np.array([0.1, 0.3, 0.0]), "tokens": np.array([3.0, 1.0, 0.0])}
  got = metrics_lib.combine(parts)
  assert got["loss"] == pytest.approx(2.0 / 3)             # plain mean: already weighted
  assert got["ratio_mean"] == pytest.approx((3 * 1.0 + 1 * 2.0) / 4)  # the empty part: 0
  assert got["logprob_diff_max"] == pytest.approx(0.3)
  assert got["tokens"] == 4.0
  no_counts = metrics_lib.combine({"alpha_1": np.array([0.2, 0.4])})
  assert no_counts["alpha_1"] == pytest.approx(0.3)


# --------------------------------------------------------------- gradient accumulation


@pytest.fixture(scope="module")
def tiny_policy():
  return policy_lib.init(CONFIG, seed=3)


def _trained(graphdef, params, rl, rollouts):
  learn = learner.Learner(rl, graphdef, jax.tree.map(np.copy, params), mesh=MESH,
                          rules=RULES, seq_len=rl.max_prompt_len + rl.rollout.max_new_tokens)
  metrics = learn.update(rollouts, 0)
  return learn, metrics


def test_gradient_accumulation_3_and_8_with_packing_equal_one_update(tiny_policy):
  """Packed updates come in row buckets that every accepted accumulation splits: 24
  rollouts packed into a few rows run with grad_accum_steps 3 and 8 (today's buckets were
  multiples of 4 and failed the micro-batch split), and give the parameters and metrics of
  the same update without accumulation (maxima stay maxima, means weigh micro-batches by
  their tokens)."""
  graphdef, params = tiny_policy
  rollouts = _rollouts(24)
  runs = {}
  for accum in (1, 3, 8):
    rl = _rl_settings(**{"train.grad_accum_steps": accum})
    learn, metrics = _trained(graphdef, params, rl, rollouts)
    assert all(r % accum == 0 for r in learn.row_buckets)
    assert metrics["learner_rows"] < learn.update_rows  # packed into fewer rows
    runs[accum] = (jax.tree.leaves(learn.trunk), metrics)
  base_leaves, base = runs[1]
  for accum in (3, 8):
    leaves, m = runs[accum]
    for a, b in zip(base_leaves, leaves):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)
    for key in ("loss", "ratio_mean", "logprob_diff_mean", "logprob_diff_max", "kl_behaviour",
                "clip_frac_low", "clip_frac_high", "tokens", "sampler_learner_logprob_diff_max"):
      np.testing.assert_allclose(m[key], base[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_row_buckets_split_over_accumulation_and_devices():
  assert learner.row_buckets(24, 1, 3) == (6, 12, 18, 24)
  assert learner.row_buckets(32, 2, 8) == (16, 32)
  assert learner.row_buckets(24, 1, 1) == (4, 8, 12, 16, 20, 24)
  with pytest.raises(ValueError, match="does not split"):
    learner.row_buckets(20, 1, 3)


# --------------------------------------------------------------- fused or dense head


def test_fused_head_gives_the_dense_heads_policy_loss_metrics_and_gradients(tiny_policy):
  """The real policy loss (rl.head) on a packed update batch with the decoupled objective
  and the k3 KL to a reference and an entropy bonus, at temperature 0.7: the fused head (no
  [B, T, V] logits) against the dense one, in the loss, every metric (the entropy included)
  and every trunk parameter's gradient; and the log-probs of the reference / proximal
  forward."""
  graphdef, params = tiny_policy
  rollouts = _rollouts(8)
  lengths = rollouts.prompt_lengths + rollouts.lengths
  full = learner.learner_batch(rollouts, np.asarray(algorithms.advantages(rollouts.rewards, G)),
                               64)
  rng = np.random.default_rng(0)
  near = lambda: np.where(full["mask"] > 0, full["behaviour_logprobs"] +
                          0.1 * rng.normal(size=full["mask"].shape), 0.0).astype(np.float32)
  full.update(ref_logprobs=near(), proximal_logprobs=near())
  rl = _rl_settings(prompts_per_batch=2, kl_coef=0.1, **{"rollout.temperature": 0.7})
  batch = learner.update_batches(rl, full, lengths, seq_len=64,
                                 rows_buckets=learner.row_buckets(8))[0]
  assert batch["segment_ids"].max() > 1  # packed
  sampling_params = learner.sampling.SamplingParams(0.7, 0, 1.0)
  model = learner.nnx.merge(graphdef, params)
  _, trunk, rest = learner.nnx.split(model, learner.optimizer_lib.trainable_filter("main"), ...)

  def loss_grad_and_logprobs(head, trunk):
    loss_fn = learner.make_policy_loss_fn(sampling_params, clip_low=0.2, clip_high=0.28,
                                          aggregation="token-mean", kl_coef=0.1, is_cap=2.0,
                                          head=head, entropy_coef=0.05)
    merge = lambda t: learner.nnx.merge(graphdef, t, rest)
    lp = learner.token_logprobs(merge(trunk), batch["tokens"], batch["segment_ids"],
                                sampling_params, batch["positions"], head=head)
    return jax.value_and_grad(lambda t: loss_fn(merge(t), batch), has_aux=True)(trunk), lp

  @jax.jit
  def run(trunk):  # both heads in one program
    return {head: loss_grad_and_logprobs(head, trunk) for head in ("fused", "dense")}

  out = jax.device_get(run(trunk))
  ((loss_f, m_f), g_f), lp_f = out["fused"]
  ((loss_d, m_d), g_d), lp_d = out["dense"]
  m = batch["mask"] > 0
  np.testing.assert_allclose(lp_f[m], lp_d[m], rtol=1e-5, atol=1e-6)
  assert abs(float(loss_d)) > 1e-4 and m_d["kl"] > 0 and m_d["entropy"] > 0
  np.testing.assert_allclose(loss_f, loss_d, rtol=1e-5)
  assert set(m_f) == set(m_d) and "entropy" in m_d
  for name in m_d:
    np.testing.assert_allclose(m_f[name], m_d[name], rtol=1e-5, atol=1e-7, err_msg=name)
  # Entries are float32 sums over the batch with cancellation: the absolute tolerance is
  # relative to the tensor's scale (the embedding gradient reaches ~20 here).
  flat_f = dict(jax.tree_util.tree_leaves_with_path(g_f))
  for path, g in jax.tree_util.tree_leaves_with_path(g_d):
    np.testing.assert_allclose(flat_f[path], g, rtol=1e-4, atol=1e-6 * max(np.abs(g).max(), 1),
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("truncation", [dict(top_k=5), dict(top_p=0.9)], ids=str)
def test_top_k_top_p_fall_back_to_dense_with_one_warning(tiny_policy, truncation, monkeypatch,
                                                         caplog):
  """An exact top-k / top-p truncation needs a row's every logit: rl.head "fused" then
  gives the truncated distribution's log-probs by the dense head (-inf outside the kept
  set), with one warning naming the config keys however many programs trace it."""
  graphdef, params = tiny_policy
  monkeypatch.setattr(learner, "_warned_truncation", False)
  sampling_params = learner.sampling.SamplingParams(1.0, truncation.get("top_k", 0),
                                                    truncation.get("top_p", 1.0))
  assert learner.truncates(sampling_params, CONFIG.vocab_size)
  assert not learner.truncates(learner.sampling.SamplingParams(1.0, CONFIG.vocab_size, 1.0),
                               CONFIG.vocab_size)
  tokens = np.random.default_rng(0).integers(3, 100, (2, 16)).astype(np.int32)
  segments = np.ones_like(tokens)
  with caplog.at_level(logging.WARNING):
    assert learner.resolve_head("fused", sampling_params, CONFIG.vocab_size) == "dense"
    fused = learner.make_logprobs_fn(graphdef, sampling_params, head="fused")(
        params, {}, tokens, segments)
    loss_fn = learner.make_policy_loss_fn(sampling_params, clip_low=0.2, clip_high=0.2,
                                          aggregation="token-mean", head="fused")
    batch = learner.example_batch(_rl_settings(), 2, 16)
    jax.eval_shape(lambda p: loss_fn(learner.nnx.merge(graphdef, p), batch), params)
  dense = learner.make_logprobs_fn(graphdef, sampling_params, head="dense")(
      params, {}, tokens, segments)
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(dense))
  assert np.isneginf(np.asarray(fused)).any()  # tokens outside the kept set
  warnings = [r.getMessage() for r in caplog.records if "rl.rollout.top_k" in r.getMessage()]
  assert len(warnings) == 1, warnings
  assert "rl.head='fused'" in warnings[0] and "rl.rollout.top_p" in warnings[0]


# --------------------------------------------------------------- truncated completions


def test_overlong_penalty_is_dapos_soft_punishment():
  lengths = np.array([0, 90, 96, 97, 110, 128])
  want = [0.0 if n <= 96 else max(-1.0, (96 - n) / 32) for n in lengths]
  np.testing.assert_allclose(np.asarray(algorithms.overlong_penalty(lengths, 128, 32)), want,
                             rtol=1e-6)


@pytest.mark.parametrize("mode", algorithms.OVERLONG_MODES)
def test_truncated_completions_follow_rl_overlong(tiny_policy, mode):
  """keep trains on cut completions, mask leaves them out of the loss, penalty adds DAPO's
  punishment to the rewards the advantages come from."""
  graphdef, params = tiny_policy
  rl = _rl_settings(overlong=mode, overlong_buffer=8, **{"rollout.max_new_tokens": 12})
  rollouts = _rollouts(24, max_new_tokens=12)
  assert 0 < rollouts.truncated.sum() < 24
  learn = learner.Learner(rl, graphdef, jax.tree.map(np.copy, params), mesh=MESH,
                          rules=RULES, seq_len=44)
  seen = {}
  real = learner.update_batches

  def spy(rl_, full, lengths, **kw):
    seen["mask"], seen["adv"] = full["mask"].copy(), full["advantages"].copy()
    return real(rl_, full, lengths, **kw)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(learner, "update_batches", spy)
    metrics = learn.update(rollouts, 0)
  cut = rollouts.truncated
  assert metrics["truncated_frac"] == pytest.approx(cut.mean())
  rows_trained = seen["mask"].sum(1) > 0
  if mode == "mask":
    assert not rows_trained[cut].any() and rows_trained[~cut].all()
  else:
    assert rows_trained.all()
  rewards = rollouts.rewards + (np.asarray(algorithms.overlong_penalty(
      rollouts.lengths, 12, 8)) if mode == "penalty" else 0.0)
  np.testing.assert_allclose(seen["adv"], np.asarray(algorithms.advantages(rewards, G)),
                             rtol=1e-5, atol=1e-6)


def test_rl_overlong_is_validated():
  config = config_lib.base_config()
  config.rl.overlong = "drop"
  with pytest.raises(ValueError, match="rl.overlong"):
    config_lib.validate(config)


# --------------------------------------------------------------- interrupt mode


class _RecordingEngine(rollout.JaxEngine):
  """JaxEngine.generate's chunking with scripted decoding calls (no model compile)."""

  def __init__(self, settings):  # pylint: disable=super-init-not-called
    self.settings, self.params, self.policy_version = settings, None, 0
    self.calls = []

  def _generate(self, examples, rng, params, policy_version):
    self.calls.append((len(examples), params, policy_version))
    math = tasks_lib.get_task("math")
    out = rollout.MockEngine({"math": math}, lambda ex, row, seed: "=1",
                             self.settings, tokenizer=CHAR).generate(list(examples), rng)
    out.versions[:] = policy_version
    return out


def test_interrupt_mode_keeps_each_group_on_one_version():
  """A new version before every decoding call: calls hold whole groups of G rows (6-row
  calls would split groups), and every row of a group has one version."""
  engine = _RecordingEngine(rollout.RolloutSettings(engine="autoregressive", batch_size=6,
                                                    max_new_tokens=8))
  versions = iter(range(100))
  weights = lambda: contextlib.nullcontext((None, next(versions)))
  scored = []
  math = tasks_lib.get_task("math")
  exs = [math.sample(i // G) for i in range(5 * G)]
  out = engine.generate(exs, jax.random.key(0), weights=weights, group_size=G,
                        after_call=lambda part, params, version: scored.append(
                            (part.num_rows, version, set(part.versions.tolist()))))
  assert [n for n, _, _ in engine.calls] == [4, 4, 4, 4, 4]
  per_group = out.versions.reshape(-1, G)
  assert (per_group == per_group[:, :1]).all() and len(set(per_group[:, 0])) == 5
  # Each call's rows were handed to after_call with the version that sampled them.
  assert scored == [(4, v, {v}) for v in range(5)]
  with pytest.raises(ValueError, match="smaller than a group"):
    engine.generate(exs, jax.random.key(0), weights=weights, group_size=8)


def test_interrupt_needs_a_rollout_batch_of_whole_groups():
  config = config_lib.base_config()
  config.rl.asynchronous.enabled = True
  config.rl.asynchronous.interrupt = True
  config.rl.rollout.batch_size = config.rl.group_size - 1
  with pytest.raises(ValueError, match="rl.rollout.batch_size"):
    config_lib.validate(config)


def test_interrupt_mode_scores_diagnostics_under_the_sampling_version(monkeypatch):
  """The producer's teacher-forced diagnostics of each decoding call run under the
  parameters that sampled it, not the newest ones."""
  config = config_lib.base_config()
  config.rl.prompts_per_batch, config.rl.group_size = 3, G
  config.rl.rollout.batch_size = G
  config.rl.asynchronous.enabled = True
  config.rl.asynchronous.interrupt = True
  store = async_loop.WeightStore({"v": 0}, 0)
  published = iter(range(1, 100))

  class Engine(_RecordingEngine):
    def __init__(self, graphdef, params, tasks, settings, *, tokenizer, policy_version=0):
      super().__init__(settings)

    def _generate(self, examples, rng, params, policy_version):
      out = super()._generate(examples, rng, params, policy_version)
      v = next(published)  # the learner publishes while this call decodes
      store.publish(lambda v=v: {"v": v}, v)
      return out

  seen = []
  monkeypatch.setattr(rollout, "JaxEngine", Engine)
  monkeypatch.setattr(stage, "_teacher_forced", lambda graphdef, params, part, *a: seen.append(
      (params["v"], set(part.versions.tolist()))) or {
          "rejection": {"alpha": [0.5], "positions": [1.0]}})
  place = placement_lib.make_placement(PlacementSettings(), sharding.MeshSettings(),
                                       devices=jax.devices()[:1])
  produce = stage._make_producer(config, None, {}, store, place, ("rejection",), 64,  # pylint: disable=protected-access
                                 tokenizer=CHAR)
  math = tasks_lib.get_task("math")
  batch = {"example_json": [math.sample(i // G).to_json() for i in range(3 * G)]}
  rollouts, metrics = produce(0, batch)
  assert seen == [(0, {0}), (1, {1}), (2, {2})]
  assert sorted(set(rollouts.versions.tolist())) == [0, 1, 2]
  assert metrics["tf_acceptance_rejection_1"] == pytest.approx(0.5)


def test_the_rollout_side_keeps_at_most_two_versions(monkeypatch):
  """After a batch and two more publishes, the first version is referenced by nothing: the
  engine holds no parameters of its own (the weight store's two slots are the only
  copies)."""
  config = config_lib.base_config()
  config.rl.prompts_per_batch, config.rl.group_size = 2, G
  config.rl.rollout.batch_size = G

  class Engine(_RecordingEngine):
    def __init__(self, graphdef, params, tasks, settings, *, tokenizer, policy_version=0):
      super().__init__(settings)
      self.params = params

    def _generate(self, examples, rng, params, policy_version):
      self.calls.clear()  # keep no reference in the test's recorder either
      return super()._generate(examples, rng, None, policy_version)

  monkeypatch.setattr(rollout, "JaxEngine", Engine)
  monkeypatch.setattr(stage, "_teacher_forced", lambda *a: {})
  place = placement_lib.make_placement(PlacementSettings(), sharding.MeshSettings(),
                                       devices=jax.devices()[:1])
  math = tasks_lib.get_task("math")
  batch = {"example_json": [math.sample(i // G).to_json() for i in range(2 * G)]}
  for interrupt in (False, True):
    config.rl.asynchronous.enabled = interrupt
    config.rl.asynchronous.interrupt = interrupt
    first = jax.numpy.ones(3)
    alive = weakref.ref(first)
    store = async_loop.WeightStore(first, 0)
    del first
    produce = stage._make_producer(config, None, {}, store, place, (), 64,  # pylint: disable=protected-access
                                   tokenizer=CHAR)
    produce(0, batch)
    store.publish(lambda: jax.numpy.zeros(3), 1)
    store.publish(lambda: jax.numpy.zeros(3), 2)  # overwrites version 0's slot
    gc.collect()
    assert alive() is None, f"version 0 is still referenced (interrupt={interrupt})"
    del produce
