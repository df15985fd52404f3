"""Shared fixtures. Eight simulated CPU devices are set up before JAX starts, so sharded
tests can build meshes; everything else runs on the first device as usual. The suite's time
is mostly XLA compilation of tiny models, so LLVM optimizes the generated code at level 0
(the same programs; the machine code is less tuned, so results may differ in rounding)."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from bebop_jax import config as config_lib  # pylint: disable=g-import-not-at-top


@pytest.fixture(scope="session")
def tiny_data_config(tmp_path_factory):
  """The data section of a tiny config, with its own data directory."""
  config = config_lib.base_config()
  config.data.data_dir = str(tmp_path_factory.mktemp("datasets"))
  config.data.num_train = 96
  config.data.num_test = 16
  config.data.num_rl = 16
  return config.data


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_after_each_module():
  """The whole suite runs in one process: drop each module's compiled executables when it
  ends, so generated-code memory maps do not pile up towards vm.max_map_count (see
  bebop_jax.decoding.benchmark.release_compiled)."""
  yield
  from bebop_jax.decoding import benchmark  # pylint: disable=g-import-not-at-top
  benchmark.release_compiled()
