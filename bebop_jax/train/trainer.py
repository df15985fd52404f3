"""Shared training-loop pieces: the jitted train step and the loop around it.

The step is a pure function of (trainable, frozen, opt_state, step, batch), jitted with
explicit in/out shardings, the trainable state and optimizer state donated, compiled ahead of
time before step 0 with its compile time and memory analysis logged. Gradient accumulation
scans over microbatches inside the step, so one call is one optimizer update; the
microbatches' metrics are combined by metrics.combine (maxima stay maxima, per-token means
are weighted by each microbatch's token count when the loss reports one).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bebop_jax import multihost
from bebop_jax import sharding
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import flops as flops_lib
from bebop_jax.train import metrics as metrics_lib

LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], tuple[jax.Array, dict]]


@dataclasses.dataclass
class TrainState:
  """Everything a step reads and writes. `frozen` holds parameters the stage does not train."""
  trainable: nnx.State
  frozen: nnx.State
  opt_state: Any
  step: jax.Array

  def checkpoint_tree(self) -> dict[str, Any]:
    """What a checkpoint stores (frozen parameters come from their own stage)."""
    return {"trainable": self.trainable, "opt_state": self.opt_state, "step": self.step}


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def make_train_step(graphdef: nnx.GraphDef, loss_fn: LossFn, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int = 1) -> Callable:
  """The pure train step: (trainable, frozen, opt_state, step, batch) -> same + metrics."""

  def loss_of(trainable, frozen, batch):
    return loss_fn(nnx.merge(graphdef, trainable, frozen), batch)

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def train_step(trainable, frozen, opt_state, step, batch):
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(trainable, frozen, batch)
    else:
      micro = jax.tree.map(
          lambda x: x.reshape((grad_accum_steps, x.shape[0] // grad_accum_steps) + x.shape[1:]),
          batch)
      first = jax.tree.map(lambda x: x[0], micro)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(grad_fn, trainable, frozen, first)[1])

      def body(grads, mb):
        (_, m), g = grad_fn(trainable, frozen, mb)
        return _tree_add(grads, g), m

      grads, per_micro = jax.lax.scan(body, zeros, micro)
      grads = jax.tree.map(lambda g: g / grad_accum_steps, grads)
      metrics = metrics_lib.combine(per_micro)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(step))
    return trainable, opt_state, step + 1, metrics

  return train_step


def opt_state_shardings(tx: optax.GradientTransformation, opt_state: Any,
                        param_shardings: Any, mesh: Mesh) -> Any:
  """Optimizer-state shardings: moments follow their parameter, scalars are replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return optax.tree_map_params(
      tx, lambda _, s: s, opt_state,
      param_shardings, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_shardings(batch: Mapping[str, Any], mesh: Mesh, rules) -> dict[str, NamedSharding]:
  """Batch-major arrays sharded over the data axes."""
  return {k: sharding.data_sharding(mesh, rules, np.ndim(v)) for k, v in batch.items()}


@dataclasses.dataclass
class CompiledStep:
  fn: Callable
  compile_seconds: float
  memory: dict[str, int]


def compile_train_step(train_step: Callable, state: TrainState, batch: Mapping[str, Any],
                       mesh: Mesh, rules, tx: optax.GradientTransformation) -> CompiledStep:
  """jit with shardings and donation, lowered and compiled ahead of time for `batch`'s shapes.

  Logs the compile time and the executable's memory analysis.
  """
  train_sh = sharding.state_shardings(state.trainable, mesh, rules)
  frozen_sh = sharding.state_shardings(state.frozen, mesh, rules)
  opt_sh = opt_state_shardings(tx, state.opt_state, train_sh, mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sh = batch_shardings(batch, mesh, rules)
  jitted = jax.jit(train_step,
                   in_shardings=(train_sh, frozen_sh, opt_sh, replicated, batch_sh),
                   out_shardings=(train_sh, opt_sh, replicated, replicated),
                   donate_argnums=(0, 2))
  abstract = lambda tree, sh: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, sh)
  start = time.perf_counter()
  with sharding.use_mesh(mesh, rules):
    lowered = jitted.lower(abstract(state.trainable, train_sh),
                           abstract(state.frozen, frozen_sh),
                           abstract(state.opt_state, opt_sh),
                           jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                           {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype,
                                                    sharding=batch_sh[k])
                            for k, v in batch.items()})
    compiled = lowered.compile()
  seconds = time.perf_counter() - start
  memory = memory_stats(compiled)
  logging.info("train step compiled in %.1fs; memory analysis: %s", seconds, memory)
  return CompiledStep(fn=compiled, compile_seconds=seconds, memory=memory)


