"""One job as two JAX processes on localhost: `python -m bebop_jax.main` with a loopback
coordinator, CPU collectives over gloo and one CPU device per process, against the same job
in one process with two devices (the same global mesh of two devices).

Both read the data in two shards (data.shards=2): each of the two processes reads one,
the one process reads both. SFT, MTP and RL then see the same global batches, so their
losses, metrics and parameters must be equal; the two-process RL stage is stopped after
its first step and rerun, which must resume exactly. The job is rl_tiny on math only,
shrunk to a few steps; its RL rewards are shaped by the overlong penalty, so an untrained
policy's rollouts of different lengths give the policy update a nonzero gradient.

The unit tests below check the pieces in this process: the shards' rows, the iterator's
checkpoint, and that with one process the helpers leave everything as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bebop_jax import multihost
from bebop_jax.data import pipeline
from bebop_jax.train import drafter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240  # each launch; a hung rendezvous fails the test instead of the suite

JOB = ["--config=configs/rl_tiny.py",
       "--config.data.shards=2",
       "--config.data.tasks.code.weight=0", "--config.data.tasks.agentic.weight=0",
       "--config.data.seq_len=96",
       "--config.sft.train.num_steps=2", "--config.sft.train.log_every=1",
       "--config.sft.train.checkpoint_every=2",
       "--config.eval.num_examples=1", "--config.eval.max_new_tokens=16",
       "--config.eval.prompt_buckets=(32,64)",
       "--config.mtp.data.max_new_tokens=16", "--config.mtp.eval_online=False",
       "--config.mtp.eval_modes=('rejection',)", "--config.mtp.train.num_steps=2",
       "--config.rl.max_prompt_len=32", "--config.rl.rollout.max_new_tokens=16",
       "--config.rl.train.num_steps=2", "--config.rl.eval.num_examples=1",
       "--config.rl.eval.modes=('rejection',)", "--config.rl.acceptance_modes=('rejection',)",
       "--config.rl.overlong=penalty", "--config.rl.overlong_buffer=16"]


def _timing(key: str) -> bool:
  """Seconds, rates and compile artifacts differ from run to run; the rest must not."""
  return key == "time" or key.endswith("_s") or any(
      w in key for w in ("flops", "share", "memory_", "utilization"))


def _env(devices: int) -> dict[str, str]:
  """The suite's environment (fast-compile flags, compilation cache) with `devices` CPU
  devices per process."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={devices}")
  return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _main(workdir, data_dir, *extra) -> list[str]:
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(str(workdir), "cache"))
  return [sys.executable, "-m", "bebop_jax.main", *JOB, f"--workdir={workdir}",
          f"--config.data.data_dir={data_dir}", f"--compilation_cache={cache}", *extra]


def _launch(*jobs: tuple[list[str], int]) -> list[tuple[int, str]]:
  """Runs the (command, CPU devices) jobs at once; [(exit status, output)] in order."""
  procs = [subprocess.Popen(c, cwd=REPO, env=_env(devices), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for c, devices in jobs]
  out, deadline = [], time.monotonic() + TIMEOUT_S
  try:
    for p in procs:
      text, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
      out.append((p.returncode, text))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return out


def _two_processes(workdir, data_dir, *extra, per_process=((), ()), timeout_s=60
                   ) -> list[tuple[list[str], int]]:
  """The jobs of the two processes of one run (one CPU device each)."""
  port = _free_port()
  return [(_main(workdir, data_dir, *extra, *per_process[i], f"--coordinator=127.0.0.1:{port}",
                 "--num_processes=2", f"--process_id={i}",
                 f"--distributed_timeout={timeout_s}"), 1) for i in (0, 1)]


def _check_ok(results):
  for i, (code, text) in enumerate(results):
    assert code == 0, f"process {i} exited with {code}:\n{text[-6000:]}"


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not _timing(k)} for r in records]


