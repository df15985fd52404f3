"""Checkpoints: round trip (model, optimizer, data iterator), retention, resharding onto other
meshes, shape mismatch errors, and atomicity under SIGKILL in the middle of a save.

conftest.py gives JAX eight simulated CPU devices, so a checkpoint written on a (2, 4) mesh
can be read back onto (8,), (4, 2) and a single device.
"""

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from bebop_jax import sharding
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.train import checkpoint as ckpt_lib
from bebop_jax.stages import lineage
from bebop_jax.train.checkpoint import CheckpointMismatchError, Checkpointer, abstract_like

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_params():
  """The tiny policy's nnx.State (d_model 32) on the default device."""
  return policy_lib.init(model_config.preset("tiny"), seed=0)[1]


def _iterator():
  """A deterministic grain DatasetIterator of int batches [4]."""
  return iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())


def _assert_trees_equal(a, b):
  """Same pure structure and bitwise-equal leaves."""
  a, b = ckpt_lib.to_pure(a), ckpt_lib.to_pure(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def train_state(tiny_params):
  """{"params": nnx.State, "opt_state": adamw state after one update, "step": int32 []}."""
  tx = optax.adamw(1e-2)

  @jax.jit
  def one_update(params):
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = tx.update(grads, opt_state, params)  # mu, nu, count non-zero
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = one_update(tiny_params)
  return {"params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32)}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_round_trip_model_optimizer_and_iterator(tmp_path, train_state, asynchronous):
  state = train_state
  opt_state = state["opt_state"]

  it = _iterator()
  for _ in range(3):
    next(it)
  with Checkpointer(tmp_path / "checkpoints", keep_last=2,
                    asynchronous=asynchronous) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert ckpt.save(7, state, data_iterator=it)
    expected_batch = next(it)  # the iterator moves on after the save; the checkpoint not
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 7 and ckpt.all_steps() == [7]
    assert ckpt.best_step() is None  # no best_metric

  with Checkpointer(tmp_path / "checkpoints", keep_last=2) as ckpt:
    fresh = _iterator()
    restored = ckpt.restore(7, abstract_like(state), data_iterator=fresh)
  np.testing.assert_array_equal(next(fresh), expected_batch)
  _assert_trees_equal(restored, state)
  # The structure comes back as given: nnx.State of Params (metadata kept), optax states.
  assert isinstance(restored["params"], nnx.State)
  assert isinstance(restored["params"]["embed"], nnx.Param)
  assert restored["params"]["embed"].get_metadata("logical_axes") == ("vocab", "embed")
  assert type(restored["opt_state"][0]) is type(opt_state[0])  # ScaleByAdamState
  assert int(restored["opt_state"][0].count) == 1
  assert isinstance(restored["params"]["layers"]["wq"][...], jax.Array)


def test_keep_last_and_best(tmp_path):
  state = {"w": jnp.arange(4.0)}
  accuracy = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4}
  with Checkpointer(tmp_path / "best", keep_last=2, best_metric="accuracy") as ckpt:
    for step, acc in accuracy.items():
      assert ckpt.save(step, state, metrics={"accuracy": np.float32(acc), "loss": 1.0})
    assert ckpt.all_steps() == [2, 4, 5]
    assert ckpt.best_step() == 2
    assert ckpt.metrics(2)["accuracy"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="best_metric='accuracy'"):
      ckpt.save(6, state, metrics={"loss": 1.0})
  assert sorted(os.listdir(tmp_path / "best")) == ["2", "4", "5"]
  with Checkpointer(tmp_path / "best", keep_last=2, best_metric="accuracy") as ckpt:
    assert ckpt.all_steps() == [2, 4, 5] and ckpt.best_step() == 2
    ckpt.save(6, state, metrics={"accuracy": 0.5})  # not better than step 2
    assert ckpt.all_steps() == [2, 5, 6]

  with Checkpointer(tmp_path / "last", keep_last=2, save_interval_steps=2) as ckpt:
    saved = [ckpt.save(step, state) for step in range(1, 7)]
    # Orbax always saves the first step it sees, then multiples of the interval.
    assert saved == [True, True, False, True, False, True]
    assert ckpt.save(7, state, force=True)
    assert not ckpt.save(5, state)  # not newer than the latest step: skipped
    assert ckpt.all_steps() == [6, 7] and ckpt.best_step() is None
    with pytest.raises(FileNotFoundError, match="no data iterator state"):
      ckpt.restore(7, abstract_like(state), data_iterator=_iterator())
    with pytest.raises(FileNotFoundError, match="available: \\[6, 7\\]"):
      ckpt.restore(3, abstract_like(state))


@pytest.mark.parametrize("target", ["fsdp8", "data4_tensor2", "single_device"])
def test_restore_onto_another_mesh(tmp_path, tiny_params, target):
  rules = sharding.DEFAULT_RULES
  source_mesh = sharding.make_mesh((2, 4), ("data", "tensor"))
  source_sh = sharding.state_shardings(tiny_params, source_mesh, rules)
  params = jax.device_put(tiny_params, source_sh)
  assert params["embed"][...].sharding.spec == P("tensor", None)  # really sharded
  with Checkpointer(tmp_path / "checkpoints", keep_last=1) as ckpt:
    ckpt.save(1, {"params": params, "step": jnp.asarray(1, jnp.int32)})

  if target == "single_device":
    target_sh = SingleDeviceSharding(jax.devices()[0])
  else:
    shape, axes = {"fsdp8": ((8,), ("fsdp",)),
                   "data4_tensor2": ((4, 2), ("data", "tensor"))}[target]
    target_sh = sharding.state_shardings(tiny_params, sharding.make_mesh(shape, axes), rules)
  abstract = {"params": abstract_like(tiny_params, target_sh),
              "step": jax.ShapeDtypeStruct((), jnp.int32)}  # no sharding: replicated
  with Checkpointer(tmp_path / "checkpoints", keep_last=1) as ckpt:
    restored = ckpt.restore(None, abstract)

  _assert_trees_equal(restored["params"], tiny_params)
  assert int(restored["step"]) == 1
  want = ckpt_lib.to_pure(abstract["params"])
  got = ckpt_lib.to_pure(restored["params"])
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert g.sharding == w.sharding, (g.sharding, w.sharding)
  if target == "fsdp8":
    assert got["embed"].sharding.spec == P(None, "fsdp")
    assert restored["step"].sharding == NamedSharding(got["embed"].sharding.mesh, P())


def test_shape_mismatch_names_the_parameter(tmp_path, tiny_params):
  with Checkpointer(tmp_path / "checkpoints", keep_last=1) as ckpt:
    ckpt.save(1, {"params": tiny_params})
    _, wider = policy_lib.abstract_state(model_config.preset("tiny", d_model=48))
    with pytest.raises(CheckpointMismatchError) as info:
      ckpt.restore(1, {"params": abstract_like(wider)})
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'params/embed'" in message, message
    assert "(128, 32) float32 in the checkpoint" in message, message
    assert "(128, 48) float32 is expected" in message, message

    extra = {"params": abstract_like(tiny_params), "ema": jax.ShapeDtypeStruct((3,), jnp.float32)}
    with pytest.raises(CheckpointMismatchError, match="'ema'.*missing from the checkpoint"):
      ckpt.restore(1, extra)
    fewer = ckpt_lib.to_pure(abstract_like(tiny_params))
    del fewer["final_norm"]
    with pytest.raises(CheckpointMismatchError,
                       match="'params/final_norm'.*in the checkpoint but not in the expected"):
      ckpt.restore(1, {"params": fewer})
    bf16 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=s.sharding),
                        ckpt_lib.to_pure(abstract_like(tiny_params)))
    with pytest.raises(CheckpointMismatchError, match="float32 in the checkpoint but .* bfloat16"):
      ckpt.restore(1, {"params": bf16})


