r"""Learner-step throughput: the training path against the dense reference, in one process.

  python experiments/bench_train.py --config=configs/laptop.py \
      --out=runs/bench_train.json

For each stage (SFT with its joint MTP loss; the MTP stage's loss on a frozen trunk) and
each path it compiles the real train step (trainer.make_train_step: loss, gradients, AdamW,
state donated) at the config's batch shape and times it on the same batch of the config's
SFT data. The paths are the config as given ("new") and the config with --baseline applied
("old": dense attention, every intermediate kept). The `rl` stage times the RL learner's
whole update call (rl/learner.py: batch building, rl.minibatches policy updates) on one RL
step's prompts (config.rl, its first batch) with the tasks' demonstrations as completions
(every other one with its last character cut, so groups have mixed rewards): "new" packs
the rollouts (rl.packing), "old" gives each its own row and takes --baseline too; its model
FLOPs count the rollouts' own tokens, so both paths get the same number. Timed steps alternate between the paths,
so both see the same machine load. Reported per path: step time (median and min), model
FLOP/s (train/flops.py) and their ratio to a plain matmul measured here first, the compiled
step's temporary memory, and the first step's loss; then the old/new ratios (of the
medians and of the minima: on a shared machine the minimum is the least disturbed step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax import rollout, sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig
from bebop_jax.train import flops as flops_lib
from bebop_jax.rl import learner as learner_lib
from bebop_jax.stages import mtp, sft
from bebop_jax.train import optimizer as optimizer_lib, trainer

STAGES = ("sft", "mtp", "rl")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/laptop.py",
                                          "Experiment config.", lock_config=False)
_STAGES = flags.DEFINE_list("stages", list(STAGES), f"Steps to time, of {STAGES}.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per path (after one warm-up).")
_BASELINE = flags.DEFINE_string("baseline", "attention=dense,remat=none",
                                "model.* overrides of the old path, k=v,k=v.")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def parse_overrides(text: str) -> dict[str, object]:
  """'a=1,b=x' -> {'a': 1, 'b': 'x'} (ints where they parse)."""
  out = {}
  for item in filter(None, text.split(",")):
    if "=" not in item:
      raise ValueError(f"--baseline item {item!r} is not allowed: expected key=value")
    key, value = item.split("=", 1)
    out[key] = int(value) if value.lstrip("-").isdigit() else value
  return out


def _step_and_state(config, stage: str, model_cfg: ModelConfig, batch, mesh, rules):
  """(compiled step, placed TrainState, model FLOPs per step) of `stage` for `model_cfg`."""
  model = policy_lib.Policy(model_cfg, rngs=nnx.Rngs(config.seed))
  if stage == "sft":
    s = config_lib.settings(config).sft
    graphdef, trainable, frozen = nnx.split(
        model, optimizer_lib.trainable_filter(s.optim.trainable), ...)
    tx, schedule = optimizer_lib.make_optimizer(s.optim, s.train.num_steps)
    loss_fn, accum = sft.make_loss_fn(config), s.train.grad_accum_steps
    flops = flops_lib.train_flops_per_step(model_cfg, *batch["tokens"].shape,
                                           sft.mtp_depths(config))
  else:
    m = config_lib.settings(config).mtp
    graphdef, trainable, frozen = mtp.split(model, config)
    tx, schedule = optimizer_lib.make_optimizer(m.optim, m.train.num_steps)
    loss_fn, accum = mtp.make_loss_fn(config), m.train.grad_accum_steps
    flops = flops_lib.train_flops_per_step(model_cfg, *batch["tokens"].shape,
                                           model_cfg.num_draft_steps, trainable_main=False)
  state = trainer.place_state(trainer.TrainState(trainable, frozen, tx.init(trainable), 0),
                              mesh, rules, tx)
  step_fn = trainer.make_train_step(graphdef, loss_fn, tx, schedule, accum)
  compiled = trainer.compile_train_step(step_fn, state, batch, mesh, rules, tx)
  return compiled, state, flops


def bench_stage(config, stage: str, paths: dict[str, ModelConfig], batch, steps: int,
                mesh, rules) -> dict[str, object]:
  """Times `stage`'s train step on every path, alternating; returns the results."""
  built = {name: _step_and_state(config, stage, cfg, batch, mesh, rules)
           for name, cfg in paths.items()}
  batch_sh = trainer.batch_shardings(batch, mesh, rules)
  placed = {k: jax.device_put(v, batch_sh[k]) for k, v in batch.items()}
  states = {name: b[1] for name, b in built.items()}
  times = {name: [] for name in built}
  first_loss = {}

  def run(name):
    compiled, _, _ = built[name]
    s = states[name]
    start = time.perf_counter()
    trainable, opt_state, step, metrics = compiled.fn(s.trainable, s.frozen, s.opt_state,
                                                      s.step, placed)
    jax.block_until_ready(trainable)
    states[name] = trainer.TrainState(trainable, s.frozen, opt_state, step)
    return time.perf_counter() - start, metrics

  with sharding.use_mesh(mesh, rules):
    for name in built:  # warm-up; the first step's loss is the same model on the same batch
      first_loss[name] = float(run(name)[1]["loss"])
    for _ in range(steps):
      for name in built:
        times[name].append(run(name)[0])
  out = {}
  for name, (compiled, _, flops) in built.items():
    median = float(np.median(times[name]))
    out[name] = {"step_s_median": median, "step_s_min": float(np.min(times[name])),
                 "compile_s": compiled.compile_seconds,
                 "temp_bytes": compiled.memory.get("temp_size_in_bytes"),
                 "first_loss": first_loss[name], "model_flops_per_step": flops,
                 **flops_lib.utilization(flops, median)}
  return _ratios(out)


