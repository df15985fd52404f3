"""Ahead-of-time compilation of both RL programs on a split placement, from abstract state.

`compile_programs(settings)` (a config's typed settings, bebop_jax.settings.Settings) lowers
and compiles, without materialising a single parameter:
  learner  the policy update (train/trainer.py's train step with learner.py's policy loss),
           as `Learner` builds it for its longest length bucket (max_prompt_len +
           max_new_tokens) and one update's rows (prompts_per_batch x group_size /
           minibatches), with the proximal log-probs of the decoupled objective when
           rl.asynchronous is on with off_policy "decoupled", on the learner sub-mesh;
  rollout  the speculative rollout's first turn (`speculative.start`: prefill and the
           draft-verify loop) on rl.rollout.batch_size rows of the prompt bucket that holds
           max_prompt_len, with the parameters placed by `Placement.rollout_shardings` and
           traced under `Placement.rollout_context()`, on the rollout sub-mesh.
It checks that the two executables' input shardings use disjoint devices and reports, per
program, the compile time, the memory analysis (per device) and the device ids.

With a simulated host platform (XLA_FLAGS=--xla_force_host_platform_device_count=N, see
experiments/aot_compile_rl.py) this checks a pod's shardings and per-device memory on one
machine. The MTP-only update of rl.mtp.strategy "online" / "periodic" is not compiled here.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from bebop_jax import settings as settings_lib
from bebop_jax import sharding
from bebop_jax.decoding import batching, sampling, speculative
from bebop_jax.model import model as policy_lib
from bebop_jax.rl import learner as learner_lib
from bebop_jax.rl import placement as placement_lib
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.train import trainer


class AotError(ValueError):
  """The config cannot be compiled ahead of time as asked, or the programs overlap."""


def _tree_bytes(tree: Any) -> int:
  """Total bytes of the arrays (or ShapeDtypeStructs) of `tree`."""
  return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree)))


def _shard_bytes(tree: Any, shardings: Any) -> int:
  """Bytes of `tree` on one device under `shardings` (the largest shard of each array)."""
  return int(sum(np.prod(s.shard_shape(np.shape(x))) * np.dtype(x.dtype).itemsize
                 for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))))


def input_devices(compiled) -> set[int]:
  """Ids of every device any input of the compiled executable is placed on."""
  ids: set[int] = set()
  for s in jax.tree.leaves(compiled.input_shardings):
    ids.update(d.id for d in s.device_set)
  return ids


def _mesh_info(mesh) -> dict[str, Any]:
  return {"shape": {a: int(n) for a, n in mesh.shape.items()},
          "devices": sorted(int(d.id) for d in mesh.devices.flat)}


def abstract_policy(settings: settings_lib.Settings) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, abstract parameters) of `settings.model`: ShapeDtypeStructs, nothing
  materialised."""
  return policy_lib.abstract_state(settings.model)