# A process that saves step 1, then a 192 MB step 2 that never commits: the grain handler's
# finalize (called by orbax after every item is written, just before the rename that commits
# the step) blocks for step 2, so however slow the parent is, the child is at worst parked in
# front of the commit. "writing": the parent kills the child as soon as the temporary step-2
# directory appears, i.e. usually while the arrays are being written (the payload keeps that
# window long). "parked": the parent waits until everything is written and the child is
# parked, then kills it: the data is complete on disk but the step was never renamed.
_CHILD = textwrap.dedent("""
    import os, sys, time
    import grain
    import jax.numpy as jnp
    import numpy as np
    from bebop_jax.train import checkpoint as ckpt_lib

    directory, marker, payload_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def gated_finalize(self, path):
      if os.path.basename(os.path.dirname(str(path))).startswith("2."):
        open(marker, "w").close()
        time.sleep(600)  # the parent kills us here at the latest

    grain.checkpoint.CheckpointHandler.finalize = gated_finalize
    it = iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())
    next(it)
    ckpt = ckpt_lib.Checkpointer(directory, keep_last=3)
    ckpt.save(1, {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.asarray(1)},
              data_iterator=it)
    next(it)
    n = payload_mb * 2**20 // 4 // 4
    big = [jnp.asarray(np.arange(n, dtype=np.float32) + i) for i in range(4)]
    ckpt.save(2, {"w": jnp.zeros((3, 4)), "step": jnp.asarray(2), "big": big},
              data_iterator=it)
    print("step 2 committed", flush=True)
""")
_PAYLOAD_MB = 192


