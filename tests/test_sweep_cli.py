"""experiments.sweep: get_sweep entries, printed commands that the main CLI accepts, the
tpu_vm launcher, and a local sweep that resumes after an interruption."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax import sharding
from bebop_jax import stages
from experiments import sweep
from bebop_jax.losses.mtp import LOSSES
from bebop_jax.train import metrics as metrics_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MTP_SMALL = os.path.join(REPO, "configs", "mtp_small.py")


def _print_commands(*args):
  out = subprocess.run([sys.executable, "-m", "experiments.sweep", f"--config={MTP_SMALL}",
                        "--workdir=/sweeps/mtp", "--print_commands", *args], cwd=REPO,
                       capture_output=True, text=True, check=True)
  return out.stdout.strip().splitlines()


def test_print_commands_gives_one_main_command_per_entry_that_the_cli_accepts():
  lines = _print_commands()
  assert len(lines) == len(LOSSES)
  for i, (line, loss) in enumerate(zip(lines, LOSSES)):
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "bebop_jax.main"]
    assert f"--workdir=/sweeps/mtp/{i:02d}_loss={loss}" in argv
    # The main CLI's own flag parsing takes the overrides.
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                             lock_config=True, sys_argv=argv[2:])
    values.mark_as_parsed()
    values(["main"] + [a for a in argv[3:] if a.startswith("--config")], known_only=True)
    assert holder.value.mtp.loss == loss


def test_tpu_vm_launcher_prints_the_gcloud_form_with_distributed_initialisation():
  lines = _print_commands("--launcher=tpu_vm", "--tpu=pod-256", "--zone=us-east5-b",
                          "--project=lab")
  argv = shlex.split(lines[0])
  assert argv[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-256",
                      "--zone=us-east5-b", "--project=lab"]
  assert argv[8] == "--worker=all"
  remote = argv[9].removeprefix("--command=")
  assert remote.startswith("cd ~/bebop_jax && python -m bebop_jax.main ")
  assert "--distributed=on" in remote and "--config.mtp.loss=ce" in remote
  with pytest.raises(ValueError, match="needs --tpu"):
    sweep.command("c.py", sweep.entries([{}], "/w")[0], launcher="tpu_vm")


def test_multihost_initialisation_decision():
  assert not sharding.multihost("auto", {})
  assert not sharding.multihost("auto", {"TPU_WORKER_HOSTNAMES": "10.0.0.2"})
  assert sharding.multihost("auto", {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})
  assert sharding.multihost("auto", {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"})
  assert sharding.multihost("on", {}) and not sharding.multihost("off",
                                                                 {"JAX_COORDINATOR_ADDRESS": "x"})


def test_a_config_without_get_sweep_and_a_bad_entry_are_clear_errors(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="defines no get_sweep"):
    config_lib.load_sweep(os.path.join(REPO, "configs", "sft_tiny.py"))
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(arg=None):\n  return None\n"
                 "def get_sweep(arg=None):\n  return [('mtp.loss', 'ce')]\n")
  with pytest.raises(config_lib.ConfigError, match="each entry must be a dict"):
    config_lib.load_sweep(str(bad))
  with pytest.raises(config_lib.ConfigError, match="config.mtp.los is not a known key"):
    config_lib.apply_overrides(config_lib.base_config(), {"mtp.los": "ce"})


def test_a_local_sweep_resumes_after_an_interruption(tmp_path):
  """Two SFT entries; Ctrl-C in the second after its step-3 checkpoint. The rerun skips the
  finished entry, resumes the second from its checkpoint, and collects both summaries."""
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(
      "import os\nfrom bebop_jax.stages import config as config_lib\n"
      f"def get_config(arg=None):\n"
      f"  c = config_lib.load_file({os.path.join(REPO, 'configs', 'sft_tiny.py')!r})\n"
      f"  c.data.data_dir = {str(tmp_path / 'data')!r}\n  return c\n"
      "def get_sweep(arg=None):\n"
      "  return [{'sft.optim.learning_rate': 1e-3}, {'sft.optim.learning_rate': 3e-3}]\n")
  workdir = str(tmp_path / "sweep")
  calls = []

  def interrupted(config, entry_dir):
    calls.append(os.path.basename(entry_dir))
    if len(calls) == 2:
      config.sft.train.stop_at_step = 3
      stages.run(config, entry_dir)
      raise KeyboardInterrupt
    stages.run(config, entry_dir)

  with pytest.raises(KeyboardInterrupt):
    sweep.run_local(str(cfg), None, workdir, run_fn=interrupted)
  names = ["00_learning_rate=0.001", "01_learning_rate=0.003"]
  assert calls == names
  status = json.load(open(os.path.join(workdir, "sweep.json")))
  assert list(status["done"]) == names[:1]

  calls.clear()
  rows = sweep.run_local(str(cfg), None, workdir,
                         run_fn=lambda c, d: (calls.append(os.path.basename(d)),
                                              stages.run(c, d)))
  assert calls == names[1:]
  starts = [r["step"] for r in metrics_lib.read_metrics(os.path.join(workdir, names[1]), "sft")
            if r.get("event") == "start"]
  assert starts == [0, 3]  # the second entry resumed from its checkpoint
  assert [r["name"] for r in rows] == names
  assert all(r["stages"] == ["sft"] and "sft pass@1" in r for r in rows)
  assert "| 01_learning_rate=0.003 | sft |" in open(os.path.join(workdir, "sweep.md")).read()
