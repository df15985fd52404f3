"""The RL learner and stage: real learning, what each MTP strategy updates, exact resume."""

import glob
import json
import os
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bebop_jax.stages import config as config_lib
from bebop_jax import rollout
from bebop_jax import settings_base
from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.data.tokenizer import load_tokenizer
from bebop_jax.decoding import speculative
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from experiments import rl_benchmark as bench
from bebop_jax.rl import learner
from bebop_jax.rl.settings import RLSettings
from bebop_jax.stages import rl as stage
from bebop_jax.tasks import base
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.stages import lineage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = model_config.preset("tiny")
MESH = sharding.make_mesh((1,), ("data",), devices=jax.devices()[:1])
RULES = tuple(tuple(r) for r in sharding.DEFAULT_RULES)
CHAR = load_tokenizer("char")  # the tokenizer the engines here are handed


class DigitTask(base.Task):
  """Reward = fraction of digits among the completion's characters: a random policy scores
  ~0.06 and never writes only digits."""
  name = "math"

  def sample(self, seed):
    return base.Example("math", f"Digits {seed % 97}:\n", "x", {})

  def reward(self, example, completion):
    text = base.clip_completion(completion)
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _rl_settings(**overrides) -> RLSettings:
  """The RL settings of the learner tests here (the section alone: they run on one device,
  not on the config's mesh), with `overrides` by dotted key."""
  rl = config_lib.base_config().rl
  rl.prompts_per_batch, rl.group_size = 4, 8
  rl.max_prompt_len = 16
  rl.rollout.max_new_tokens = 8
  rl.train.num_steps = 30
  for key, value in overrides.items():
    target = rl
    *path, last = key.split(".")
    for part in path:
      target = target[part]
    target[last] = value
  return settings_base.build(RLSettings, rl.to_dict(), "rl")


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_grpo_learns_a_task_that_a_random_policy_rarely_solves():
  """Fixed seeds: 30 GRPO steps on speculative rollouts raise the held-out mean reward of a
  randomly initialised policy from ~0.06 to far beyond it (paired over 256 prompts).
  Completions cut by the 8-token budget are trained on (rl.overlong = "keep"): a random
  policy rarely ends one, and under the default "mask" the few that end carry all the signal,
  so whether the policy takes off depends on the seed (in 5 of 20 runs of 60 steps: seeds 0-9
  under the Gumbel-max and the inverse-CDF samplers); with "keep" it does within 30 steps for
  every seed tried (0-5, held-out reward 0.93-0.98)."""
  rl = _rl_settings(**{"optim.learning_rate": 3e-3, "overlong": "keep"})
  graphdef, params = policy_lib.init(CONFIG, seed=0)
  learn = learner.Learner(rl, graphdef, params, mesh=MESH, rules=RULES, seq_len=24)
  task = DigitTask()
  engine = rollout.JaxEngine(graphdef, learn.params(), {"math": task}, rollout.RolloutSettings(
      max_new_tokens=8, batch_size=32, prompt_buckets=(16,)), tokenizer=CHAR)
  held_out = [task.sample(1000 + i) for i in range(256)]
  before = engine.generate(held_out, jax.random.key(7)).rewards
  shapes = {(learn.update_rows, 24)}  # compiled ahead of time
  for step in range(rl.train.num_steps):
    prompts = [task.sample(4 * step + i // rl.group_size) for i in range(32)]
    rollouts = engine.generate(prompts, jax.random.fold_in(jax.random.key(1), step))
    metrics = learn.update(rollouts, step)
    engine.update_params(learn.params(), step + 1)
    assert metrics["sampler_learner_logprob_diff_max"] < 1e-5  # on-policy: ratio 1
    shapes.add((metrics["learner_rows"], metrics["learner_length"]))
  # One compiled update per packed batch shape, none per step.
  assert learn.num_compiled == len(shapes) <= 1 + len(learn.row_buckets)
  after = engine.generate(held_out, jax.random.key(7)).rewards
  delta = after - before
  se = delta.std(ddof=1) / np.sqrt(len(delta))
  assert before.mean() < 0.15
  assert delta.mean() > 0.4 and delta.mean() > 10 * se, (before.mean(), after.mean(), se)


def _mock_rollouts(rows):
  """Math rollouts from a scripted policy: right and wrong answers in every group."""
  math = tasks_lib.get_task("math")
  exs = [math.sample(i // 8) for i in range(rows)]
  answer = lambda ex, row, seed: (ex.demonstration if row % 3 == 0
                                  else "=1\n<|answer|>" + str(row))
  return rollout.MockEngine({"math": math}, answer, rollout.RolloutSettings(max_new_tokens=32),
                            tokenizer=CHAR).generate(exs, jax.random.key(0))


@pytest.fixture(scope="module")
def strategy_runs():
  """Two learner steps of each MTP strategy on the same rollouts."""
  graphdef, params = policy_lib.init(CONFIG, seed=1)
  batch = _mock_rollouts(32)
  assert 0 < batch.rewards.mean() < 1
  out = {}
  for strategy in learner.MTP_STRATEGIES:
    rl = _rl_settings(**{"mtp.strategy": strategy, "mtp.every": 2, "max_prompt_len": 32,
                       "rollout.max_new_tokens": 32})
    learn = learner.Learner(rl, graphdef, jax.tree.map(np.copy, params), mesh=MESH,
                            rules=RULES, seq_len=64)
    trees = [(_leaves(learn.trunk), _leaves(learn.mtp))]
    for step in range(2):
      learn.update(batch, step)
      trees.append((_leaves(learn.trunk), _leaves(learn.mtp)))
    out[strategy] = trees
  return out


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_frozen_strategy_updates_the_trunk_only(strategy_runs):
  (trunk0, mtp0), (trunk1, mtp1), (_, mtp2) = strategy_runs["frozen"]
  assert not _equal(trunk0, trunk1)
  assert _equal(mtp0, mtp1) and _equal(mtp0, mtp2)


def test_online_strategy_updates_the_drafter_every_step_and_never_the_trunk(strategy_runs):
  frozen, online = strategy_runs["frozen"], strategy_runs["online"]
  for step in (1, 2):
    assert _equal(online[step][0], frozen[step][0])  # MTP updates do not reach the trunk
    assert not _equal(online[step][1], online[step - 1][1])


def test_periodic_strategy_updates_the_drafter_every_n_steps(strategy_runs):
  frozen, periodic = strategy_runs["frozen"], strategy_runs["periodic"]
  assert _equal(periodic[1][1], periodic[0][1])      # step 0: buffered only
  assert not _equal(periodic[2][1], periodic[1][1])  # step 1: every=2, an update
  assert _equal(periodic[2][0], frozen[2][0])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packed_update_batches_give_the_row_per_rollout_loss_and_gradients(aggregation):
  """Each minibatch packed into shared rows (segments, restarted positions, per-token
  advantages and aggregation weights) against one row per rollout: the same tokens, the same
  policy loss and metrics, and the same gradient of every parameter (float tolerance)."""
  graphdef, params = policy_lib.init(CONFIG, seed=2)
  rollouts = _mock_rollouts(32)
  lengths = rollouts.prompt_lengths + rollouts.lengths
  adv = np.asarray(learner.algorithms.advantages(rollouts.rewards, 8))
  seq_len = 64
  full = learner.learner_batch(rollouts, adv, seq_len)
  batches = {}
  for packing in (False, True):
    rl = _rl_settings(aggregation=aggregation, minibatches=2, packing=packing)
    batches[packing] = learner.update_batches(rl, full, lengths, seq_len=seq_len,
                                              rows_buckets=learner.row_buckets(16))
  rows, length = batches[True][0]["tokens"].shape
  assert length == seq_len and rows < 16 and batches[False][0]["tokens"].shape == (16, seq_len)
  sampling_params = learner.sampling.SamplingParams(1.0, 0, 1.0)
  loss_fn = learner.make_policy_loss_fn(sampling_params, clip_low=0.2, clip_high=0.2,
                                        aggregation=aggregation)
  model = learner.nnx.merge(graphdef, params)
  _, trunk, rest = learner.nnx.split(model, learner.optimizer_lib.trainable_filter("main"), ...)

  def loss_and_grad(batch):
    def f(t):
      return loss_fn(learner.nnx.merge(graphdef, t, rest), batch)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(trunk)

  for unpacked, packed in zip(batches[False], batches[True]):
    m = packed["mask"] > 0
    assert m.sum() == (unpacked["mask"] > 0).sum() > 0
    np.testing.assert_allclose(np.sort(packed["token_weights"][m]),
                               np.sort(unpacked["token_weights"][unpacked["mask"] > 0]))
    assert packed["segment_ids"].max() > 1  # rows do share rollouts
    (loss_u, metrics_u), grad_u = loss_and_grad(unpacked)
    (loss_p, metrics_p), grad_p = loss_and_grad(packed)
    assert abs(float(loss_u)) > 1e-3
    np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5)
    for k in ("ratio_mean", "logprob_diff_mean", "logprob_diff_max", "kl_behaviour"):
      np.testing.assert_allclose(metrics_p[k], metrics_u[k], rtol=1e-5, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grad_u), jax.tree.leaves(grad_p)):
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=str(path))


# ----------------------------------------------------------------------------- the stage


def _stored(workdir):
  """{group: leaves} of the RL stage's latest checkpoint, read back as stored."""
  ckpt_dir = os.path.join(lineage.stage_dir(workdir, "rl"), "checkpoints")
  with checkpoint_lib.Checkpointer(ckpt_dir) as ckpt:
    step = ckpt.latest_step()
  tree = ocp.StandardCheckpointer().restore(os.path.join(ckpt_dir, str(step), "state"))
  return {group: _leaves(sub) for group, sub in tree.items()}


def _rl_records(workdir):
  skip = ("time", "_s", "share")
  return [{k: v for k, v in r.items() if not any(k.endswith(s) or k == s for s in skip)}
          for r in metrics_lib.read_metrics(workdir, "rl")]


def test_rl_stage_resumes_exactly(rl_source, tmp_path):
  """3 RL steps straight against 1 step, a stop, and a resume to 3 (the periodic MTP buffer
  is half full at the stop): the same parameters, optimizer states, buffer and metrics,
  bitwise; and the rollout loop compiles nothing new after the resume."""
  straight = str(tmp_path / "straight")
  summary = stage.run(rl_source.config(), straight)
  assert summary["complete"] and summary["steps"] == 3
  resumed = str(tmp_path / "resumed")
  assert not stage.run(rl_source.config(**{'train.stop_at_step': 1}), resumed)["complete"]
  size = speculative.start._cache_size()  # pylint: disable=protected-access
  stage.run(rl_source.config(), resumed)
  assert speculative.start._cache_size() == size  # pylint: disable=protected-access
  a_state, b_state = _stored(straight), _stored(resumed)
  assert set(a_state) == {"trunk", "mtp", "trunk_opt", "updates", "mtp_opt", "mtp_updates",
                          "buffer", "rl_step"}
  for group, leaves in a_state.items():
    assert _equal(leaves, b_state[group]), group
  a, b = _rl_records(straight), _rl_records(resumed)
  assert [r["step"] for r in a] == [1, 2, 3] and a == b
  assert (json.load(open(os.path.join(straight, "rl", "summary.json")))["pass_at_1_after"] ==
          json.load(open(os.path.join(resumed, "rl", "summary.json")))["pass_at_1_after"])
  # Rewards varied within groups, so the policy gradient was not zero; the periodic update
  # ran at step 2.
  assert any(r["grad_norm"] > 0 for r in a) and "mtp/alpha_1" in a[1]
  # A rerun of a complete stage does nothing.
  assert stage.run(rl_source.config(), straight) == summary


# ----------------------------------------------------------------------------- async RL

SPLIT = {"placement.mode": "split", "placement.learner_devices": 2,
         "placement.rollout_devices": 2}
ASYNC = {"asynchronous.enabled": True, **SPLIT}



def _records(workdir):
  """Logged RL metrics without wall-clock and queue bookkeeping (which differ run to run) and
  the compile count (the async learner also compiles the decoupled update up front)."""
  drop = ("queue_depth", "rollout_restarts", "rollout_attempts", "learner_compiles")
  return [{k: v for k, v in r.items()
           if not (k.endswith("_s") or k.endswith("share") or k == "time" or k in drop)}
          for r in metrics_lib.read_metrics(workdir, "rl")]


def _assert_same_run(a, b):
  sa, sb = _stored(a), _stored(b)
  assert set(sa) == set(sb)
  for group, leaves in sa.items():
    assert all(np.array_equal(x, y) for x, y in zip(leaves, sb[group])), group
  ra, rb = _records(a), _records(b)
  assert [r["step"] for r in ra] == [1, 2, 3] and ra == rb


@pytest.fixture(scope="module")
def sync_split(rl_source, tmp_path_factory):
  """The synchronous loop on split sub-meshes (2 learner + 2 rollout devices), 3 steps."""
  workdir = str(tmp_path_factory.mktemp("sync_split"))
  summary = stage.run(rl_source.config(**SPLIT), workdir)
  assert summary["complete"] and not summary["async"]["enabled"]
  records = metrics_lib.read_metrics(workdir, "rl")
  assert any(r["grad_norm"] > 0 for r in records)  # rewards varied: the policy moved
  return workdir


@pytest.fixture(scope="module")
def async_split(rl_source, tmp_path_factory):
  """The async loop with max_staleness 0 on the same sub-meshes, 3 steps."""
  workdir = str(tmp_path_factory.mktemp("async_split"))
  summary = stage.run(rl_source.config(**ASYNC, **{"asynchronous.max_staleness": 0}), workdir)
  assert summary["async"]["enabled"] and summary["async"]["staleness_max"] == 0
  return workdir


def test_async_with_max_staleness_0_is_the_synchronous_loop_exactly(sync_split, async_split):
  """The rollout thread with eta = 0 samples every batch with the learner's current weights:
  the same parameters, optimizer states, drafter buffer and metrics, bit for bit."""
  _assert_same_run(sync_split, async_split)


def test_the_speed_benchmark_reads_the_arms_it_finds_complete(sync_split, async_split, tmp_path,
                                                              rl_source):
  """bench.run_arms over finished arms (the two runs above as speculative sync and async):
  it reuses them and derives every number of its table from their metrics."""
  for arm, workdir in (("speculative_sync", sync_split), ("speculative_async", async_split)):
    os.symlink(workdir, tmp_path / arm)
  out = bench.run_arms(rl_source.config(), str(tmp_path),
                       ["speculative_sync", "speculative_async"], split=True, warmup=1)
  arms = out["arms"]
  for a in arms.values():
    assert a["steps"] == 3 and a["step_s"] > 0 and 0 < a["rollout_share"] < 1
    assert [s for s, _ in a["held_out"]] == [0, 3]
  assert arms["speculative_sync"]["held_out"] == arms["speculative_async"]["held_out"]
  (_, start), (_, end) = arms["speculative_sync"]["held_out"]
  if end > start:  # the target is halfway there, reached at step 3
    assert out["target"] == pytest.approx((start + end) / 2)
    assert arms["speculative_sync"]["time_to_target_s"] == pytest.approx(
        sum(r["step_s"] for r in metrics_lib.read_metrics(sync_split, "rl")))
  else:
    assert out["target"] is None and arms["speculative_sync"]["time_to_target_s"] is None
  assert set(out["ratios"]) == {"speculative_async"}
  # Run before this call, in one go each: one paired unit, no interval.
  assert not any(a["interleaved"] for a in arms.values())
  pair = out["pairs"]["speculative_async_vs_speculative_sync"]
  assert set(out["pairs"]) == {"speculative_async_vs_speculative_sync"}
  assert (pair["steps"], pair["blocks"], pair["ci95"]) == (2, 1, None) and pair["measured"] > 0
  assert out["placement"]["mode"] == "split" and out["placement"]["simulated"]
  assert out["schedule"]["segments"] == []
  json.dumps(out)


def test_the_speed_benchmark_resumes_an_arm_across_blocks_exactly(sync_split, tmp_path,
                                                                  rl_source):
  """bench.run_arms in blocks of 2 steps (the stage stops at step 2 and resumes to 3): the
  sync arm's per-step rewards, lengths, tokens and every other logged number equal its run
  straight through (sync_split), and both stage starts are in the schedule."""
  out = bench.run_arms(rl_source.config(**SPLIT), str(tmp_path), ["speculative_sync"],
                       split=True, warmup=1, block_steps=2)
  assert _records(str(tmp_path / "speculative_sync")) == _records(sync_split)
  assert [(s["block"], s["first_step"], s["last_step"]) for s in out["schedule"]["segments"]
          ] == [(0, 1, 2), (1, 3, 3)]
  arm = out["arms"]["speculative_sync"]
  assert arm["interleaved"] and arm["warmup_steps"] == [1, 3] and arm["steady_steps"] == [2]


def test_a_crashing_rollout_thread_loses_and_repeats_no_batch(rl_source, sync_split, tmp_path,
                                                              monkeypatch):
  """The rollout thread dies mid-way through batch 1 (after decoding it, before queueing);
  it is restarted, resumes at batch 1 with the same prompts, and the run equals the
  synchronous one bit for bit (eta = 0 makes it deterministic)."""
  calls = {"n": 0}
  generate = rollout.JaxEngine.generate

  def flaky(self, examples, rng, weights=None, **kwargs):
    out = generate(self, examples, rng, weights=weights, **kwargs)
    if threading.current_thread().name == "rollout-worker":
      calls["n"] += 1
      if calls["n"] == 2:
        raise RuntimeError("injected rollout failure")
    return out

  monkeypatch.setattr(rollout.JaxEngine, "generate", flaky)
  workdir = str(tmp_path / "crash")
  summary = stage.run(rl_source.config(**ASYNC, **{"asynchronous.max_staleness": 0}), workdir)
  assert calls["n"] == 4 and summary["async"]["rollout_restarts"] == 1
  _assert_same_run(sync_split, workdir)
  attempts = [r["rollout_attempts"] for r in metrics_lib.read_metrics(workdir, "rl")]
  assert attempts == [1, 2, 1]


def test_versions_and_the_staleness_bound_survive_a_resume(rl_source, tmp_path):
  """eta = 2 with weights swapped between decoding calls: a stop at step 2 while the worker
  has drawn batches ahead, then a resume to 4. Every consumed batch is within the bound, the
  versions continue from the checkpoint, and the checkpoint's prompt-stream position is the
  one after the last consumed batch (not the worker's)."""
  workdir = str(tmp_path / "resume")
  overrides = {**ASYNC, "asynchronous.max_staleness": 2, "asynchronous.interrupt": True,
               "rollout.batch_size": 4, "train.num_steps": 4, "train.checkpoint_every": 2}
  assert not stage.run(rl_source.config(**overrides, **{"train.stop_at_step": 2}),
                       workdir)["complete"]
  config = rl_source.config(**overrides)
  ckpt_dir = os.path.join(lineage.stage_dir(workdir, "rl"), "checkpoints")
  fresh = lambda: iter(pipeline.rl_prompt_dataset(
      config_lib.settings(config).data, prompts_per_batch=config.rl.prompts_per_batch,
      group_size=config.rl.group_size, max_prompt_len=config.rl.max_prompt_len,
      seed=config.seed))
  reference = fresh()
  batches = [next(reference)["example_json"].tolist() for _ in range(3)]
  with checkpoint_lib.Checkpointer(ckpt_dir) as ckpt:
    assert ckpt.latest_step() == 2
  tree = ocp.StandardCheckpointer().restore(os.path.join(ckpt_dir, "2", "state"))
  assert int(tree["rl_step"]) == 2
  it = fresh()
  state_file, = glob.glob(os.path.join(ckpt_dir, "2", checkpoint_lib.DATA_ITEM, "*.json"))
  it.set_state(json.loads(open(state_file).read()))
  assert next(it)["example_json"].tolist() == batches[2]

  summary = stage.run(config, workdir)
  assert summary["complete"] and summary["async"]["staleness_max"] <= 2
  records = metrics_lib.read_metrics(workdir, "rl")
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  for r in records:
    assert r["policy_version"] == r["step"]
    assert r["step"] - 1 - 2 <= r["rollout_version_min"] <= r["rollout_version_max"] < r["step"]
    assert r["staleness_max"] <= 2
    assert sum(r[f"staleness_hist_{k}"] for k in range(3)) == pytest.approx(1.0)
  # After the resume the store starts at the checkpoint's version 2.
  assert records[2]["rollout_version_min"] == 2
  # Stale batches were trained with the decoupled objective: behaviour weights near 1.
  stale = [r for r in records if r["staleness_max"] > 0]
  for r in stale:
    assert 0.5 < r["is_weight_p50"] < 2.0 and 0 <= r["is_weight_above_cap_frac"] <= 1
  fresh_rows = [r for r in records if r["staleness_max"] == 0]
  for r in fresh_rows:
    assert "is_weight_p50" not in r