def _tree_bytes(path: str) -> int:
  """Bytes under `path` so far; the writer creates and removes files (locks) meanwhile."""
  total = 0
  for d, _, files in os.walk(path):
    for f in files:
      try:
        total += os.path.getsize(os.path.join(d, f))
      except FileNotFoundError:
        pass
  return total


@pytest.mark.parametrize("kill_when", ["writing", "parked"])
def test_sigkill_mid_save_leaves_last_complete_checkpoint(tmp_path, kill_when):
  directory = tmp_path / "checkpoints"
  marker = tmp_path / "parked_before_commit"
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))

  def ready() -> list[str]:
    """The temporary step-2 directory once the child is where `kill_when` wants it."""
    tmp_dirs = glob.glob(str(directory / "2.orbax-checkpoint-tmp*"))
    if kill_when == "writing":  # array bytes are arriving (or, if we were slow, parked)
      return tmp_dirs if tmp_dirs and (_tree_bytes(tmp_dirs[0]) > 2**20 or marker.exists()) else []
    return tmp_dirs if marker.exists() else []

  with open(tmp_path / "child.log", "w") as log:
    child = subprocess.Popen(
        [sys.executable, str(script), str(directory), str(marker), str(_PAYLOAD_MB)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    try:
      while not (tmp_dirs := ready()):
        assert child.poll() is None, (
            f"child exited ({child.returncode}) before step 2 was in flight:\n"
            + (tmp_path / "child.log").read_text()[-3000:])
        assert time.monotonic() < deadline, "step 2 never got in flight"
        time.sleep(0.002)
      os.kill(child.pid, signal.SIGKILL)
      parked = marker.exists()  # False: killed while writing; True: written, not committed
      written = _tree_bytes(tmp_dirs[0])  # what was on disk at the kill
      child.wait(timeout=30)
    finally:
      if child.poll() is None:
        child.kill()
        child.wait()
  log_text = (tmp_path / "child.log").read_text()
  assert child.returncode == -signal.SIGKILL, log_text[-3000:]
  assert "step 2 committed" not in log_text
  # The kill happened mid-save: step 1 committed, step 2 only as a temporary directory.
  assert (directory / "1").is_dir()
  assert not (directory / "2").exists()
  assert glob.glob(str(directory / "2.orbax-checkpoint-tmp*")), os.listdir(directory)
  assert written > 2**20, written  # array data had reached the disk
  if kill_when == "parked":  # the state item is complete (zstd shrinks the payload a bit)
    assert parked and written > _PAYLOAD_MB * 2**20 // 3, written
    assert os.path.exists(os.path.join(tmp_dirs[0], "state", "commit_success.txt"))
  print(f"killed {'parked before the commit' if parked else 'while writing'}, "
        f"{written / 2**20:.0f} MB of step 2 on disk")

  expected = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.asarray(1)}
  it = _iterator()
  with Checkpointer(directory, keep_last=3) as ckpt:
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    restored = ckpt.restore(1, abstract_like(expected), data_iterator=it)
    _assert_trees_equal(restored, expected)
    reference = _iterator()
    next(reference)
    np.testing.assert_array_equal(next(it), next(reference))

    # A rerun saves step 2 over the debris; the temporary directory is gone.
    step2 = {"w": jnp.ones((3, 4)), "step": jnp.asarray(2)}
    assert ckpt.save(2, step2, data_iterator=it)
    assert ckpt.all_steps() == [1, 2]
    assert not glob.glob(str(directory / "*orbax-checkpoint-tmp*")), os.listdir(directory)
    _assert_trees_equal(ckpt.restore(2, abstract_like(step2)), step2)


def test_relative_directory(tmp_path, monkeypatch):
  # orbax rejects relative paths at save time; users pass --workdir=runs/x.
  monkeypatch.chdir(tmp_path)
  state = {"w": jnp.arange(3.0)}
  with Checkpointer("runs/rel/checkpoints") as ckpt:
    assert ckpt.save(1, state)
  with Checkpointer("runs/rel/checkpoints") as ckpt:
    _assert_trees_equal(ckpt.restore(1, abstract_like(state)), state)
  assert os.listdir(tmp_path / "runs/rel/checkpoints") == ["1"]


# ------------------------------------------------------------------ restoring a stage's policy


def _stage_config(sft_trainable: str):
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.load_file(os.path.join(REPO_ROOT, "configs", "rl_tiny.py"))
  config.sft.optim.trainable = sft_trainable
  return config


def _save_stage(workdir, config, stage: str, seed: int, step: int):
  """Writes `stage`'s checkpoint at `step` the way its trainer does
  (trainer.TrainState.checkpoint_tree(): the trainable subset, AdamW state after one update,
  the step), its parameters a policy initialised with `seed`; returns the saved tree."""
  from bebop_jax.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.train import trainer  # pylint: disable=g-import-not-at-top
  from bebop_jax.train.settings import OptimSettings  # pylint: disable=g-import-not-at-top
  model_cfg = model_config.ModelConfig.from_dict(config.model.to_dict())
  _, trainable, frozen = nnx.split(
      policy_lib.Policy(model_cfg, rngs=nnx.Rngs(seed)),
      optimizer_lib.trainable_filter(config[stage].optim.trainable), ...)
  tx, _ = optimizer_lib.make_optimizer(OptimSettings(**config[stage].optim.to_dict()), 10)
  grads = jax.tree.map(jnp.ones_like, trainable)
  _, opt_state = tx.update(grads, tx.init(trainable), trainable)
  tree = trainer.TrainState(trainable, frozen, opt_state, jnp.int32(step)).checkpoint_tree()
  with Checkpointer(ckpt_lib.checkpoint_dir(workdir, stage)) as ckpt:
    ckpt.save(step, tree)
  return tree


def _saved_state(workdir, stage, step):
  """Everything the trainer wrote at `step`, read back whole (optimizer state included)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.PyTreeCheckpointer().restore(
      os.path.join(ckpt_lib.checkpoint_dir(workdir, stage), str(step), "state"))


def _no_training(monkeypatch):
  """Building an optimizer, choosing its parameter subset or restoring a whole train state
  fails from here on."""
  from bebop_jax.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top

  def refuse(*_, **__):
    raise AssertionError("restoring a policy for inference built an optimizer")

  monkeypatch.setattr(optimizer_lib, "make_optimizer", refuse)
  monkeypatch.setattr(optimizer_lib, "trainable_filter", refuse)
  monkeypatch.setattr(optax, "adamw", refuse)
  monkeypatch.setattr(Checkpointer, "restore", refuse)


def _flat(params):
  """{"layers/wq": array, ...} of a state or of its pure form."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return {"/".join(map(str, path)): np.asarray(v)
          for path, v in ocp.tree.to_flat_dict(ckpt_lib.to_pure(params)).items()}