def compile_learner(settings: settings_lib.Settings, graphdef: nnx.GraphDef, abstract: nnx.State,
                    placement: placement_lib.Placement, *, length: int
                    ) -> tuple[trainer.CompiledStep, dict[str, Any]]:
  """(the compiled policy update on the learner mesh, its description): the same pieces as
  `Learner` (trunk / MTP split, rl.optim's optimizer and schedule, the policy loss, the
  shared train step) on abstract parameters and optimizer state."""
  rl = settings.rl
  rows = rl.prompts_per_batch * rl.group_size // rl.minibatches
  model = nnx.merge(graphdef, abstract)
  graphdef, trunk, mtp = nnx.split(model, optimizer_lib.trainable_filter("main"), ...)
  tx, schedule = optimizer_lib.make_optimizer(
      rl.optim, rl.train.num_steps * rl.epochs * rl.minibatches)
  opt_state = jax.eval_shape(tx.init, trunk)
  asynchronous = rl.asynchronous
  loss_fn = learner_lib.make_policy_loss_fn(
      sampling.SamplingParams(rl.rollout.temperature, rl.rollout.top_k, rl.rollout.top_p),
      clip_low=rl.clip_low, clip_high=rl.clip_high, aggregation=rl.aggregation,
      kl_coef=rl.kl_coef, is_cap=float(asynchronous.is_cap), is_mode=asynchronous.is_mode,
      head=rl.head, entropy_coef=rl.entropy_coef)
  step_fn = trainer.make_train_step(graphdef, loss_fn, tx, schedule, rl.train.grad_accum_steps)
  batch = learner_lib.example_batch(
      rl, rows, length,
      proximal=asynchronous.enabled and asynchronous.off_policy == "decoupled")
  state = trainer.TrainState(trunk, mtp, opt_state, 0)
  mesh, rules = placement.learner_mesh, placement.learner_rules
  compiled = trainer.compile_train_step(step_fn, state, batch, mesh, rules, tx)
  train_sh = sharding.state_shardings(trunk, mesh, rules)
  opt_sh = trainer.opt_state_shardings(tx, opt_state, train_sh, mesh)
  tree = (trunk, mtp, opt_state)
  # The update donates (and updates in place) the trunk and its optimizer state; the frozen
  # MTP modules are an argument the policy loss never reads (jit drops it).
  info = {"program": "policy_update", "rows": rows, "length": length, "head": rl.head,
          "grad_accum_steps": rl.train.grad_accum_steps,
          "batch_keys": sorted(batch),
          "state_bytes": _tree_bytes(tree),
          "state_bytes_per_device": _shard_bytes(
              tree, (train_sh, sharding.state_shardings(mtp, mesh, rules), opt_sh)),
          "donated_bytes_per_device": _shard_bytes((trunk, opt_state), (train_sh, opt_sh)),
          "batch_bytes": _tree_bytes(batch)}
  return compiled, info


def compile_rollout(settings: settings_lib.Settings, graphdef: nnx.GraphDef, abstract: nnx.State,
                    placement: placement_lib.Placement, *, prompt_len: int,
                    completion_len: int) -> tuple[Any, dict[str, Any]]:
  """(the compiled first rollout turn on the rollout mesh, its description):
  `speculative.start` as the rollout engine calls it (decoder.Speculative in episodes.decode_episodes) on
  rl.rollout.batch_size rows of `prompt_len` prompt positions and a completion budget of
  `completion_len`, the parameters placed by the rollout shardings, traced under the rollout
  context (its activation constraints)."""
  r = settings.rl.rollout
  if r.engine != "speculative":
    raise AotError(f"config.rl.rollout.engine={r.engine!r} is not allowed here: only "
                   "'speculative' rollouts (speculative.start) are compiled ahead of time")
  params = sampling.SamplingParams(r.temperature, r.top_k, r.top_p)
  mode = "exact" if params.greedy else r.mode
  k = r.num_draft_steps or settings.model.num_draft_steps
  b = r.batch_size
  tok = settings.data.loaded_tokenizer
  stop_tokens = (int(tok.eos_id), int(tok.call_end_id))
  mesh, rules = placement.rollout_mesh, placement.rollout_rules
  param_sh = placement.rollout_shardings(abstract)
  params_in = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           abstract, param_sh)

  def rows_of(shape, dtype):
    spec = sharding.logical_to_spec(("batch",) + (None,) * (len(shape) - 1), rules, mesh, shape)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  key = jax.eval_shape(lambda: jax.random.key(0))
  inputs = (rows_of((b, prompt_len), jnp.int32), rows_of((b,), jnp.int32),
            jax.ShapeDtypeStruct(key.shape, key.dtype,
                                 sharding=NamedSharding(mesh, PartitionSpec())))
  cache_length = prompt_len + completion_len + k + 1
  start = time.perf_counter()
  with placement.rollout_context():
    lowered = speculative.start.lower(
        graphdef, params_in, *inputs, max_new_tokens=completion_len,
        cache_length=cache_length, num_draft_steps=k, stop_tokens=stop_tokens,
        row_stops=rows_of((b, len(stop_tokens)), jnp.bool_), params=params, mode=mode,
        max_turn_tokens=None)
    compiled = lowered.compile()
  seconds = time.perf_counter() - start
  info = {"program": "speculative.start", "rows": b, "prompt_len": prompt_len,
          "max_new_tokens": completion_len, "cache_length": cache_length,
          "num_draft_steps": k, "mode": mode, "compile_s": seconds,
          "memory": trainer.memory_stats(compiled),
          "state_bytes": _tree_bytes(abstract),
          "state_bytes_per_device": _shard_bytes(abstract, param_sh)}
  return compiled, info


