"""Train-step pieces: gradient accumulation, parameter subsets, schedule, metrics file."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax import sharding
from bebop_jax.losses import lm
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.train import trainer
from bebop_jax.train.settings import OptimSettings


def _batch(b=8, t=16, seed=0):
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(3, 100, (b, t)).astype(np.int32),
          "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
          "segment_ids": np.ones((b, t), np.int32),
          "loss_mask": np.ones((b, t), np.int32)}


def _loss_fn(model, batch):
  out = model(batch["tokens"], batch["positions"], batch["segment_ids"])
  return lm.sft_loss(out, batch["tokens"], batch["loss_mask"], 0.5)


def _one_step(trainable="all", grad_accum=1, num_steps=1):
  model = policy_lib.Policy(model_config.preset("tiny"), rngs=nnx.Rngs(0))
  graphdef, train, frozen = nnx.split(model, optimizer_lib.trainable_filter(trainable), ...)
  tx, schedule = optimizer_lib.make_optimizer(
      OptimSettings(warmup_steps=0, trainable=trainable), 10)
  mesh = sharding.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  state = trainer.place_state(trainer.TrainState(train, frozen, tx.init(train), 0), mesh,
                              sharding.DEFAULT_RULES, tx)
  before = jax.tree.map(np.asarray, (state.trainable, state.frozen))
  step = trainer.make_train_step(graphdef, _loss_fn, tx, schedule, grad_accum)
  compiled = trainer.compile_train_step(step, state, _batch(), mesh, sharding.DEFAULT_RULES, tx)
  assert compiled.memory and compiled.compile_seconds > 0
  for i in range(num_steps):
    out = compiled.fn(state.trainable, state.frozen, state.opt_state, state.step, _batch(seed=i))
    state = trainer.TrainState(out[0], state.frozen, out[1], out[2])
  return before, state, out[3]


def test_gradient_accumulation_equals_one_big_batch():
  import optax  # pylint: disable=g-import-not-at-top
  _, a, ma = _one_step(grad_accum=1)
  _, b, mb = _one_step(grad_accum=4)
  np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-4)
  # The gradients themselves: after one step Adam's first moment is (1 - b1) * clipped grad.
  mu_a = optax.tree_utils.tree_get(a.opt_state, "mu")
  mu_b = optax.tree_utils.tree_get(b.opt_state, "mu")
  # Each entry is a float32 sum over 128 tokens with cancellation: tolerance relative to the
  # tensor's scale, not the entry's.
  for x, y in zip(jax.tree.leaves(mu_a), jax.tree.leaves(mu_b)):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * np.abs(y).max())
  # Parameters: Adam's first step is lr * g / (|g| + eps), which amplifies float rounding
  # where |g| is near eps, so only its bound (one learning rate) holds everywhere.
  for x, y in zip(jax.tree.leaves(a.trainable), jax.tree.leaves(b.trainable)):
    np.testing.assert_array_less(np.abs(np.asarray(x) - np.asarray(y)), 2 * 3e-3)


def test_training_only_the_mtp_modules_leaves_the_policy_untouched():
  (train0, frozen0), state, metrics = _one_step(trainable="mtp", num_steps=2)
  assert set(state.trainable.keys()) == {"mtp"}
  assert "mtp" not in state.frozen and {"embed", "layers"} <= set(state.frozen.keys())
  for x, y in zip(jax.tree.leaves(frozen0), jax.tree.leaves(state.frozen)):
    np.testing.assert_array_equal(x, np.asarray(y))
  changed = [not np.array_equal(x, np.asarray(y))
             for x, y in zip(jax.tree.leaves(train0), jax.tree.leaves(state.trainable))]
  assert all(changed)
  assert int(state.step) == 2 and float(metrics["learning_rate"]) > 0


def test_schedule_warms_up_then_decays():
  optim = OptimSettings(learning_rate=1.0, warmup_steps=10, end_lr_fraction=0.1)
  sched = optimizer_lib.learning_rate_schedule(optim, 110)
  assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.5)
  assert float(sched(10)) == pytest.approx(1.0)
  assert float(sched(110)) == pytest.approx(0.1, abs=1e-6)
  linear = dataclasses.replace(optim, decay="linear")
  assert float(optimizer_lib.learning_rate_schedule(linear, 110)(60)) == pytest.approx(0.55)


def test_weight_decay_skips_norm_scales():
  model = policy_lib.Policy(model_config.preset("tiny"), rngs=nnx.Rngs(0))
  mask = optimizer_lib._decay_mask(nnx.state(model))  # pylint: disable=protected-access
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
  assert all(not v for k, v in flat.items() if "norm" in k)
  assert flat["['embed'].value"] and any(v for k, v in flat.items() if "w_gate" in k)


def test_metrics_writer_truncates_history_after_resume_step(tmp_path):
  w = metrics_lib.MetricsWriter(str(tmp_path), "sft")
  for step in (1, 2, 3, 4):
    w.write(step, {"loss": float(step)})
  w.close()
  w = metrics_lib.MetricsWriter(str(tmp_path), "sft", resume_step=2)
  w.write(3, {"loss": 30.0})
  w.close()
  records = metrics_lib.read_metrics(str(tmp_path), "sft")
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]
  assert json.loads(open(tmp_path / "metrics.jsonl").readline())["stage"] == "sft"
