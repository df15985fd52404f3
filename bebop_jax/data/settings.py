"""Typed settings of `config.data` (the datasets, their tokenizer and the SFT batches) and
`config.preview` (bebop_jax.settings_base)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from bebop_jax import tasks as tasks_lib
from bebop_jax import settings_base
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.settings_base import (ConfigError, Row, Section, count, fail, flag, is_number,
                                     positive_int, setting, signature_rows)


def task_knob_defaults(task_name: str) -> dict[str, Any]:
  """The difficulty knobs of a task with their default values."""
  cls = tasks_lib.task_class(task_name)
  return {name: p.default for name, p in inspect.signature(cls).parameters.items()
          if p.default is not inspect.Parameter.empty}


@dataclasses.dataclass(frozen=True)
class TaskSettings(Section):
  """config.data.tasks.<name>: the task's share of the data and its difficulty knobs."""
  KEY = "data.tasks"
  name: str
  weight: float = setting(
      1.0, "share of the task in the SFT and RL data streams (0 = left out)",
      allowed="must be a number >= 0",
      check=lambda v: is_number(v) and not isinstance(v, bool) and v >= 0)
  knobs: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.key:
      object.__setattr__(self, "key", f"{self.KEY}.{self.name}")
    super().__post_init__()
    allowed = task_knob_defaults(self.name)
    for knob in self.knobs:
      if knob not in allowed:
        raise ConfigError(f"config.{self.key}.knobs.{knob} is not a knob of task "
                          f"{self.name!r}; its knobs are: {', '.join(sorted(allowed))}")
    try:
      tasks_lib.get_task(self.name, **self.knobs)
    except ValueError as e:
      raise ConfigError(f"config.{self.key}.knobs: {e}") from e


def _default_tasks() -> dict[str, TaskSettings]:
  return {name: TaskSettings(name, 1.0, task_knob_defaults(name))
          for name in tasks_lib.TASK_NAMES}


_TOKENIZER_ALLOWED = (f"must be {tokenizer_lib.CHAR!r} or the path of a Hugging Face "
                      f"{tokenizer_lib.HF_FILE} (or of a directory holding one)")


@dataclasses.dataclass(frozen=True)
class DataSettings(Section):
  """config.data: the tasks' datasets, their tokenizer and the SFT batches.

  Checking it loads the tokenizer (the vocabulary check needs its size; a bad file fails
  here, before any work): `loaded_tokenizer`."""
  KEY = "data"
  data_dir: str = setting("~/.cache/bebop_jax/datasets",
                          "where the TFDS datasets of the tasks are built and read",
                          allowed="must be a non-empty path",
                          check=lambda v: isinstance(v, str) and bool(v))
  seed: int = setting(0, "seed of example generation (train and test)")
  num_train: int = positive_int(20_000, "training examples per task")
  num_test: int = positive_int(256, "held-out test examples per task")
  num_rl: int = positive_int(1024, "RL training prompts per task (in neither train nor test)")
  tokenizer: str = setting(
      tokenizer_lib.CHAR, f"{tokenizer_lib.CHAR!r} (character level), or the path of a "
      f"Hugging Face {tokenizer_lib.HF_FILE} or of a directory holding one; "
      "checking the data section loads it (DataSettings.loaded_tokenizer)",
      allowed=_TOKENIZER_ALLOWED)
  chat_format: bool = flag(
      False, "True: prompts and completions in the checkpoint's chat format (its "
      "tokenizer_config.json chat template; plain-text answer lines; the template's end of "
      "turn as eos)",
      allowed="must be True or False (True: prompts and completions in the chat template of "
      "data.tokenizer's directory; docs/usage.md)")
  tasks: dict[str, TaskSettings] = dataclasses.field(default_factory=_default_tasks)
  seq_len: int = positive_int(256, "SFT row length in tokens (longer demonstrations are "
                              "dropped)")
  batch_size: int = positive_int(32, "SFT rows per step (the global batch)")
  packing: bool = flag(True, "pack several examples into each SFT row (False: one example "
                       "per row, padded)")
  canonical_examples: int = count(
      0, "the first this-many examples of the SFT stream use the canonical demonstration; "
      "later visits sample a solution path (the tasks' fork knobs): the policy learns the "
      "skills on one path before it sees the forks")
  shards: int = count(
      0, "the SFT and RL data streams come in this many shards, each a grain pipeline over "
      "its slice of the datasets giving its share of every batch; a process of a run over "
      "several reads only its shards (bebop_jax.multihost). 0 = one per process. A "
      "one-process run with data.shards=N reads the batches an N-process run reads",
      note=" (0 = one per process)", bools=False)
  loaded_tokenizer: tokenizer_lib.BaseTokenizer = dataclasses.field(
      init=False, repr=False, compare=False)

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "loaded_tokenizer", self._load_tokenizer())
    if self.shards and self.batch_size % self.shards:
      self.fail("batch_size", f"must be a multiple of data.shards={self.shards} (each shard "
                "gives an equal share of a batch)")
    if sum(t.weight for t in self.tasks.values()) <= 0:
      fail(self.where("tasks.*.weight"), 0, "at least one task needs a positive weight")

  def _load_tokenizer(self) -> tokenizer_lib.BaseTokenizer:
    spec = self.tokenizer
    if not isinstance(spec, str) or not spec:
      self.fail("tokenizer", _TOKENIZER_ALLOWED)
    path = os.path.expanduser(spec)
    if spec != tokenizer_lib.CHAR and not os.path.exists(path):
      self.fail("tokenizer", f"{_TOKENIZER_ALLOWED}; there is no such file or directory"
                + ("" if path == spec else f" {path!r}"))
    try:
      return tokenizer_lib.load_tokenizer(spec, chat_format=self.chat_format)
    except FileNotFoundError as e:
      self.fail("tokenizer", f"{_TOKENIZER_ALLOWED}; {e}")
    except ValueError as e:
      self.fail("tokenizer", str(e))

  @property
  def task_names(self) -> list[str]:
    """The tasks with a positive weight, in TASK_NAMES order."""
    return [n for n in tasks_lib.TASK_NAMES if n in self.tasks and self.tasks[n].weight > 0]


@dataclasses.dataclass(frozen=True)
class PreviewSettings(Section):
  """config.preview: what the data stage prints."""
  KEY = "preview"
  examples_per_task: int = positive_int(2, "examples of each task the data stage prints")


def task_rows() -> dict[str, Row]:
  """config.data.tasks: each task's weight and its knobs (documented by the task class)."""
  rows = {}
  for name in tasks_lib.TASK_NAMES:
    rows.update(settings_base.reference_rows(TaskSettings, f"data.tasks.{name}."))
    cls = tasks_lib.task_class(name)
    where = f"bebop_jax/tasks/{cls.__module__.rsplit('.', 1)[-1]}.py"
    rows.update(signature_rows(cls, f"data.tasks.{name}.knobs.",
                               f"checked by the {name} task ({cls.__name__}, {where})"))
  return rows
