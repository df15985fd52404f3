"""Async GRPO on split sub-meshes (conftest's eight simulated devices): placement, weight sync,
eta = 0 against the synchronous loop, a crashing rollout thread, and versions across a resume.
"""

import glob
import json
import os
import re
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bebop_jax import config as config_lib
from bebop_jax import rollout
from bebop_jax.data import pipeline
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.rl import async_loop, placement as placement_lib, stage
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import metrics as metrics_lib

SPLIT = {"placement.mode": "split", "placement.learner_devices": 2,
         "placement.rollout_devices": 2}
ASYNC = {"async.enabled": True, **SPLIT}


def _devices(tree):
  return {d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------- placement


def test_split_placement_builds_disjoint_sub_meshes_with_their_own_axes():
  config = config_lib.base_config()
  config.rl.placement.update(mode="split", learner_devices=0.25, rollout_devices=4)
  config.rl.placement.rollout_mesh.update(shape=(2, -1), axes=("data", "tensor"))
  p = placement_lib.make_placement(config)
  assert [d.id for d in p.learner_mesh.devices.flat] == [0, 1]
  assert [d.id for d in p.rollout_mesh.devices.flat] == [2, 3, 4, 5]
  assert dict(p.rollout_mesh.shape) == {"data": 2, "tensor": 2}
  colocated = placement_lib.make_placement(config_lib.base_config())
  assert colocated.learner_mesh.devices.size == 8 and not colocated.split


@pytest.mark.parametrize("placement,message", [
    (dict(learner_devices=6, rollout_devices=4),
     "asks for 6 learner + 4 rollout devices but 8 devices are available"),
    (dict(learner_devices=8, rollout_devices=0.0),
     "asks for 8 learner + 0 rollout devices but 8 devices are available"),
    (dict(learner_devices=2.5), "a count must be a whole number"),
])
def test_a_placement_that_does_not_fit_the_devices_is_one_clear_error(placement, message):
  config = config_lib.base_config()
  config.rl.placement.update(mode="split", **placement)
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    config_lib.validate(config)
  with pytest.raises(placement_lib.PlacementError, match=re.escape(message)):
    placement_lib.make_placement(config)


def test_a_sub_mesh_that_does_not_fit_its_devices_names_both():
  config = config_lib.base_config()
  config.rl.placement.update(mode="split", learner_devices=4)
  config.rl.placement.learner_mesh.shape = (3,)
  with pytest.raises(config_lib.ConfigError,
                     match=r"rl.placement.learner_mesh.shape=\(3,\).*needs 3 devices but 4"):
    config_lib.validate(config)


def test_weight_sync_gives_the_rollout_side_bitwise_equal_parameters():
  """Learner parameters on a 4-device mesh, resharded onto the other four devices: every
  leaf is equal bit for bit, lives only on rollout devices, and is a copy (the learner's next
  update donates its buffers)."""
  config = config_lib.base_config()
  config.rl.placement.update(mode="split", learner_devices=4)
  config.rl.placement.learner_mesh.update(shape=(2, 2), axes=("fsdp", "tensor"))
  config.rl.placement.rollout_mesh.update(shape=(2, 2), axes=("data", "tensor"))
  p = placement_lib.make_placement(config)
  from bebop_jax import sharding  # pylint: disable=g-import-not-at-top
  _, params = policy_lib.init(model_config.preset("tiny"))
  learner_params = jax.tree.map(jax.device_put, params, sharding.state_shardings(
      params, p.learner_mesh, p.learner_rules))
  copy = p.to_rollout(learner_params)
  assert _devices(learner_params) == {0, 1, 2, 3} and _devices(copy) == {4, 5, 6, 7}
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(copy))
  for a, b in zip(_leaves(learner_params), _leaves(copy)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # Colocated on one device: still a copy, which survives deleting the original.
  one = placement_lib.make_placement(config_lib.base_config(), devices=jax.devices()[:1])
  src = jax.device_put(params, jax.devices()[0])
  dst = one.to_rollout(src)
  jax.tree.map(lambda x: x.delete(), src)
  assert all(np.isfinite(x).all() for x in _leaves(dst))


# ----------------------------------------------------------------------------- the stage


def _records(workdir):
  """Logged RL metrics without wall-clock and queue bookkeeping (which differ run to run) and
  the compile count (the async learner also compiles the decoupled update up front)."""
  drop = ("queue_depth", "rollout_restarts", "rollout_attempts", "learner_compiles")
  return [{k: v for k, v in r.items()
           if not (k.endswith("_s") or k.endswith("share") or k == "time" or k in drop)}
          for r in metrics_lib.read_metrics(workdir, "rl")]


def _stored(workdir):
  ckpt_dir = os.path.join(stage.stage_dir(workdir), "checkpoints")
  with checkpoint_lib.Checkpointer(ckpt_dir) as ckpt:
    step = ckpt.latest_step()
  tree = ocp.StandardCheckpointer().restore(os.path.join(ckpt_dir, str(step), "state"))
  return {group: _leaves(sub) for group, sub in tree.items()}


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


def test_async_with_max_staleness_0_is_the_synchronous_loop_exactly(rl_source, sync_split,
                                                                    tmp_path):
  """The rollout thread with eta = 0 samples every batch with the learner's current weights:
  the same parameters, optimizer states, drafter buffer and metrics, bit for bit."""
  workdir = str(tmp_path / "async0")
  summary = stage.run(rl_source.config(**ASYNC, **{"async.max_staleness": 0}), workdir)
  assert summary["async"]["enabled"] and summary["async"]["staleness_max"] == 0
  _assert_same_run(sync_split, workdir)


def test_a_crashing_rollout_thread_loses_and_repeats_no_batch(rl_source, sync_split, tmp_path,
                                                              monkeypatch):
  """The rollout thread dies mid-way through batch 1 (after decoding it, before queueing);
  it is restarted, resumes at batch 1 with the same prompts, and the run equals the
  synchronous one bit for bit (eta = 0 makes it deterministic)."""
  calls = {"n": 0}
  generate = rollout.JaxEngine.generate

  def flaky(self, examples, rng, weights=None):
    out = generate(self, examples, rng, weights=weights)
    if threading.current_thread().name == "rollout-worker":
      calls["n"] += 1
      if calls["n"] == 2:
        raise RuntimeError("injected rollout failure")
    return out

  monkeypatch.setattr(rollout.JaxEngine, "generate", flaky)
  workdir = str(tmp_path / "crash")
  summary = stage.run(rl_source.config(**ASYNC, **{"async.max_staleness": 0}), workdir)
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
  overrides = {**ASYNC, "async.max_staleness": 2, "async.interrupt": True,
               "rollout.batch_size": 4, "train.num_steps": 4, "train.checkpoint_every": 2}
  assert not stage.run(rl_source.config(**overrides, **{"train.stop_at_step": 2}),
                       workdir)["complete"]
  config = rl_source.config(**overrides)
  ckpt_dir = os.path.join(stage.stage_dir(workdir), "checkpoints")
  fresh = lambda: iter(pipeline.rl_prompt_dataset(
      config.data, prompts_per_batch=config.rl.prompts_per_batch,
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
