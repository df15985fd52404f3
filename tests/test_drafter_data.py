"""The drafter dataset: its store (array_record through grain), packing with a cap on loss
targets, the trunk's cached features, the drafter's initialisation and the warm-start
schedule of the MTP stage."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax.stages import config as config_lib
from bebop_jax.data import drafter_store
from bebop_jax.decoding import diagnostics
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model import config as model_config
from bebop_jax.model import drafter_init
from bebop_jax.model import model as policy_lib
from bebop_jax.stages import mtp
from bebop_jax.train import drafter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p, c = int(rng.integers(2, 9)), int(rng.integers(1, 7))
    out.append({"tokens": rng.integers(3, 50, p + c).astype(np.int32),
                "loss_mask": np.r_[np.zeros(p), np.ones(c)].astype(np.int32),
                "task": ("math", "code")[i % 2], "reward": float(i % 3 == 0)})
  return out


def test_the_store_reads_back_every_split_as_written(tmp_path):
  store = drafter_store.DrafterStore(str(tmp_path / "store"))
  assert not store.has_split("train")
  train, test = _records(23), _records(5, seed=1)
  assert store.write_split("train", train, {"seconds": 1.5}, settings={"t": 1.0}) == 23
  store.write_split("test", test, {"seconds": 0.5})
  meta = store.meta()
  assert meta["splits"]["train"] == {"seconds": 1.5, "rollouts": 23}
  assert meta["splits"]["test"]["rollouts"] == 5 and meta["settings"] == {"t": 1.0}
  for split, written in (("train", train), ("test", test)):
    back = store.read_split(split)
    assert len(back) == len(written)
    for a, b in zip(back, written):
      np.testing.assert_array_equal(a["tokens"], b["tokens"])
      np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
      assert a["tokens"].dtype == np.int32 and a["task"] == b["task"]
      assert a["reward"] == b["reward"]
  # grain random access: the source is a MapDataset of decoded records.
  assert store.source("train")[7]["task"] == train[7]["task"]
  # A second store object sees the same data (nothing is held in memory).
  assert len(drafter_store.DrafterStore(store.path).read_split("test")) == 5


def test_an_interrupted_write_leaves_the_split_absent(tmp_path):
  store = drafter_store.DrafterStore(str(tmp_path))
  store.write_split("train", _records(4))

  def failing():
    yield from _records(3)
    raise RuntimeError("killed")

  with pytest.raises(RuntimeError):
    store.write_split("test", failing())
  assert store.has_split("train") and not store.has_split("test")
  assert list(store.meta()["splits"]) == ["train"]
  with pytest.raises(FileNotFoundError, match="no complete split 'test'"):
    store.read_split("test")
  bad = dict(_records(1)[0], loss_mask=np.ones(2, np.int32))
  with pytest.raises(ValueError, match="loss-mask entries"):
    store.write_split("bad", [bad])


def test_features_are_cached_atomically_and_memory_mapped(tmp_path):
  store = drafter_store.DrafterStore(str(tmp_path))
  x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  assert not store.has_features("f")
  store.write_features("f", x)
  got = store.features("f")
  assert isinstance(got, np.memmap) and not got.flags.writeable
  np.testing.assert_array_equal(got, x)
  assert sorted(os.listdir(tmp_path / "features")) == ["f.npy"]


def test_packing_caps_each_rows_loss_targets_and_lists_them():
  seqs = [(r["tokens"], r["loss_mask"]) for r in _records(40, seed=2)]
  rows = drafter.pack_rows(seqs, 24, max_targets=8)
  assert rows["rows"].shape == (len(rows["tokens"]), 8)
  per_row = rows["loss_mask"][:, 1:].sum(1)
  assert per_row.max() <= 8
  np.testing.assert_array_equal((rows["rows"] < 24).sum(1), per_row)
  np.testing.assert_array_equal(rows["rows"], mtp_losses.loss_rows(rows["loss_mask"], 8))
  # Every sequence is in exactly one segment, whole, with its mask.
  found = []
  for r in range(len(rows["tokens"])):
    seg = rows["segment_ids"][r]
    for s in sorted(set(seg[seg > 0].tolist())):
      idx = np.flatnonzero(seg == s)
      found.append((tuple(rows["tokens"][r, idx]), tuple(rows["loss_mask"][r, idx])))
  assert sorted(found) == sorted((tuple(t), tuple(m)) for t, m in seqs)
  # Without the cap the same sequences need fewer rows.
  assert len(drafter.pack_rows(seqs, 24)["tokens"]) < len(rows["tokens"])


@pytest.fixture(scope="module")
def tiny():
  config = dataclasses.replace(model_config.preset("tiny"), mtp_stop_gradient=True)
  return config, *policy_lib.init(config, seed=0)


def test_cached_trunk_features_give_the_in_step_loss(tiny):
  """The MTP step on cached features (`hidden=`) computes what it computes with the trunk
  in the step: the features are the trunk's h0 of the packed rows."""
  cfg, graphdef, state = tiny
  seqs = [(r["tokens"], r["loss_mask"]) for r in _records(12, seed=3)]
  rows = drafter.pack_rows(seqs, 16, max_targets=16)
  feats = drafter.trunk_features(graphdef, state, rows, batch_size=4)
  assert feats.shape == rows["tokens"].shape + (cfg.d_model,)
  config = config_lib.base_config()
  config.mtp.loss = "e2e_tv"
  loss_fn = mtp.make_loss_fn(config)
  batch = {k: jnp.asarray(v[:4]) for k, v in rows.items()}
  model = nnx.merge(graphdef, state)
  in_step, m_in = loss_fn(model, batch)
  cached, m_cached = loss_fn(model, dict(batch, hidden=jnp.asarray(feats[:4])))
  np.testing.assert_allclose(float(cached), float(in_step), rtol=1e-5)
  for k in ("alpha_1", "alpha_2", "kl_1"):
    np.testing.assert_allclose(float(m_cached[k]), float(m_in[k]), rtol=1e-5)
  assert drafter._features_name("train", rows) != drafter._features_name(  # pylint: disable=protected-access
      "train", dict(rows, tokens=rows["tokens"][::-1]))


