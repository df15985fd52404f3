"""Shared fixtures: a tiny data config whose datasets are prepared once per session."""

from __future__ import annotations

import pytest

from bebop_jax import config as config_lib


@pytest.fixture(scope="session")
def tiny_data_config(tmp_path_factory):
  """The data section of a tiny config, with its own data directory."""
  config = config_lib.base_config()
  config.data.data_dir = str(tmp_path_factory.mktemp("datasets"))
  config.data.num_train = 96
  config.data.num_test = 16
  return config.data