def rl_rollouts(config) -> rollout.Rollouts:
  """One RL step's rollouts: config.rl's first prompt batch, completed by the tasks'
  demonstrations (scripted, no decoding), every odd row's with its last character cut."""
  settings = config_lib.settings(config)
  c = settings.rl
  batch = next(iter(pipeline.rl_prompt_dataset(
      settings.data, prompts_per_batch=c.prompts_per_batch, group_size=c.group_size,
      max_prompt_len=c.max_prompt_len, seed=config.seed)))
  exs = [tasks_lib.Example.from_json(x) for x in batch["example_json"]]
  names = sorted({ex.task for ex in exs})
  completion = lambda ex, row, seed: ex.demonstration[:len(ex.demonstration) - row % 2]
  engine = rollout.MockEngine({n: tasks_lib.get_task(n) for n in names}, completion,
                              rollout.RolloutSettings(max_new_tokens=c.rollout.max_new_tokens),
                              tokenizer=settings.data.loaded_tokenizer)
  return engine.generate(exs, jax.random.key(config.seed))


def bench_rl(config, paths: dict[str, ModelConfig], steps: int, mesh, rules
             ) -> dict[str, object]:
  """Times the RL learner's update call on each path (old: one row per rollout), alternating."""
  rollouts = rl_rollouts(config)
  seq_len = config.rl.max_prompt_len + config.rl.rollout.max_new_tokens
  learners = {}
  for name, cfg in paths.items():
    rl = dataclasses.replace(config_lib.settings(config).rl, packing=name == "new")
    graphdef, params = policy_lib.init(cfg, seed=config.seed)
    learners[name] = learner_lib.Learner(rl, graphdef, params, mesh=mesh, rules=rules,
                                         seq_len=seq_len)
  lengths = rollouts.prompt_lengths + rollouts.lengths
  flops = config.rl.epochs * sum(
      flops_lib.train_flops_per_step(paths["new"], 1, int(n), 0) for n in lengths)
  times = {name: [] for name in learners}
  first, shape = {}, {}
  with sharding.use_mesh(mesh, rules):
    for step in range(steps + 1):
      for name, learn in learners.items():
        m = learn.update(rollouts, step)
        if step == 0:  # compiles this batch's shape
          first[name], shape[name] = m, (m["learner_rows"], m["learner_length"])
        else:
          times[name].append(m["learner_s"])
  out = {}
  for name, learn in learners.items():
    compiled = learn._step("policy", shape[name][1], shape[name][0])[0]  # pylint: disable=protected-access
    median = float(np.median(times[name]))
    out[name] = {"step_s_median": median, "step_s_min": float(np.min(times[name])),
                 "compile_s": learn.compile_seconds,
                 "temp_bytes": compiled.memory.get("temp_size_in_bytes"),
                 "first_loss": first[name]["loss"], "update_shape": list(shape[name]),
                 "fill": first[name]["learner_fill"], "model_flops_per_step": flops,
                 **flops_lib.utilization(flops, median)}
  return _ratios(out)