def test_the_drafter_initialisations(tiny):
  cfg, _, state = tiny
  fresh = drafter_init.init_drafter(state, cfg, "fresh", seed=5)
  copied = drafter_init.init_drafter(state, cfg, "copy_last_block", seed=5,
                                     proj_init="identity", hidden_rms=2.0)
  assert drafter_init.init_drafter(state, cfg, "sft", seed=5) is state
  for name in ("wq", "w_down", "attn_norm"):
    last = np.asarray(state["layers"][name][...][-1])
    for m in range(cfg.num_mtp_modules):
      np.testing.assert_array_equal(np.asarray(copied["mtp"]["blocks"][name][...][m]), last)
    assert not np.array_equal(np.asarray(fresh["mtp"]["blocks"][name][...][0]), last) or \
        name == "attn_norm"
  e = cfg.d_model
  proj = np.asarray(copied["mtp"]["proj"][...][0])
  np.testing.assert_array_equal(proj, 2.0 * np.concatenate([np.eye(e), np.eye(e)]))
  np.testing.assert_array_equal(np.asarray(copied["mtp"]["hidden_norm"][...]), 1.0)
  # The trunk is untouched.
  np.testing.assert_array_equal(np.asarray(copied["embed"][...]), np.asarray(state["embed"][...]))
  with pytest.raises(ValueError, match="mtp.init='copy' is not allowed"):
    drafter_init.init_drafter(state, cfg, "copy", seed=0)


def test_the_binomial_interval_is_wilsons():
  lo, hi = diagnostics.binomial_interval(8, 10)
  assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
  assert diagnostics.binomial_interval(0, 0) == (0.0, 1.0)
  lo, hi = diagnostics.binomial_interval(0, 50)
  assert lo == pytest.approx(0.0, abs=1e-12) and 0.05 < hi < 0.08


def test_the_schedule_warms_up_with_its_loss_then_switches():
  config = config_lib.base_config()
  config.mtp.train.num_steps = 10
  assert mtp._phases(config) == [("e2e_tv", 10)]  # pylint: disable=protected-access
  config.mtp.warm_start.steps = 4
  assert mtp._phases(config) == [("kl", 4), ("e2e_tv", 10)]  # pylint: disable=protected-access
  config.mtp.warm_start.steps = 10
  assert mtp._phases(config) == [("kl", 10)]  # pylint: disable=protected-access
