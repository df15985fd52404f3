"""The RL learner and stage: real learning, what each MTP strategy updates, exact resume."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bebop_jax import config as config_lib
from bebop_jax import rollout
from bebop_jax import sharding
from bebop_jax import stages
from bebop_jax import tasks as tasks_lib
from bebop_jax.decoding import speculative
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.rl import learner, stage
from bebop_jax.tasks import base
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import metrics as metrics_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = model_config.preset("tiny")
MESH = sharding.make_mesh((1,), ("data",), devices=jax.devices()[:1])
RULES = tuple(tuple(r) for r in sharding.DEFAULT_RULES)


class DigitTask(base.Task):
  """Reward = fraction of digits among the completion's characters: a random policy scores
  ~0.06 and never writes only digits."""
  name = "math"

  def sample(self, seed):
    return base.Example("math", f"Digits {seed % 97}:\n", "x", {})

  def reward(self, example, completion):
    text = base.clip_completion(completion)
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _rl_config(**overrides):
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
  return rl


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_grpo_learns_a_task_that_a_random_policy_rarely_solves():
  """Fixed seeds: 30 GRPO steps on speculative rollouts raise the held-out mean reward of a
  randomly initialised policy from ~0.06 to far beyond it (paired over 256 prompts)."""
  rl = _rl_config(**{"optim.learning_rate": 3e-3})
  graphdef, params = policy_lib.init(CONFIG, seed=0)
  learn = learner.Learner(rl, graphdef, params, mesh=MESH, rules=RULES, seq_len=24)
  task = DigitTask()
  engine = rollout.JaxEngine(graphdef, learn.params(), {"math": task}, rollout.RolloutSettings(
      max_new_tokens=8, batch_size=32, prompt_buckets=(16,)))
  held_out = [task.sample(1000 + i) for i in range(256)]
  before = engine.generate(held_out, jax.random.key(7)).rewards
  for step in range(rl.train.num_steps):
    prompts = [task.sample(4 * step + i // rl.group_size) for i in range(32)]
    rollouts = engine.generate(prompts, jax.random.fold_in(jax.random.key(1), step))
    metrics = learn.update(rollouts, step)
    engine.update_params(learn.params(), step + 1)
    assert metrics["sampler_learner_logprob_diff_max"] < 1e-5  # on-policy: ratio 1
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
  return rollout.MockEngine({"math": math}, answer,
                            rollout.RolloutSettings(max_new_tokens=32)).generate(
                                exs, jax.random.key(0))


@pytest.fixture(scope="module")
def strategy_runs():
  """Two learner steps of each MTP strategy on the same rollouts."""
  graphdef, params = policy_lib.init(CONFIG, seed=1)
  batch = _mock_rollouts(32)
  assert 0 < batch.rewards.mean() < 1
  out = {}
  for strategy in learner.MTP_STRATEGIES:
    rl = _rl_config(**{"mtp.strategy": strategy, "mtp.every": 2, "max_prompt_len": 32,
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


# ----------------------------------------------------------------------------- the stage


def _stored(workdir):
  """{group: leaves} of the RL stage's latest checkpoint, read back as stored."""
  ckpt_dir = os.path.join(stage.stage_dir(workdir), "checkpoints")
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