def test_restore_policy_reads_only_the_parameters_training_wrote(tmp_path, monkeypatch):
  """SFT trains the trunk (its MTP modules frozen at their initialisation), the MTP stage the
  MTP modules: restoring each stage's policy reads exactly the saved parameters, takes the
  frozen ones from the initial policy, builds no optimizer and holds no optimizer state."""
  config = _stage_config("main")
  workdir = str(tmp_path)
  _save_stage(workdir, config, "sft", seed=11, step=2)
  _save_stage(workdir, config, "sft", seed=12, step=4)
  _save_stage(workdir, config, "mtp", seed=13, step=3)
  saved = {step: _flat(_saved_state(workdir, "sft", step)["trainable"]) for step in (2, 4)}
  saved_mtp = _flat(_saved_state(workdir, "mtp", 3)["trainable"])
  initial = _flat(nnx.state(lineage.initial_policy(
      config, model_config.ModelConfig.from_dict(config.model.to_dict()), None, None)))
  _no_training(monkeypatch)

  for step in (2, None):
    graphdef, params = lineage.restore_policy(config, workdir, stage="sft", step=step)
    got = _flat(params)
    assert set(got) == set(initial)  # the policy's parameters, nothing else
    assert all(isinstance(v, nnx.Param) for _, v in params.flat_state())
    trained = saved[2 if step else 4]
    assert set(trained) == {p for p in got if not p.startswith("mtp/")}
    for path, value in got.items():
      np.testing.assert_array_equal(value, trained.get(path, initial[path]), err_msg=path)
    assert nnx.merge(graphdef, params).config.d_model == config.model.d_model

  _, params = lineage.restore_policy(config, workdir, stage="mtp")
  got = _flat(params)
  assert set(saved_mtp) == {p for p in got if p.startswith("mtp/")}
  for path, value in got.items():
    np.testing.assert_array_equal(value, saved_mtp.get(path, saved[4].get(path)), err_msg=path)