def _stored_arrays(path: str) -> dict[str, np.ndarray]:
  """Every array of an orbax state item, as numpy."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.PyTreeCheckpointer() as reader:
    tree = reader.metadata(path).item_metadata.tree
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    got = reader.restore(path, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(got)}


def test_two_processes_train_as_one_and_resume_exactly(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  # The one-process run (two devices) and the two-process run side by side; the second
  # stops its RL stage after step 1, and its rerun resumes there.
  results = _launch((_main(one, tmp_path / "data1"), 2),
                    *_two_processes(two, tmp_path / "data2",
                                    "--config.rl.train.stop_at_step=1"))
  _check_ok(results)
  assert "[data] process 0 of 1 reads data shards 0, 1 of 2" in results[0][1]
  assert "[data] process 0 of 2 reads data shards 0 of 2" in results[1][1]
  assert "[data] process 1 of 2 reads data shards 1 of 2" in results[2][1]
  assert "[rl] stopped at step 1 of 2" in results[1][1]
  rerun = _launch(*_two_processes(two, tmp_path / "data2"))
  _check_ok(rerun)
  for _, text in rerun:
    assert "[rl] resumed from step 1" in text

  # Each process saved its own reader's position, and only process 0 wrote the files.
  data = os.path.join(two, "sft", "checkpoints", "2", "data")
  assert sorted(f for f in os.listdir(data) if f.startswith("process_")) == [
      "process_0-of-2.json", "process_1-of-2.json"]
  assert os.path.exists(os.path.join(two, "log.process1.txt"))

  got, want = _metrics(two), _metrics(one)
  assert [(r["stage"], r["step"]) for r in got] == [(r["stage"], r["step"]) for r in want]
  assert got == want
  losses = {(r["stage"], r["step"]): r["loss"] for r in want if "loss" in r}
  assert {s for s, _ in losses} == {"sft", "mtp", "rl"}
  assert losses[("rl", 2)] != 0.0  # the resumed step updated the policy
  for stage, step in (("sft", 2), ("mtp", 2), ("rl", 2)):
    a = _stored_arrays(os.path.join(one, stage, "checkpoints", str(step), "state"))
    b = _stored_arrays(os.path.join(two, stage, "checkpoints", str(step), "state"))
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"{stage} {key}")


def test_start_up_errors_stop_every_process_with_a_message(tmp_path):
  # Two processes given different configs; a process whose coordinator never comes; a
  # coordinator (process 0) whose other process never comes.
  ports = [_free_port() for _ in range(2)]
  alone = [_main(tmp_path / f"w{i}", tmp_path / "data", f"--coordinator=127.0.0.1:{ports[i]}",
                 "--num_processes=2", f"--process_id={i}", "--distributed_timeout=2")
           for i in (0, 1)]
  *mismatch, (code0, text0), (code1, text1) = _launch(
      *_two_processes(tmp_path / "w", tmp_path / "data", "--config.stages=('data',)",
                      per_process=((), ("--config.seed=1",))), (alone[0], 1), (alone[1], 1))
  for code, text in mismatch:
    assert code == 2, text[-3000:]
    assert "were started with different configs" in text, text[-3000:]
    assert "seed: process 0 0, process 1 1" in text, text[-3000:]
  assert code1 == 2, text1[-3000:]
  assert f"process 1 of 2: no coordinator answered at 127.0.0.1:{ports[1]} within 2 s" in text1
  assert "--process_id=0" in text1
  assert code0 == 2, text0[-3000:]
  assert (f"process 0 of 2: the run did not start within 2 s: the coordinator is at "
          f"127.0.0.1:{ports[0]}") in text0, text0[-3000:]
  assert "did not all connect" in text0


# ----------------------------------------------------------------------------- the pieces


def test_sft_shards_split_each_batch_between_disjoint_readers(tiny_data):
  cfg = dataclasses.replace(tiny_data, tasks={
      n: dataclasses.replace(t, weight=0.0 if n in ("code", "agentic") else t.weight)
      for n, t in tiny_data.tasks.items()})
  batches = [next(iter(pipeline.sft_dataset(cfg, batch_size=4, seq_len=96, shard=(s, 2))))
             for s in range(2)]
  for batch in batches:
    assert batch["tokens"].shape == (2, 96)
  # One shard is the one stream, as before.
  one = next(iter(pipeline.sft_dataset(cfg, batch_size=4, seq_len=96)))
  np.testing.assert_array_equal(
      one["tokens"], next(iter(pipeline.sft_dataset(cfg, batch_size=4, seq_len=96,
                                                    shard=(0, 1))))["tokens"])
  # Shard s packs only examples s, s + 2, ... of the split.
  source = pipeline.task_source(cfg, "math", "train")
  text = lambda r: r.decode() if isinstance(r, bytes) else str(r)
  prompts = [{text(source[i]["prompt"]) for i in range(s, len(source), 2)} for s in range(2)]
  only = [prompts[0] - prompts[1], prompts[1] - prompts[0]]
  decode = cfg.loaded_tokenizer.decode
  for s, batch in enumerate(batches):
    rows = [decode(row.tolist(), strip_pad=True) for row in batch["tokens"]]
    assert any(p in row for row in rows for p in only[s])
    assert not any(p in row for row in rows for p in only[1 - s])

  rl = [next(iter(pipeline.rl_prompt_dataset(cfg, prompts_per_batch=2, group_size=2,
                                             max_prompt_len=64, shard=(s, 2))))
        for s in range(2)]
  assert [b["group_ids"].tolist() for b in rl] == [[0, 0], [1, 1]]


def test_mtp_row_shards_are_the_rows_of_the_same_batches():
  rows = {"tokens": np.arange(10 * 3, dtype=np.int32).reshape(10, 3)}
  whole = iter(drafter.train_dataset(rows, 4, seed=3))
  parts = [iter(drafter.train_dataset(rows, 4, seed=3, shard=(s, 2))) for s in range(2)]
  for _ in range(5):  # past the first epoch
    got = np.concatenate([next(p)["tokens"] for p in parts])
    np.testing.assert_array_equal(got, next(whole)["tokens"])


def test_sharded_batches_resume_from_their_saved_position():
  rows = {"tokens": np.arange(12 * 2, dtype=np.int32).reshape(12, 2)}
  make = lambda: pipeline.process_iterator(
      [drafter.train_dataset(rows, 4, seed=1, shard=(s, 2)) for s in range(2)])
  it = make()
  assert isinstance(it, pipeline.ShardedBatches)
  next(it)
  state = it.get_state()
  want = next(it)["tokens"]
  again = make()
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["tokens"], want)
  with pytest.raises(ValueError, match="same data.shards"):
    pipeline.ShardedBatches([iter([])]).set_state(state)


def test_one_process_is_left_as_it_was():
  assert multihost.process_count() == 1 and multihost.is_primary()
  assert multihost.data_shards(0) == (1, (0,))
  assert multihost.data_shards(2) == (2, (0, 1))
  batch = {"x": np.arange(8, dtype=np.int32)}
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
  sh = {"x": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))}
  placed = multihost.put_batch(batch, sh)["x"]
  assert placed.sharding == sh["x"]
  np.testing.assert_array_equal(placed, batch["x"])
  assert multihost.global_example(batch)["x"] is batch["x"]
  tree = {"a": placed}
  assert multihost.to_local(tree) is tree
  assert multihost.gather_objects({"k": 1}) == [{"k": 1}]
  multihost.check_same({"seed": "0"})
  multihost.barrier("nothing")
