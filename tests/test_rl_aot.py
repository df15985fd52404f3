"""Ahead-of-time compile of both RL programs on a split placement (bebop_jax.rl.aot).

The pod config (configs/pod_qwen3_rl.py:8b) is compiled by experiments/aot_compile_rl.py in
a subprocess on 256 simulated devices (128 learner + 128 rollout; conftest.py's 8 devices
are not inherited); the 1.7B preset is compiled in process on conftest.py's 8 devices split
4 + 4. Both from abstract state: nothing is materialised.
"""

import json
import os
import subprocess
import sys
import time

import jax
import pytest

from bebop_jax.stages import config as config_lib
from bebop_jax.rl import aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "pod_qwen3_rl.py")
POD_DEVICES = 256


def _check_split(result: dict, n_learner: int, n_rollout: int):
  learner, rollout = result["learner"], result["rollout"]
  ids_l, ids_r = set(learner["input_devices"]), set(rollout["input_devices"])
  assert len(ids_l) == n_learner and len(ids_r) == n_rollout, (len(ids_l), len(ids_r))
  assert not ids_l & ids_r
  # The learner takes the first devices, the rollouts the rest.
  assert ids_l == set(learner["mesh"]["devices"]) == set(range(n_learner))
  assert ids_r == set(rollout["mesh"]["devices"]) == set(range(n_learner,
                                                               n_learner + n_rollout))
  for info in (learner, rollout):
    assert info["compile_s"] > 0
    assert info["memory"]["argument_size_in_bytes"] > 0, info["memory"]
  # The learner's parameters and optimizer state are sharded over all its devices (norm
  # scales aside), not replicated; the batch's share is at most all of it.
  assert learner["state_bytes_per_device"] < 1.1 * learner["state_bytes"] / n_learner
  assert learner["memory"]["argument_size_in_bytes"] < (
      1.1 * learner["state_bytes"] / n_learner + learner["batch_bytes"])
  # The arguments hold the trunk and its optimizer state (the frozen MTP modules are unused
  # by the policy loss, so jit drops them), donated: updated in place.
  donated = learner["donated_bytes_per_device"]
  assert donated <= learner["state_bytes_per_device"]
  assert learner["memory"]["argument_size_in_bytes"] >= donated
  assert learner["memory"]["alias_size_in_bytes"] >= 0.99 * donated
  # Each rollout replica splits the parameters over its tensor axis (4 or 2 ways here).
  tensor = rollout["mesh"]["shape"]["tensor"]
  assert rollout["state_bytes_per_device"] < 1.1 * rollout["state_bytes"] / tensor
  assert rollout["memory"]["argument_size_in_bytes"] < (
      1.1 * rollout["state_bytes"] / tensor + 2**20)


def test_pod_rl_programs_compile_on_a_simulated_split_pod(tmp_path, one_device_env):
  out = tmp_path / "aot.json"
  env = dict(one_device_env)  # the script sets its own device count
  t0 = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "aot_compile_rl.py"),
       f"--config={CONFIG}:8b", f"--num_devices={POD_DEVICES}", f"--out={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  seconds = time.perf_counter() - t0
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  result = json.loads(out.read_text())
  assert result["num_devices"] == POD_DEVICES
  assert result["learner"]["mesh"]["shape"] == {"fsdp": 32, "tensor": 4}
  assert result["rollout"]["mesh"]["shape"] == {"data": 32, "tensor": 4}
  assert result["learner"]["program"] == "policy_update"
  assert result["rollout"]["program"] == "speculative.start"
  # rl.asynchronous decoupled: the stale-batch update with the proximal log-probs.
  assert "proximal_logprobs" in result["learner"]["batch_keys"]
  assert (result["learner"]["rows"], result["learner"]["length"]) == (128, 512 + 1024)
  assert (result["rollout"]["rows"], result["rollout"]["prompt_len"]) == (256, 512)
  _check_split(result, 128, 128)
  assert "learner policy_update" in proc.stdout and "rollout speculative.start" in proc.stdout
  # The partitioner never had to replicate a whole tensor to reshard it.
  assert "Involuntary full rematerialization" not in proc.stderr
  print(f"\n{proc.stdout}subprocess {seconds:.1f}s")


def test_split_rl_programs_compile_in_process_on_disjoint_halves(capfd):
  assert jax.device_count() == 8, "conftest.py should simulate 8 CPU devices"
  config = config_lib.load_file(CONFIG, "1p7b")
  for mesh in (config.rl.placement.learner_mesh, config.rl.placement.rollout_mesh):
    mesh.shape = (-1, 2)
  settings = config_lib.settings(config)  # validates it
  t0 = time.perf_counter()
  result = aot.compile_programs(settings)
  seconds = time.perf_counter() - t0
  assert result["learner"]["mesh"]["shape"] == {"fsdp": 2, "tensor": 2}
  assert result["rollout"]["mesh"]["shape"] == {"data": 2, "tensor": 2}
  _check_split(result, 4, 4)
  # Nothing was materialised: no live array is anywhere near a parameter's size.
  assert max((x.nbytes for x in jax.live_arrays()), default=0) < 2**26
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  with capfd.disabled():
    print(f"\nin process: learner {result['learner']['compile_s']:.1f}s, rollout "
          f"{result['rollout']['compile_s']:.1f}s, total {seconds:.1f}s")


def test_compile_programs_needs_a_split_placement():
  config = config_lib.load_file(CONFIG, "1p7b")
  config.rl.placement.mode = "colocated"
  with pytest.raises(aot.AotError, match="placement.mode='colocated' is not allowed"):
    aot.compile_programs(config_lib.settings(config))


def test_pod_rl_config_names_the_allowed_sizes():
  with pytest.raises(ValueError, match=r"pod_qwen3_rl.py:3b is not allowed: one of "
                                       r"\['1p7b', '8b'\]"):
    config_lib.load_file(CONFIG, "3b")
