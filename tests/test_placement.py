"""RL placement on conftest's eight simulated devices: split sub-meshes, clear errors when a
placement does not fit, and weight sync from the learner's sub-mesh to the rollouts'. The
async RL stage itself is tested in test_rl.py (it shares that file's SFT/MTP source)."""

import re

import jax
import numpy as np
import pytest

from bebop_jax.stages import config as config_lib
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax import sharding
from bebop_jax.rl import placement as placement_lib
from bebop_jax.rl.settings import PlacementSettings


def _placement(config, devices=None):
  settings = config_lib.settings(config)
  return placement_lib.make_placement(settings.rl.placement, settings.mesh, devices)


def _devices(tree):
  return {d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------- placement


def test_split_placement_builds_disjoint_sub_meshes_with_their_own_axes():
  config = config_lib.base_config()
  config.rl.placement.update(mode="split", learner_devices=0.25, rollout_devices=4)
  config.rl.placement.rollout_mesh.update(shape=(2, -1), axes=("data", "tensor"))
  p = _placement(config)
  assert [d.id for d in p.learner_mesh.devices.flat] == [0, 1]
  assert [d.id for d in p.rollout_mesh.devices.flat] == [2, 3, 4, 5]
  assert dict(p.rollout_mesh.shape) == {"data": 2, "tensor": 2}
  colocated = _placement(config_lib.base_config())
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
    placement_lib.make_placement(PlacementSettings(mode="split", **placement),
                                 sharding.MeshSettings())


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
  p = _placement(config)
  _, params = policy_lib.init(model_config.preset("tiny"))
  learner_params = jax.tree.map(jax.device_put, params, sharding.state_shardings(
      params, p.learner_mesh, p.learner_rules))
  copy = p.to_rollout(learner_params)
  assert _devices(learner_params) == {0, 1, 2, 3} and _devices(copy) == {4, 5, 6, 7}
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(copy))
  for a, b in zip(_leaves(learner_params), _leaves(copy)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # Colocated on one device: still a copy, which survives deleting the original.
  one = _placement(config_lib.base_config(), devices=jax.devices()[:1])
  src = jax.device_put(params, jax.devices()[0])
  dst = one.to_rollout(src)
  jax.tree.map(lambda x: x.delete(), src)
  assert all(np.isfinite(x).all() for x in _leaves(dst))