def memory_stats(compiled) -> dict[str, int]:
  """The compiled executable's memory analysis as a dict of byte counts (empty if n/a)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes", "generated_code_size_in_bytes")
  return {k: int(getattr(analysis, k)) for k in keys if hasattr(analysis, k)}


def place_state(state: TrainState, mesh: Mesh, rules, tx) -> TrainState:
  """Puts every array of `state` on the mesh with its sharding."""
  train_sh = sharding.state_shardings(state.trainable, mesh, rules)
  frozen_sh = sharding.state_shardings(state.frozen, mesh, rules)
  put = lambda tree, sh: jax.tree.map(multihost.put, tree, sh)
  return TrainState(
      trainable=put(state.trainable, train_sh), frozen=put(state.frozen, frozen_sh),
      opt_state=put(state.opt_state, opt_state_shardings(tx, state.opt_state, train_sh, mesh)),
      step=multihost.put(jnp.asarray(state.step, jnp.int32),
                         NamedSharding(mesh, PartitionSpec())))


def resume(checkpointer, state: TrainState, data_iterator=None
           ) -> tuple[TrainState, int | None]:
  """(state restored from the checkpointer's latest step, that step), or (state, None) when
  there is no checkpoint yet. The frozen part is not checkpointed and is kept; the data
  iterator, if given, is restored in place."""
  latest = checkpointer.latest_step()
  if latest is None:
    return state, None
  restored = checkpointer.restore(latest, checkpoint_lib.abstract_like(
      state.checkpoint_tree()), data_iterator=data_iterator)
  return TrainState(restored["trainable"], state.frozen, restored["opt_state"],
                    restored["step"]), latest


@dataclasses.dataclass
class LoopConfig:
  num_steps: int
  log_every: int
  eval_every: int
  checkpoint_every: int
  progress: bool = True
  stop_at_step: int = 0  # > 0: checkpoint and return at this step (simulated preemption)


def train_loop(*, stage: str, workdir: str, state: TrainState, compiled: CompiledStep,
               batches: Iterator[Mapping[str, np.ndarray]], loop: LoopConfig,
               checkpointer=None, data_iterator=None, batch_sh=None,
               eval_fn: Callable[[TrainState], dict[str, float]] | None = None,
               flops_per_step: float | None = None) -> tuple[TrainState, dict[str, Any]]:
  """Runs steps until loop.num_steps: logs, evaluates, checkpoints. Returns the final state
  and a summary (steady-state step time, compile time, last metrics, last eval).

  With `flops_per_step` (flops.train_flops_per_step), every log line and the summary carry
  model FLOP/s and their ratio to the process's matmul calibration (measured before the
  first step, once per process)."""
  start_step = int(state.step)
  writer = metrics_lib.MetricsWriter(workdir, stage, resume_step=start_step)
  progress = metrics_lib.Progress(loop.num_steps, start_step, stage, disable=not loop.progress)
  calibration = ({"matmul_flops_per_s": flops_lib.matmul_calibration()} if flops_per_step
                 else {})
  writer.write(start_step, {"event": "start", "compile_s": compiled.compile_seconds,
                            **{f"memory_{k}": v for k, v in compiled.memory.items()},
                            **calibration})
  step = start_step
  last_metrics: dict[str, Any] = {}
  last_eval: dict[str, Any] = {}
  window_start, window_steps, steady_times = time.perf_counter(), 0, []
  end = min(loop.num_steps, loop.stop_at_step) if loop.stop_at_step else loop.num_steps
  try:
    while step < end:
      batch = next(batches)
      if batch_sh is not None:  # this process's rows of the global batch
        batch = multihost.put_batch(batch, batch_sh)
      trainable, opt_state, step_arr, metrics = compiled.fn(
          state.trainable, state.frozen, state.opt_state, state.step, batch)
      state = TrainState(trainable, state.frozen, opt_state, step_arr)
      step += 1
      window_steps += 1
      is_last = step == loop.num_steps
      if step % loop.log_every == 0 or is_last:
        last_metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = (now - window_start) / window_steps
        if step - window_steps > start_step:  # the first window includes warm-up
          steady_times.append(step_time)
        window_start, window_steps = now, 0
        last_metrics["step_time_s"] = step_time
        if flops_per_step:
          last_metrics.update(flops_lib.utilization(flops_per_step, step_time))
        writer.write(step, last_metrics)
      progress.update(1, **({"loss": last_metrics["loss"]} if "loss" in last_metrics else {}))
      if eval_fn is not None and (is_last or (loop.eval_every and step % loop.eval_every == 0)):
        last_eval = eval_fn(state)
        writer.write(step, {f"eval/{k}": v for k, v in last_eval.items()})
        window_start = time.perf_counter()  # evaluation time is not step time
      if checkpointer is not None and (is_last or step == end or
                                       step % loop.checkpoint_every == 0):
        checkpointer.save(step, state.checkpoint_tree(), data_iterator=data_iterator,
                          metrics=last_eval or None)
        window_start = time.perf_counter()
  finally:
    progress.close()
    writer.close()
  summary = {"steps": step, "complete": step >= loop.num_steps,
             "compile_s": compiled.compile_seconds,
             "steady_step_time_s": float(np.median(steady_times)) if steady_times else None,
             "temp_bytes": compiled.memory.get("temp_size_in_bytes"),
             "metrics": last_metrics, "eval": last_eval}
  if flops_per_step and summary["steady_step_time_s"]:
    summary.update(flops_lib.utilization(flops_per_step, summary["steady_step_time_s"]))
  return state, summary
