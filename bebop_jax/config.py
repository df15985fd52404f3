"""The config schema, its defaults, and the one validation function run before any work.

Experiment files in configs/ start from `base_config()` and change values; they may not add
keys. `validate(config)` rejects a bad config with a `ConfigError` that names the key, the
value, and what is allowed. The schema grows with the stages; keep it small.
"""

from __future__ import annotations

import inspect
from typing import Any

import ml_collections

from bebop_jax import tasks as tasks_lib

STAGES = ("data",)  # stages of bebop_jax.main, run in this order


class ConfigError(ValueError):
  """A config value or key is not allowed."""


def task_knob_defaults(task_name: str) -> dict[str, Any]:
  """The difficulty knobs of a task with their default values."""
  cls = tasks_lib.task_class(task_name)
  return {name: p.default for name, p in inspect.signature(cls).parameters.items()
          if p.default is not inspect.Parameter.empty}


def base_config() -> ml_collections.ConfigDict:
  """Every key the project understands, with its default."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.stages = ("data",)

  c.data = ml_collections.ConfigDict()
  c.data.data_dir = "~/.cache/bebop_jax/datasets"
  c.data.seed = 0  # seed of example generation (train and test)
  c.data.num_train = 20_000
  c.data.num_test = 256
  c.data.tasks = ml_collections.ConfigDict()
  for name in tasks_lib.TASK_NAMES:
    c.data.tasks[name] = ml_collections.ConfigDict(
        {"weight": 1.0, "knobs": task_knob_defaults(name)})
  # SFT batches.
  c.data.seq_len = 256
  c.data.batch_size = 32
  c.data.packing = True
  # RL prompt batches.
  c.data.prompts_per_batch = 8
  c.data.group_size = 4
  c.data.max_prompt_len = 128

  c.preview = ml_collections.ConfigDict()
  c.preview.examples_per_task = 2
  return c


def _fail(key: str, value: Any, allowed: str):
  raise ConfigError(f"config.{key}={value!r} is not allowed: {allowed}")


def _check_keys(cfg: Any, schema: Any, prefix: str):
  """Every key of cfg must be in schema (recursively)."""
  for key in cfg.keys():
    full = f"{prefix}{key}"
    if key not in schema:
      raise ConfigError(f"config.{full} is not a known key; known keys under "
                        f"config.{prefix or '.'}: {', '.join(sorted(schema.keys()))}")
    if isinstance(schema[key], ml_collections.ConfigDict) and not full.endswith(".knobs"):
      if not isinstance(cfg[key], (ml_collections.ConfigDict, dict)):
        _fail(full, cfg[key], "must be a ConfigDict")
      _check_keys(cfg[key], schema[key], full + ".")


def _positive_int(cfg, key: str):
  value = _get(cfg, key)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    _fail(key, value, "must be a positive int")


def _get(cfg, key: str) -> Any:
  for part in key.split("."):
    cfg = cfg[part]
  return cfg


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks keys, types and values; returns the config unchanged or raises ConfigError."""
  _check_keys(config, base_config(), "")

  if not isinstance(config.seed, int):
    _fail("seed", config.seed, "must be an int")
  stages = tuple(config.stages) if isinstance(config.stages, (tuple, list)) else None
  if not stages or any(s not in STAGES for s in stages) or len(set(stages)) != len(stages):
    _fail("stages", config.stages, f"must be a non-empty tuple of distinct stages from {STAGES}")

  d = config.data
  for key in ("data.num_train", "data.num_test", "data.seq_len", "data.batch_size",
              "data.prompts_per_batch", "data.group_size", "data.max_prompt_len"):
    _positive_int(config, key)
  if not isinstance(d.data_dir, str) or not d.data_dir:
    _fail("data.data_dir", d.data_dir, "must be a non-empty path")
  if not isinstance(d.packing, bool):
    _fail("data.packing", d.packing, "must be True or False")

  total_weight = 0.0
  for name in tasks_lib.TASK_NAMES:
    weight = d.tasks[name].weight
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
      _fail(f"data.tasks.{name}.weight", weight, "must be a number >= 0")
    total_weight += weight
    knobs = dict(d.tasks[name].knobs)
    allowed = task_knob_defaults(name)
    for knob in knobs:
      if knob not in allowed:
        raise ConfigError(f"config.data.tasks.{name}.knobs.{knob} is not a knob of task "
                          f"{name!r}; its knobs are: {', '.join(sorted(allowed))}")
    try:
      tasks_lib.get_task(name, **knobs)
    except ValueError as e:
      raise ConfigError(f"config.data.tasks.{name}.knobs: {e}") from e
  if total_weight <= 0:
    _fail("data.tasks.*.weight", 0, "at least one task needs a positive weight")

  _positive_int(config, "preview.examples_per_task")
  return config