def test_restore_policy_of_the_rl_stage_onto_a_mesh(tmp_path, monkeypatch):
  """The RL stage's checkpoint (trunk, MTP modules, optimizer state, counters) gives its
  parameters alone, placed on the mesh's shardings."""
  config = _stage_config("all")
  workdir = str(tmp_path)
  model_cfg = model_config.ModelConfig.from_dict(config.model.to_dict())
  params = nnx.state(policy_lib.Policy(model_cfg, rngs=nnx.Rngs(5)))
  trunk = params.filter(nnx.Not(nnx.PathContains("mtp")))
  mtp = params.filter(nnx.PathContains("mtp"))
  tx = optax.adamw(1e-3)
  with Checkpointer(ckpt_lib.checkpoint_dir(workdir, "rl")) as ckpt:
    ckpt.save(3, {"trunk": trunk, "mtp": mtp, "trunk_opt": tx.init(trunk),
                  "updates": jnp.int32(6), "rl_step": jnp.int32(3)})
  _no_training(monkeypatch)
  mesh = sharding.make_mesh((2, 4), ("data", "tensor"))
  _, restored = lineage.restore_policy(config, workdir, stage="rl", mesh=mesh)
  _assert_trees_equal(restored, params)
  want = ckpt_lib.to_pure(sharding.state_shardings(params, mesh, sharding.DEFAULT_RULES))
  got = ckpt_lib.to_pure(restored)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert g.sharding == w
  assert got["embed"].sharding.spec == P("tensor", None)  # really sharded
  with pytest.raises(FileNotFoundError, match="no mtp checkpoint"):
    lineage.restore_policy(config, workdir, stage="mtp")