def compile_programs(settings: settings_lib.Settings, devices: Sequence[Any] | None = None, *,
                     prompt_len: int | None = None, completion_len: int | None = None,
                     learner_only: bool = False) -> dict[str, Any]:
  """Compiles the learner's policy update and the rollout program of a split config's
  `settings` over `devices` (default `jax.devices()`) from abstract state; see the module
  docstring.

  prompt_len: the rollout's prompt bucket (default: the smallest of eval.prompt_buckets
    holding rl.max_prompt_len); completion_len: the completion budget (default
    rl.rollout.max_new_tokens). The learner's length is rl.max_prompt_len + completion_len.

  learner_only: compile the policy update only (no "rollout" entry, no disjointness check).

  Returns {"placement": description, "num_devices": n, "learner": {...}, "rollout": {...}},
  each program with compile_s, memory (per-device bytes: argument / output / temp / alias /
  generated code), mesh (shape, device ids), input_devices (ids) and its shapes.

  Raises:
    AotError: for a colocated placement, a non-speculative rollout engine, or (a bug) input
      shardings of the two programs that share a device.
    PlacementError: when the placement does not fit the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  rl = settings.rl
  mode = rl.placement.mode
  if mode != "split":
    raise AotError(f"config.rl.placement.mode={mode!r} is not allowed here: only 'split' "
                   "placements (learner and rollouts on disjoint sub-meshes) are compiled "
                   "ahead of time")
  placement = placement_lib.make_placement(rl.placement, settings.mesh, devices)
  if completion_len is None:
    completion_len = rl.rollout.max_new_tokens
  if prompt_len is None:
    prompt_len = batching.bucket(rl.max_prompt_len, tuple(settings.eval.prompt_buckets))
  if prompt_len < rl.max_prompt_len:
    raise AotError(f"prompt_len={prompt_len} is not allowed: must hold "
                   f"rl.max_prompt_len={rl.max_prompt_len}")
  graphdef, abstract = abstract_policy(settings)

  learner_c, learner_info = compile_learner(settings, graphdef, abstract, placement,
                                            length=rl.max_prompt_len + completion_len)
  learner_info.update(compile_s=learner_c.compile_seconds, memory=learner_c.memory,
                      mesh=_mesh_info(placement.learner_mesh),
                      input_devices=sorted(input_devices(learner_c.fn)))
  if learner_only:
    return {"placement": placement.describe(), "num_devices": len(devices),
            "learner": learner_info}
  rollout_c, rollout_info = compile_rollout(settings, graphdef, abstract, placement,
                                            prompt_len=prompt_len,
                                            completion_len=completion_len)
  rollout_info.update(mesh=_mesh_info(placement.rollout_mesh),
                      input_devices=sorted(input_devices(rollout_c)))

  shared = set(learner_info["input_devices"]) & set(rollout_info["input_devices"])
  if shared:
    raise AotError(f"the learner and rollout programs share devices {sorted(shared)}: a split "
                   "placement must compile them for disjoint sub-meshes")
  for name, info, mesh in (("learner", learner_info, placement.learner_mesh),
                           ("rollout", rollout_info, placement.rollout_mesh)):
    if set(info["input_devices"]) != set(info["mesh"]["devices"]):
      raise AotError(f"the {name} program's inputs are on devices {info['input_devices']}, "
                     f"not its mesh's {info['mesh']['devices']} ({dict(mesh.shape)})")
  return {"placement": placement.describe(), "num_devices": len(devices),
          "learner": learner_info, "rollout": rollout_info}