def _ratios(out: dict[str, dict]) -> dict[str, dict]:
  old, new = out["old"], out["new"]
  out["speedup"] = old["step_s_median"] / new["step_s_median"]
  out["speedup_of_min"] = old["step_s_min"] / new["step_s_min"]
  out["temp_memory_ratio"] = (new["temp_bytes"] / old["temp_bytes"]
                              if old["temp_bytes"] else None)
  out["first_loss_abs_diff"] = abs(old["first_loss"] - new["first_loss"])
  return out


def format_table(results: dict[str, dict]) -> str:
  lines = ["| stage | path | step (s), median | min | model GFLOP/s | of matmul | temp MB |",
           "|---|---|---|---|---|---|---|"]
  for stage, r in results.items():
    for name in ("old", "new"):
      p = r[name]
      lines.append(f"| {stage} | {name} | {p['step_s_median']:.3f} | {p['step_s_min']:.3f} | "
                   f"{p['model_flops_per_s'] / 1e9:.1f} | {p['flops_utilization']:.1%} | "
                   f"{p['temp_bytes'] / 1e6:.0f} |")
    lines.append(f"| {stage} | old / new | {r['speedup']:.2f}x | {r['speedup_of_min']:.2f}x | | | "
                 f"{r['temp_memory_ratio']:.3f} of old |")
  return "\n".join(lines)


def main(argv):
  del argv
  config = config_lib.validate(_CONFIG.value)
  for stage in _STAGES.value:
    if stage not in STAGES:
      raise ValueError(f"--stages entry {stage!r} is not allowed: one of {STAGES}")
  new_cfg = ModelConfig.from_dict(config.model.to_dict())
  old_cfg = ModelConfig.from_dict({**config.model.to_dict(),
                                   **parse_overrides(_BASELINE.value)})
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  rules = tuple(tuple(r) for r in config.mesh.rules)
  calibration = flops_lib.matmul_calibration()
  d = config_lib.settings(config).data
  batch = next(iter(pipeline.sft_dataset(d, batch_size=d.batch_size, seq_len=d.seq_len,
                                         packing=d.packing, seed=config.seed)))
  results = {}
  paths = {"old": old_cfg, "new": new_cfg}
  for stage in _STAGES.value:
    if stage == "rl":
      results[stage] = bench_rl(config, paths, _STEPS.value, mesh, rules)
      continue
    b = batch if stage == "sft" else {k: v[:config.mtp.batch_size] for k, v in batch.items()}
    results[stage] = bench_stage(config, stage, paths, b, _STEPS.value, mesh, rules)
  report = {"config": {"model_new": new_cfg.__dict__, "model_old": old_cfg.__dict__,
                       "batch_shape": list(batch["tokens"].shape), "steps": _STEPS.value},
            "matmul_flops_per_s": calibration, "devices": str(jax.devices()),
            "results": results}
  print(f"matmul calibration: {calibration / 1e9:.1f} GFLOP/s")
  print(format_table(results))
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
