"""The stages `bebop_jax.main` can run, in order, and the runner. Each is
`fn(config, workdir) -> None`.

This package is the only reader of a ConfigDict and of a workdir: config.py (the schema and
its validation into typed settings), sft / mtp / rl / eval (the stages), report (the eval
stage's pages), lineage (which stage's files live where), rollouts (config -> rollout
settings), decode_timing (the decode protocol), console (terminal output). The library
below takes arguments and settings; nothing there imports from here."""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import ml_collections

from bebop_jax.stages import config as config_lib
from bebop_jax import compilation
from bebop_jax import multihost
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.stages import lineage


def data_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Prepares every task dataset, prints examples with their rewards, checks both pipelines."""
  settings = config_lib.settings(config)
  d = settings.data
  report = {"tasks": {}}
  for name in tasks_lib.TASK_NAMES:
    if d.tasks[name].weight <= 0:
      continue
    start = time.perf_counter()
    source = pipeline.task_source(d, name, "train")
    task = tasks_lib.get_task(name, **d.tasks[name].knobs)
    examples = pipeline.eval_examples(d, name, settings.preview.examples_per_task)
    report["tasks"][name] = {"num_train": len(source), "num_test": d.num_test,
                             "num_rl": d.num_rl,
                             "prepare_s": round(time.perf_counter() - start, 2)}
    print(f"\n===== {name}: {len(source)} train / {d.num_test} test / {d.num_rl} RL examples "
          f"(knobs {dict(d.tasks[name].knobs)})")
    for ex in examples:
      wrong = ex.demonstration[:len(ex.demonstration) // 2]
      print(f"--- prompt:\n{ex.prompt}--- demonstration:\n{ex.demonstration}")
      print(f"--- reward(demonstration) = {task.reward(ex, ex.demonstration):.2f}   "
            f"reward(first half of it) = {task.reward(ex, wrong):.2f}")

  batch = next(iter(pipeline.sft_dataset(d, batch_size=d.batch_size, seq_len=d.seq_len,
                                         packing=d.packing, seed=settings.seed)))
  fill = float((batch["segment_ids"] > 0).mean())
  targets = float(batch["loss_mask"].mean())
  print(f"\nSFT batch: tokens {batch['tokens'].shape}, {fill:.1%} of positions filled, "
        f"{targets:.1%} are loss targets")
  r = settings.rl
  rl = next(iter(pipeline.rl_prompt_dataset(
      d, prompts_per_batch=r.prompts_per_batch, group_size=r.group_size,
      max_prompt_len=r.max_prompt_len, seed=settings.seed)))
  print(f"RL prompt batch: prompt_tokens {rl['prompt_tokens'].shape}, "
        f"group_ids {rl['group_ids'].tolist()}")
  report["sft_batch"] = {"shape": list(batch["tokens"].shape), "fill": fill,
                         "target_fraction": targets}
  if multihost.is_primary():
    with open(os.path.join(workdir, "data_summary.json"), "w") as f:
      json.dump(report, f, indent=2)


def sft_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Supervised fine-tuning of the policy (bebop_jax.stages.sft)."""
  from bebop_jax.stages import sft  # pylint: disable=g-import-not-at-top
  sft.run(config, workdir)


def mtp_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
  """MTP drafter training on the frozen SFT policy's rollouts (bebop_jax.stages.mtp)."""
  from bebop_jax.stages import mtp  # pylint: disable=g-import-not-at-top
  mtp.run(config, workdir)


def rl_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
  """GRPO with speculative rollouts (bebop_jax.stages.rl)."""
  from bebop_jax.stages import rl as stage  # pylint: disable=g-import-not-at-top
  stage.run(config, workdir)


def eval_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
  """The policy the job ends with measured: decode speed, acceptance against entropy,
  summary.json, plots and report.md (bebop_jax.stages.eval)."""
  from bebop_jax.stages import eval as eval_lib  # pylint: disable=g-import-not-at-top
  eval_lib.run(config, workdir)


STAGE_FNS: dict[str, Callable[[ml_collections.ConfigDict, str], None]] = {
    "data": data_stage,
    "sft": sft_stage,
    "mtp": mtp_stage,
    "rl": rl_stage,
    "eval": eval_stage,
}
assert tuple(STAGE_FNS) == config_lib.STAGES


