"""TFDS builders of the synthetic tasks (array_record files, no TensorFlow needed).

One builder per task (`bebop_math`, `bebop_code`, `bebop_agentic`). A builder config is
named after what determines its content (example counts, seed and a hash of the difficulty
knobs), so data made with other knobs never collides in a shared data directory. Splits:
  * train: examples from seeds derived from (seed, index);
  * test: held-out examples from a disjoint seed range whose prompts do not occur in train;
  * rl: RL training prompts from a third seed range, in neither train nor test (RL learns
    on prompts that SFT never saw, as in a real post-training pipeline).
Every record holds `prompt`, `demonstration` and `example_json` (the whole `Example`).

`prepare(task_name, knobs, ...)` builds on first use (TFDS writes into a temporary directory
and renames it when complete, so an interrupted build is redone, never read half-written)
and returns the builder; `builder.as_data_source()` gives random-access sources for grain.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator

import tensorflow_datasets as tfds

from bebop_jax import tasks as tasks_lib

_SEED_OFFSETS = {"test": 1 << 40, "rl": 2 << 40}  # held-out seeds never meet train seeds
_MAX_TEST_ATTEMPTS_FACTOR = 50


def config_name(num_train: int, num_test: int, num_rl: int, seed: int,
                knobs: dict[str, Any]) -> str:
  """A builder-config name that changes whenever the generated content would."""
  blob = json.dumps({"knobs": knobs, "seed": seed}, sort_keys=True, default=str)
  digest = hashlib.sha256(blob.encode()).hexdigest()[:10]
  return f"train{num_train}_test{num_test}_rl{num_rl}_seed{seed}_{digest}"


class _TaskBuilderConfig(tfds.core.BuilderConfig):

  def __init__(self, *, num_train: int, num_test: int, num_rl: int, seed: int,
               knobs: dict[str, Any]):
    super().__init__(name=config_name(num_train, num_test, num_rl, seed, knobs),
                     description=json.dumps(knobs, sort_keys=True, default=str))
    self.num_train = num_train
    self.num_test = num_test
    self.num_rl = num_rl
    self.seed = seed
    self.knobs = dict(knobs)


class _TaskBuilder(tfds.core.GeneratorBasedBuilder):
  """Writes `num_train` + `num_test` + `num_rl` examples of one task."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  TASK = ""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=f"Synthetic verifiable '{self.TASK}' task of bebop_jax.",
        features=tfds.features.FeaturesDict({
            "prompt": tfds.features.Text(),
            "demonstration": tfds.features.Text(),
            "example_json": tfds.features.Text(),
        }),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing is downloaded
    return {split: self._generate_examples(split) for split in ("train", "test", "rl")}

  def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, str]]]:
    cfg = self.builder_config
    task = tasks_lib.get_task(self.TASK, **cfg.knobs)
    if split == "train":
      for i in range(cfg.num_train):
        yield i, _record(task.sample(cfg.seed * cfg.num_train + i))
      return
    seen = {task.sample(cfg.seed * cfg.num_train + i).prompt for i in range(cfg.num_train)}
    if split == "rl":  # neither in train nor in test
      seen |= {ex.prompt for ex in self._held_out(task, "test", cfg.num_test, set(seen))}
    for i, example in enumerate(self._held_out(task, split, getattr(cfg, f"num_{split}"),
                                               seen)):
      yield i, _record(example)

  def _held_out(self, task, split: str, count: int, seen: set[str]
                ) -> list[tasks_lib.Example]:
    """`count` examples of the split's seed range with distinct prompts not in `seen`."""
    cfg = self.builder_config
    out = []
    for i in range(count * _MAX_TEST_ATTEMPTS_FACTOR):
      example = task.sample(_SEED_OFFSETS[split] + cfg.seed * count * 64 + i)
      if example.prompt in seen:
        continue
      seen.add(example.prompt)  # no duplicates inside the split either
      out.append(example)
      if len(out) == count:
        return out
    raise ValueError(
        f"task {self.TASK!r} with knobs {cfg.knobs} has too few distinct prompts: found only "
        f"{len(out)} {split} prompts for num_{split}={count} (they must differ from the "
        f"train{' and test' if split == 'rl' else ''} prompts); make the task harder or lower "
        f"num_{split}")


def _record(example: tasks_lib.Example) -> dict[str, str]:
  return {"prompt": example.prompt, "demonstration": example.demonstration,
          "example_json": example.to_json()}


class BebopMath(_TaskBuilder):
  TASK = "math"


class BebopCode(_TaskBuilder):
  TASK = "code"


class BebopAgentic(_TaskBuilder):
  TASK = "agentic"


BUILDERS = {"math": BebopMath, "code": BebopCode, "agentic": BebopAgentic}


def prepare(task_name: str, knobs: dict[str, Any], *, data_dir: str, num_train: int,
            num_test: int, num_rl: int, seed: int = 0) -> tfds.core.DatasetBuilder:
  """Builds the task's dataset into `data_dir` unless it is there already; returns the builder."""
  if task_name not in BUILDERS:
    raise ValueError(f"unknown task {task_name!r}; allowed: {', '.join(BUILDERS)}")
  tasks_lib.get_task(task_name, **knobs)  # bad knobs fail here, before any work
  data_dir = os.path.expanduser(data_dir)
  config = _TaskBuilderConfig(num_train=num_train, num_test=num_test, num_rl=num_rl, seed=seed,
                              knobs=knobs)
  builder = BUILDERS[task_name](data_dir=data_dir, config=config, file_format="array_record")
  if not builder.is_prepared():
    tfds.disable_progress_bar()
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return builder
