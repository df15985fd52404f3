"""SFT stage: train the policy on task demonstrations, evaluate by sampling, checkpoint.

Loss on target tokens only (prompts and tool results masked, see data.pipeline), plus an
optional joint MTP cross-entropy with weight `sft.mtp_loss_weight` (DeepSeek-V3 style) so the
model leaves SFT with initialised MTP modules. Periodic evaluation: per-task pass@1 at each
`eval.temperatures`, the agentic environment in the loop.

Workdir layout: <workdir>/sft/checkpoints (orbax: parameters, optimizer, data iterator),
<workdir>/sft/summary.json (written when the stage completes), metrics in
<workdir>/metrics.jsonl and TensorBoard events under <workdir>/tb/sft. A rerun resumes from
the latest checkpoint, or does nothing when summary.json says the stage is complete.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ml_collections
from absl import logging
from flax import nnx

from bebop_jax import evaluation
from bebop_jax import multihost
from bebop_jax import rollout
from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.losses import lm
from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import flops as flops_lib
from bebop_jax.stages import config as config_lib
from bebop_jax.stages import lineage
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.train import trainer
from bebop_jax.stages import rollouts

STAGE = "sft"


def make_eval_fn(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef):
  """(TrainState -> {"<task>/t<T>": pass@1, "pass_at_1_mean": ...}) over held-out examples."""
  d, e = config_lib.settings(config).data, config.eval
  task_objs = {n: tasks_lib.get_task(n, **d.tasks[n].knobs) for n in d.task_names}
  examples = {n: pipeline.eval_examples(d, n, e.num_examples) for n in d.task_names}
  tok = d.loaded_tokenizer

  def eval_fn(state: trainer.TrainState) -> dict[str, float]:
    # With several processes, process 0 evaluates on its own device and tells the others.
    params = multihost.to_local(nnx.merge_state(state.trainable, state.frozen))

    def evaluate() -> dict[str, float]:
      engines = {t: rollout.JaxEngine(graphdef, params, task_objs, rollouts.eval_settings(
          config, engine="autoregressive", temperature=t), tokenizer=tok)
                 for t in e.temperatures}
      start = time.perf_counter()
      with multihost.local_context():
        results = evaluation.evaluate_tasks(engines, examples, seed=config.seed)
      results["pass_at_1_mean"] = sum(results.values()) / max(len(results), 1)
      results["eval_s"] = time.perf_counter() - start
      return results

    results = multihost.on_primary(evaluate, "sft_eval")
    logging.info("eval: %s", results)
    return results

  return eval_fn


def heldout_rollouts(config: ml_collections.ConfigDict, graphdef, params, *,
                     num_examples: int, seed: int) -> dict[str, rollout.Rollouts]:
  """{task: one autoregressive rollout per held-out prompt} at temperature 1 without
  top-k/top-p, over the first `num_examples` test prompts of every task with weight > 0."""
  d = config_lib.settings(config).data
  task_objs = {n: tasks_lib.get_task(n, **d.tasks[n].knobs) for n in d.task_names}
  examples = {n: pipeline.eval_examples(d, n, num_examples) for n in d.task_names}
  engine = rollout.JaxEngine(graphdef, params, task_objs, rollouts.eval_settings(
      config, engine="autoregressive", temperature=1.0, top_k=0, top_p=1.0),
      tokenizer=d.loaded_tokenizer)
  return evaluation.rollouts_by_task(engine, examples, seed=seed)


def policy_entropy(config: ml_collections.ConfigDict, graphdef, params) -> dict[str, dict]:
  """The policy's per-token entropy at temperature 1 on held-out rollouts, per task
  (evaluation.entropy_stats; autoregressive, eval.num_examples prompts per task)."""
  return evaluation.entropy_stats(heldout_rollouts(
      config, graphdef, params, num_examples=config.eval.num_examples, seed=config.seed + 3))


def mtp_depths(config: ml_collections.ConfigDict) -> int:
  """MTP depths in the SFT loss: all K with a joint MTP loss, else none."""
  return config.model.num_draft_steps if config.sft.mtp_loss_weight > 0 else 0


def make_loss_fn(config: ml_collections.ConfigDict):
  """The SFT loss_fn(model, batch) -> (loss, metrics) for trainer.make_train_step; with
  sft.head "fused" no [B, T, V] logits exist (losses/head.py)."""
  k_steps, weight = mtp_depths(config), config.sft.mtp_loss_weight
  dense = config.sft.head == "dense"

  def loss_fn(model, batch):
    out = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                num_draft_steps=k_steps, logits=dense)
    return lm.sft_loss(out, batch["tokens"], batch["loss_mask"], weight)

  return loss_fn


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes, or skips when complete) SFT; returns the stage summary."""
  done = lineage.read_summary(workdir, "sft")
  if done is not None:
    print(f"[sft] complete in {lineage.stage_dir(workdir, 'sft')} (step {done['steps']}): skipping")
    return done
  os.makedirs(lineage.stage_dir(workdir, "sft"), exist_ok=True)
  settings = config_lib.settings(config)
  s, d = settings.sft, settings.data
  model_cfg = ModelConfig.from_dict(config.model.to_dict())
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  rules = tuple(tuple(r) for r in config.mesh.rules)
  num_steps = s.train.num_steps

  model = lineage.initial_policy(config, model_cfg, mesh, rules)
  graphdef, trainable, frozen = nnx.split(
      model, optimizer_lib.trainable_filter(s.optim.trainable), ...)
  tx, schedule = optimizer_lib.make_optimizer(s.optim, num_steps)
  state = trainer.place_state(
      trainer.TrainState(trainable, frozen, tx.init(trainable), 0), mesh, rules, tx)

  # This process's shards of the stream: its rows of every global batch.
  shards, local = multihost.data_shards(d.shards)
  datasets = [pipeline.sft_dataset(d, batch_size=d.batch_size, seq_len=d.seq_len,
                                   packing=d.packing, seed=config.seed, shard=(s, shards))
              for s in local]
  data_iter = pipeline.process_iterator(datasets)
  checkpointer = checkpoint_lib.Checkpointer(
      checkpoint_lib.checkpoint_dir(workdir, STAGE), keep_last=s.train.keep_checkpoints,
      best_metric="pass_at_1_mean")
  state, latest = trainer.resume(checkpointer, state, data_iter)
  if latest is not None:
    print(f"[sft] resumed from step {latest}")

  k_steps = mtp_depths(config)
  step_fn = trainer.make_train_step(graphdef, make_loss_fn(config), tx, schedule,
                                    s.train.grad_accum_steps)
  example_batch = multihost.global_example(next(pipeline.process_iterator(datasets)))
  compiled = trainer.compile_train_step(step_fn, state, example_batch, mesh, rules, tx)
  print(f"[sft] train step compiled in {compiled.compile_seconds:.1f}s; memory: "
        f"{compiled.memory}")
  flops_per_step = flops_lib.train_flops_per_step(model_cfg, d.batch_size, d.seq_len, k_steps)

  with sharding.use_mesh(mesh, rules):
    state, summary = trainer.train_loop(
        stage=STAGE, workdir=workdir, state=state, compiled=compiled, batches=data_iter,
        loop=trainer.LoopConfig(num_steps=num_steps, log_every=s.train.log_every,
                                eval_every=s.train.eval_every,
                                checkpoint_every=s.train.checkpoint_every,
                                progress=s.train.progress,
                                stop_at_step=s.train.stop_at_step),
        checkpointer=checkpointer, data_iterator=data_iter,
        batch_sh=trainer.batch_shardings(example_batch, mesh, rules),
        eval_fn=make_eval_fn(config, graphdef), flops_per_step=flops_per_step)
  checkpointer.close()
  if not summary["complete"]:
    print(f"[sft] stopped at step {summary['steps']} of {num_steps}; rerun to resume")
    return summary
  if not summary["eval"]:  # resumed after the final checkpoint: evaluate it
    with sharding.use_mesh(mesh, rules):
      summary["eval"] = make_eval_fn(config, graphdef)(state)
  summary["num_params"] = policy_lib.num_params(nnx.state(model))
  params = multihost.to_local(nnx.merge_state(state.trainable, state.frozen))
  summary["entropy"] = multihost.on_primary(lambda: policy_entropy(config, graphdef, params),
                                            "sft_entropy")
  metrics_lib.write_json_atomic(os.path.join(lineage.stage_dir(workdir, "sft"), "summary.json"), summary)
  print(f"[sft] done: {json.dumps(summary['eval'], sort_keys=True)}")
  print("[sft] policy entropy at T=1 on held-out rollouts: " + ", ".join(
      f"{n} mean {v['mean']:.3f} nats, {v['above_threshold']:.1%} of positions above "
      f"{evaluation.ENTROPY_THRESHOLD}" for n, v in summary["entropy"].items()))
  return summary
