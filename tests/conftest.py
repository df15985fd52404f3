"""Shared fixtures. Eight simulated CPU devices are set up before JAX starts, so sharded
tests can build meshes; everything else runs on the first device as usual. The suite's time
is mostly XLA compilation of tiny models, so LLVM optimizes the generated code at level 0
and elementwise fusions use XLA's older IR emitters (--xla_cpu_use_fusion_emitters=false:
tests/test_speculative.py with test_trainer.py from a cold cache take 54-59 s instead of
77-93 s). Each program's machine code is generated in one piece
(--xla_cpu_parallel_codegen_split_count=1): with two workers on two cores there is no idle
core for XLA's parallel code generation, and splitting cost time (test_rollout.py,
test_multi_turn.py and test_verify.py from a cold cache: 60.4 s instead of 66.7 s). The same
programs; the machine code differs, so results may differ in rounding."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false"
                           " --xla_cpu_parallel_codegen_split_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, shared by both workers and the subprocess tests (they
# inherit the environment): modules release their compiled programs when they end (below),
# and many tests compile the same tiny programs, so later compiles become cache loads. It
# lives in the checkout's .pytest_cache, so a clean checkout starts it empty.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
    "jax_compilation_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top

# The longest files first: with two workers taking one file at a time, a long file picked
# up last would run alone at the end.
LONGEST_FIRST = ("test_rl.py", "test_reproduce.py", "test_main_job.py", "test_multiprocess.py",
                 "test_rl_aot.py", "test_hf_pipeline.py", "test_speculative.py",
                 "test_bench_device.py",
                 "test_sweep_cli.py", "test_sharding.py", "test_sft.py", "test_multi_turn.py",
                 "test_rollout.py", "test_episode_benchmark.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


@pytest.fixture(scope="session")
def one_device_env():
  """The environment for a subprocess that runs on one device (as on a laptop), with the
  suite's fast-compile flags above and its compilation cache."""
  flags = [f for f in os.environ["XLA_FLAGS"].split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return {**os.environ, "XLA_FLAGS": " ".join(flags)}


@pytest.fixture(scope="session")
def tiny_data_config(tmp_path_factory):
  """The data section of a tiny config, with its own data directory."""
  config = config_lib.base_config()
  config.data.data_dir = str(tmp_path_factory.mktemp("datasets"))
  config.data.num_train = 96
  config.data.num_test = 16
  config.data.num_rl = 16
  return config.data


@pytest.fixture(scope="session")
def tiny_data(tiny_data_config):
  """`tiny_data_config`'s typed settings (DataSettings, what the data pipelines take)."""
  config = config_lib.base_config()
  config.data = tiny_data_config
  return config_lib.settings(config).data


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_after_each_module():
  """The whole suite runs in one process: drop each module's compiled executables when it
  ends, so generated-code memory maps do not pile up towards vm.max_map_count (see
  bebop_jax.compilation.release_compiled)."""
  yield
  from bebop_jax import compilation  # pylint: disable=g-import-not-at-top
  compilation.release_compiled()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class RLSource:
  """SFT and MTP stages of the tiny policy on easy math, shared by the RL stage tests;
  `config(**rl)` is the RL stage's config from them, with `config.rl` overrides by dotted key
  (e.g. "train.stop_at_step", "asynchronous.enabled")."""
  data_dir: str
  workdir: str

  def config(self, **rl: Any):
    from experiments import rl_benchmark as bench  # pylint: disable=g-import-not-at-top
    return config_lib.validate(bench.apply_overrides(
        _rl_stage_config(self.data_dir, self.workdir), rl))


def _rl_stage_config(data_dir: str, source: str):
  config = config_lib.load_file(os.path.join(REPO, "configs", "rl_tiny.py"))
  config.data.data_dir = str(data_dir)
  # Easy math only, which 50 SFT steps teach the tiny policy partly: RL rewards vary. (Each
  # step is ~0.45 s on CPU at the suite's optimization level 0: the steps, not compiles,
  # were most of this fixture; the training accuracy is 0.99 by step 50.)
  for name in ("code", "agentic"):
    config.data.tasks[name].weight = 0.0
  config.data.tasks.math.knobs.update(max_operands=2, max_value=9, operators="+",
                                      paren_prob=0.0)
  config.data.num_train, config.data.num_test, config.data.num_rl = 60, 16, 16
  config.sft.train.num_steps = 50
  config.sft.train.log_every = 25
  config.sft.train.checkpoint_every = 50
  config.sft.optim.learning_rate = 1e-2
  config.sft.optim.warmup_steps = 5
  config.rl.init_from = source
  config.rl.kl_coef = 0.05
  config.rl.mtp.strategy = "periodic"
  config.rl.mtp.every = 2
  config.rl.eval.num_examples = 8
  return config


@pytest.fixture(scope="session")
def rl_source(tmp_path_factory) -> RLSource:
  """The SFT and MTP stages the RL stage tests start from (built once per test process)."""
  from bebop_jax import stages  # pylint: disable=g-import-not-at-top
  data_dir = str(tmp_path_factory.mktemp("rl_data"))
  workdir = str(tmp_path_factory.mktemp("rl_source"))
  config = config_lib.validate(_rl_stage_config(data_dir, ""))
  config.stages = ("sft", "mtp")
  stages.run(config, workdir)
  return RLSource(data_dir, workdir)
