"""SFT stage end to end on the tiny config: exact resume, skip when complete, outputs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax.stages import config as config_lib
from bebop_jax.model import model as policy_lib
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.stages import sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config(data_dir, **train):
  config = config_lib.load_file(os.path.join(REPO, "configs", "sft_tiny.py"))
  config.data.data_dir = str(data_dir)
  config.eval.temperatures = (0.0,)
  config.eval.num_examples = 1
  for k, v in train.items():
    config.sft.train[k] = v
  return config_lib.validate(config)


def _losses(workdir):
  return [(r["step"], r["loss"]) for r in metrics_lib.read_metrics(workdir, "sft")
          if "loss" in r]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("data")
  workdir = str(tmp_path_factory.mktemp("straight"))
  summary = sft.run(_tiny_config(data_dir, log_every=1), workdir)
  return data_dir, workdir, summary


def _restore_trainable(workdir, step):
  path = os.path.join(workdir, "sft", "checkpoints", str(step))
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"))


def test_fused_head_gives_the_dense_heads_loss_metrics_and_gradients():
  """The SFT loss_fn (sft.head) with the joint MTP CE, on packed rows with padding and
  prompt positions: the fused head (no [B, T, V] or [K, B, T, V] logits) against the dense
  one, in the loss, every metric (accuracy included) and every parameter's gradient."""
  config = config_lib.base_config()
  assert config.sft.head == "fused" and config.sft.mtp_loss_weight > 0
  graphdef, state = policy_lib.init(policy_lib.ModelConfig.from_dict(config.model.to_dict()),
                                    seed=0)
  rng = np.random.default_rng(0)
  segment_ids = np.array([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4], np.int32)
  positions = np.concatenate([np.arange(9), np.arange(7), np.arange(16)]).reshape(2, 16)
  batch = {"tokens": jnp.asarray(rng.integers(3, 100, (2, 16)) * (segment_ids > 0), jnp.int32),
           "positions": jnp.asarray(positions * (segment_ids > 0), jnp.int32),
           "segment_ids": jnp.asarray(segment_ids),
           "loss_mask": jnp.asarray((rng.random((2, 16)) < 0.7) & (segment_ids > 0), jnp.int32)}

  def run(head):
    config.sft.head = head
    loss_fn = sft.make_loss_fn(config)
    f = lambda s: loss_fn(nnx.merge(graphdef, s), batch)
    return jax.device_get(jax.jit(jax.value_and_grad(f, has_aux=True))(state))

  (loss_f, m_f), g_f = run("fused")
  (loss_d, m_d), g_d = run("dense")
  assert set(m_f) == set(m_d) and {"accuracy", "mtp_ce_3", "mtp_alpha_3"} <= set(m_d)
  np.testing.assert_allclose(loss_f, loss_d, rtol=1e-5)
  for name in m_d:
    np.testing.assert_allclose(m_f[name], m_d[name], rtol=1e-5, atol=1e-7, err_msg=name)
  assert 0 < m_d["num_targets"] and 0 <= m_d["accuracy"] <= 1
  flat_f = dict(jax.tree_util.tree_leaves_with_path(g_f))
  for path, g in jax.tree_util.tree_leaves_with_path(g_d):
    np.testing.assert_allclose(flat_f[path], g, rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  assert max(np.abs(g).max() for g in flat_f.values()) > 0


def test_straight_run_outputs(straight_run):
  _, workdir, summary = straight_run
  assert summary["complete"] and summary["steps"] == 6
  assert set(summary["eval"]) >= {"math/t0", "code/t0", "agentic/t0", "pass_at_1_mean"}
  assert summary["model_flops_per_s"] > 0 and 0 < summary["flops_utilization"] < 1
  from bebop_jax import evaluation  # pylint: disable=g-import-not-at-top
  for stats in summary["entropy"].values():  # the policy's entropy on held-out rollouts
    assert stats["positions"] > 0 and sum(stats["histogram"]) == stats["positions"]
    assert len(stats["histogram"]) == len(evaluation.ENTROPY_BIN_EDGES) - 1
    assert 0 < stats["mean"] < 5 and 0 <= stats["above_threshold"] <= 1
  assert json.load(open(os.path.join(workdir, "sft", "summary.json")))["steps"] == 6
  assert os.listdir(os.path.join(workdir, "tb", "sft"))
  assert [s for s, _ in _losses(workdir)] == [1, 2, 3, 4, 5, 6]


def test_interrupted_then_resumed_equals_straight(straight_run, tmp_path):
  data_dir, straight, _ = straight_run
  workdir = str(tmp_path / "resumed")
  first = sft.run(_tiny_config(data_dir, log_every=1, stop_at_step=4), workdir)
  assert not first["complete"] and first["steps"] == 4
  assert not os.path.exists(os.path.join(workdir, "sft", "summary.json"))
  second = sft.run(_tiny_config(data_dir, log_every=1), workdir)
  assert second["complete"] and second["steps"] == 6
  # Same data order: identical losses at every step, before and after the interruption.
  assert _losses(workdir) == _losses(straight)
  # Identical parameters and optimizer state at the end.
  a, b = _restore_trainable(straight, 6), _restore_trainable(workdir, 6)
  flat_a, flat_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(flat_a) == len(flat_b) > 10
  for x, y in zip(flat_a, flat_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rerun_of_complete_stage_does_nothing(straight_run, capsys):
  data_dir, workdir, summary = straight_run
  before = os.path.getmtime(os.path.join(workdir, "metrics.jsonl"))
  again = sft.run(_tiny_config(data_dir, log_every=1), workdir)
  assert again["steps"] == summary["steps"]
  assert "skipping" in capsys.readouterr().out
  assert os.path.getmtime(os.path.join(workdir, "metrics.jsonl")) == before


# A training run whose checkpoint save at step 6 is parked just before orbax's commit (the
# grain handler's finalize blocks), so the SIGKILL lands mid-save deterministically.
_KILLED_RUN = """
import os, sys, time
import grain
sys.path.insert(0, {tests!r})
import test_sft
from bebop_jax.stages import sft

data_dir, workdir, marker = sys.argv[1:4]

def parked_finalize(self, path):
  if os.path.basename(os.path.dirname(str(path))).startswith("6."):
    open(marker, "w").close()
    time.sleep(600)

grain.checkpoint.CheckpointHandler.finalize = parked_finalize
sft.run(test_sft._tiny_config(data_dir, log_every=1), workdir)
"""


def test_sigkill_during_a_checkpoint_save_then_rerun_resumes(straight_run, tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  data_dir, straight, _ = straight_run
  workdir, marker = str(tmp_path / "killed"), tmp_path / "parked"
  script = tmp_path / "run.py"
  script.write_text(_KILLED_RUN.format(tests=os.path.dirname(os.path.abspath(__file__))))
  with open(tmp_path / "run.log", "w") as log:
    child = subprocess.Popen([sys.executable, str(script), str(data_dir), workdir,
                              str(marker)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.time() + 240
    while not marker.exists():
      assert child.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
      assert time.time() < deadline, "the run never reached its step-6 save"
      time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
  assert child.returncode == -signal.SIGKILL
  ckpt_dir = os.path.join(workdir, "sft", "checkpoints")
  entries = os.listdir(ckpt_dir)
  assert "3" in entries and "6" not in entries
  assert any(e.startswith("6.orbax-checkpoint-tmp") for e in entries), entries
  assert not os.path.exists(os.path.join(workdir, "sft", "summary.json"))
  # The same command again: resumes from step 3 and finishes exactly like the straight run.
  summary = sft.run(_tiny_config(data_dir, log_every=1), workdir)
  assert summary["complete"] and summary["steps"] == 6
  assert _losses(workdir) == _losses(straight)
  assert sorted(os.listdir(ckpt_dir)) == ["3", "6"]