def check_shards(config: ml_collections.ConfigDict) -> int:
  """The number of data shards of this run (multihost.data_shards: data.shards, 0 = one per
  process); a ConfigError when a batch does not split into them."""
  try:
    shards, local = multihost.data_shards(config.data.shards)
  except multihost.DistributedError as e:
    raise config_lib.ConfigError(str(e)) from e
  for key, value in (("data.batch_size", config.data.batch_size),
                     ("mtp.batch_size", config.mtp.batch_size),
                     ("rl.prompts_per_batch", config.rl.prompts_per_batch)):
    if value % shards:
      raise config_lib.ConfigError(
          f"config.{key}={value} does not split into {shards} data shards (data.shards="
          f"{config.data.shards}, {multihost.process_count()} processes): use a multiple")
  if shards > 1:
    print(f"[data] process {multihost.process_index()} of {multihost.process_count()} reads "
          f"data shards {', '.join(map(str, local))} of {shards}")
  return shards


def prepare_datasets(config: ml_collections.ConfigDict) -> None:
  """With several processes, process 0 prepares the task datasets (TFDS writes each once)
  while the others wait; then every process reads them. Nothing with one process (the
  stages prepare them on first use)."""
  if multihost.process_count() == 1:
    return
  if multihost.is_primary():
    data = config_lib.settings(config).data
    for name in data.task_names:
      pipeline.task_source(data, name, "train")
  multihost.barrier("datasets")


def run(config: ml_collections.ConfigDict, workdir: str, release_compiled: bool = True) -> None:
  """Runs the config's stages in the canonical order. `release_compiled` drops JAX's
  compiled programs after each stage (compilation.release_compiled: a long job on CPU would
  otherwise run out of memory maps); a caller running many small stages of one model keeps
  them, and later stages reuse the traced and compiled programs of earlier ones. Each
  stage tokenizes with the config's `data.tokenizer` (its data settings' `loaded_tokenizer`,
  passed down to what tokenizes); no tokenizer is set for the stages or left behind.
  <workdir>/timing.json gets each stage's seconds and, under "compile", the seconds of them
  spent compiling and the persistent compilation cache's hits (metrics.compile_stats); the
  times of stages an earlier invocation ran there, and this one does not, are kept."""
  from bebop_jax.stages import eval as eval_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import report  # pylint: disable=g-import-not-at-top
  timing = {"started_at": time.time(), "compile": {}}
  # Stages an earlier invocation ran in this workdir and this one does not (a job run in
  # pieces, e.g. stages=("rl","eval") after ("sft","mtp")) keep their times; the total
  # adds them to this invocation's wall clock.
  earlier = eval_lib.read_timing(workdir)
  for name in config_lib.STAGES:
    if name not in config.stages and f"{name}_s" in earlier:
      timing[f"{name}_s"] = earlier[f"{name}_s"]
      timing["compile"][name] = earlier.get("compile", {}).get(name)
  timing["earlier_s"] = sum(v for k, v in timing.items() if k.endswith("_s"))
  check_shards(config)
  prepare_datasets(config)
  for name in config_lib.STAGES:
    if name in config.stages:
      start, compiles = time.perf_counter(), metrics_lib.compile_stats()
      STAGE_FNS[name](config, workdir)
      if release_compiled:
        compilation.release_compiled()  # the next stage compiles its own functions
      timing[f"{name}_s"] = time.perf_counter() - start
      timing["compile"][name] = metrics_lib.compile_stats(since=compiles)
      eval_lib.write_timing(workdir, timing)  # the eval stage reports the earlier stages
      # Process 0 wrote the stage's files: every process sees them before the next stage.
      multihost.barrier(f"after_{name}")
  if any(n in config.stages for n in ("sft", "mtp", "rl", "eval")):
    summary = lineage.read_summary(workdir, "eval")
    # A rerun that skipped finished stages keeps the times of the run that did them.
    times = (summary or {}).get("timing") or timing
    print(f"\n== {os.path.abspath(workdir)} ==\n{report.run_summary(workdir, summary, times)}")
