"""Checkpoints of the training state and the data iterator, with orbax and grain.

One checkpoint per step under `<workdir>/checkpoints/<step>/`, written by an
`orbax.checkpoint.CheckpointManager` with two items:

    state/  the state pytree (StandardCheckpointHandler: one array per leaf, sharded writes)
    data/   the grain iterator state (grain.checkpoint.CheckpointHandler: JSON of
            `iterator.get_state()`, one file per process), only when an iterator was given
    metrics/  the metrics passed to `save`, only when `best_metric` is set

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>`
only after every item is written, so a process killed mid-save leaves at most a temporary
directory. Temporary directories are never reported as steps and are deleted when the next
`Checkpointer` on the directory starts (before its first save). tests/test_checkpoint.py kills
a saving process with SIGKILL to check this.

Storage convention: what is stored is the "pure" form of the state, i.e. every `nnx.State`
becomes a nested dict of arrays (`nnx.to_pure_dict`) and every lone `nnx.Variable` its value;
namedtuples (optax states) are stored by field name, and numpy arrays or Python scalars are
stored as jax arrays (`jnp.asarray`, so Python ints become int32). `restore` takes an abstract
tree of the same structure as what was saved (nnx.State, namedtuples and all) and returns that
structure with arrays in place of the `jax.ShapeDtypeStruct`s; nnx Variables keep their type
and metadata. Leaf paths in errors are the stored keys joined by "/", e.g.
"params/layers/wq" or "opt_state/0/mu/embed".

Resharding: every abstract leaf carries the sharding the array should have on the current
mesh; orbax reads each shard it needs directly, so a checkpoint written on a (2, 4) mesh
restores onto an (8,) mesh, a (4, 2) mesh or a single device. Leaves without a sharding are
replicated over the mesh of the other leaves (or put on the first device when none has one).

Parameters only: `Checkpointer.restore_params` reads the parameter entries of a saved state
and nothing else (orbax's partial restore); stages/lineage.restore_policy builds a stage's
whole policy from them.

Typical use:

    with Checkpointer(f"{workdir}/checkpoints", keep_last=3, best_metric="accuracy") as ckpt:
      step = ckpt.latest_step()
      if step is not None:
        state = ckpt.restore(step, abstract_like(state), data_iterator=it)
      ...
      ckpt.save(step, state, data_iterator=it, metrics={"accuracy": 0.5})
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from bebop_jax import multihost

STATE_ITEM = "state"
DATA_ITEM = "data"


class CheckpointMismatchError(ValueError):
  """A checkpoint's stored leaves do not match the expected (abstract) state."""


# ------------------------------------------------------------------------ pytree conversion

def _is_nnx(x: Any) -> bool:
  return isinstance(x, (nnx.State, nnx.Variable))


def to_pure(tree: Any) -> Any:
  """`tree` with every nnx.State replaced by a nested dict and every nnx.Variable by its value.

  Returns:
    A pytree of plain containers (dict, list, tuple, namedtuple) whose leaves are the leaves
    of `tree` (arrays, ShapeDtypeStructs, shardings, scalars).
  """
  def one(x):
    if isinstance(x, nnx.State):
      return nnx.to_pure_dict(x)
    if isinstance(x, nnx.Variable):
      return x.get_value()
    return x
  return jax.tree.map(one, tree, is_leaf=_is_nnx)


def from_pure(template: Any, pure: Any) -> Any:
  """Inverse of `to_pure`: `pure`'s leaves put back into `template`'s structure.

  Args:
    template: the tree `pure` was derived from (or one of the same structure), e.g. an
      abstract state holding nnx.State and nnx.Variable nodes. It is not modified.
    pure: the same tree in pure form (as `to_pure(template)` would give).

  Returns:
    A new tree shaped like `template` (new nnx.State / Variable objects, same metadata) with
    the leaves of `pure`.
  """
  def one(t, p):
    if isinstance(t, nnx.State):
      fresh = jax.tree.map(lambda x: x, t)  # new State and Variable objects
      nnx.replace_by_pure_dict(fresh, p)
      return fresh
    if isinstance(t, nnx.Variable):
      return t.replace(p)
    return p
  return jax.tree.map(one, template, pure, is_leaf=_is_nnx)


def _leaf_sharding(x: Any) -> jax.sharding.Sharding | None:
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _default_sharding(shardings: Iterable[Any]) -> jax.sharding.Sharding:
  """Replicated on the mesh of the first NamedSharding, else the first device."""
  for sharding in shardings:
    if isinstance(sharding, NamedSharding):
      return NamedSharding(sharding.mesh, PartitionSpec())
  return SingleDeviceSharding(multihost.local_device())


def _to_struct(x: Any, sharding: jax.sharding.Sharding | None) -> jax.ShapeDtypeStruct:
  if isinstance(x, jax.ShapeDtypeStruct):
    shape, dtype = x.shape, x.dtype
  elif isinstance(x, jax.Array):
    shape, dtype = x.shape, x.dtype
  else:  # numpy array or Python scalar: stored as jnp.asarray(x)
    value = jnp.asarray(x) if not isinstance(x, np.ndarray) else x
    shape, dtype = value.shape, jax.dtypes.canonicalize_dtype(value.dtype)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs with shardings for every leaf of `tree`, in `tree`'s structure.

  Args:
    tree: a pytree of jax arrays, numpy arrays, Python scalars or ShapeDtypeStructs, possibly
      holding nnx.State / nnx.Variable nodes (those are kept, holding the structs).
    shardings: None (each jax.Array keeps its own sharding; leaves without one are replicated
      on the mesh of the other leaves, or go to the first device), one Sharding for every
      leaf, or a tree of Shardings with the structure of `tree` (nnx.State or its pure-dict
      form both work, e.g. `sharding.state_shardings(state, mesh, rules)`).

  Returns:
    `tree` with every leaf replaced by `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`.
  """
  pure = to_pure(tree)
  if shardings is None:
    pure_sh = jax.tree.map(_leaf_sharding, pure)
  elif isinstance(shardings, jax.sharding.Sharding):
    pure_sh = jax.tree.map(lambda _: shardings, pure)
  else:
    pure_sh = jax.tree.map(lambda _, s: s, pure, to_pure(shardings))
  default = _default_sharding(jax.tree.leaves(pure_sh))
  structs = jax.tree.map(lambda x, s: _to_struct(x, s if s is not None else default),
                         pure, pure_sh, is_leaf=lambda x: x is None)
  return from_pure(tree, structs)


def _as_arrays(pure: Any) -> Any:
  """Numpy arrays and Python scalars of a pure tree as jax arrays (what is stored). In a run
  over several processes, those that live on one process only (host values, arrays on a
  local device) become arrays replicated over the processes, so one copy is written."""
  pure = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), pure)
  if multihost.process_count() == 1:
    return pure
  meshes = [x.sharding.mesh for x in jax.tree.leaves(pure)
            if isinstance(x.sharding, NamedSharding) and not x.is_fully_addressable]
  mesh = meshes[0] if meshes else jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
  return multihost.replicated_global(pure, mesh)


def _path_str(key: tuple[Any, ...]) -> str:
  return "/".join(str(k) for k in key)


def _describe(shape: Any, dtype: Any) -> str:
  return f"{tuple(shape)} {np.dtype(dtype).name if dtype is not None else '?'}"


def check_compatible(stored: Mapping[tuple, Any], expected: Mapping[tuple, Any],
                     what: str) -> None:
  """Compares flat {path: leaf with .shape/.dtype} of a checkpoint against the expectation.

  Raises:
    CheckpointMismatchError: naming the first mismatched leaf path (in the expected tree's
      order) with the checkpoint's and the expected shape and dtype, or the first missing
      or extra leaf, and how many leaves differ in total.
  """
  stored = {tuple(str(k) for k in key): v for key, v in stored.items()}
  expected = {tuple(str(k) for k in key): v for key, v in expected.items()}
  problems = []
  for key, exp in expected.items():
    if key not in stored:
      problems.append(f"leaf {_path_str(key)!r} (expected {_describe(exp.shape, exp.dtype)}) "
                      f"is missing from the checkpoint")
      continue
    got = stored[key]
    got_shape = tuple(getattr(got, "shape", ()) or ())
    got_dtype = getattr(got, "dtype", None)
    if got_shape != tuple(exp.shape) or (
        got_dtype is not None and np.dtype(got_dtype) != np.dtype(exp.dtype)):
      problems.append(f"parameter {_path_str(key)!r} has shape "
                      f"{_describe(got_shape, got_dtype)} in the checkpoint but "
                      f"{_describe(exp.shape, exp.dtype)} is expected")
  for key, got in stored.items():
    if key not in expected:
      problems.append(f"leaf {_path_str(key)!r} "
                      f"({_describe(getattr(got, 'shape', ()), getattr(got, 'dtype', None))}) "
                      f"is in the checkpoint but not in the expected state")
  if problems:
    more = f" ({len(problems)} mismatches in total)" if len(problems) > 1 else ""
    raise CheckpointMismatchError(f"{what} does not match the expected state: "
                                  f"{problems[0]}{more}")


def _json_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Metrics with numpy / jax scalars as Python floats (orbax stores them as JSON)."""
  out = {}
  for k, v in metrics.items():
    if isinstance(v, Mapping):
      out[str(k)] = _json_metrics(v)
    elif isinstance(v, (jax.Array, np.ndarray, np.generic)) and np.ndim(v) == 0:
      out[str(k)] = np.asarray(v).item()
    else:
      out[str(k)] = v
  return out


# ------------------------------------------------------------------------ the checkpointer

class Checkpointer:
  """Saves and restores (state pytree, grain iterator state) per step; see module docstring.

  Args:
    directory: where the step directories go (usually `<workdir>/checkpoints`); created.
    keep_last: the last N saved steps are kept (None: all).
    best_metric: name of a metric passed to `save`; when set, the best step by it is kept in
      addition to the last `keep_last` (steps saved without metrics only count as recent).
    best_mode: "max" (higher is better, default) or "min".
    save_interval_steps: `save` writes only steps that are multiples of this (unless
      `force=True`).
    asynchronous: when True, `save` returns once the arrays are copied to host memory and
      the files are written in the background (call `wait_until_finished()` or `close()`);
      steps appear in `all_steps()` at once. Default False: `save` returns when committed.
  """

  def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3,
               best_metric: str | None = None, best_mode: str = "max",
               save_interval_steps: int = 1, asynchronous: bool = False):
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
      raise ValueError(f"keep_last={keep_last!r} is not allowed: a positive int or None")
    if best_mode not in ("max", "min"):
      raise ValueError(f"best_mode={best_mode!r} is not allowed: 'max' or 'min'")
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      raise ValueError(f"save_interval_steps={save_interval_steps!r} is not allowed: "
                       f"a positive int")
    # orbax needs an absolute path (a relative one fails at the first save).
    self.directory = os.path.abspath(os.fspath(directory))
    self.keep_last = keep_last
    self.best_metric = best_metric
    self.best_mode = best_mode
    self.asynchronous = asynchronous

    policies: list[Any] = [ocp.checkpoint_managers.LatestN(n=keep_last)]
    best_fn = None
    if best_metric is not None:
      sign = 1.0 if best_mode == "max" else -1.0

      def best_fn(metrics: Mapping[str, Any]) -> float:
        # Orbax ranks ascending and keeps the last: a higher score is better. Metrics
        # without the key (older checkpoints) rank worst.
        value = metrics.get(best_metric) if isinstance(metrics, Mapping) else None
        return -math.inf if value is None else sign * float(value)

      policies.append(ocp.checkpoint_managers.BestN(
          get_metric_fn=best_fn, reverse=False, n=1, keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        # With a preservation_policy, best_fn only decides that metrics are written and
        # what best_step() means; best_fn is already "higher is better".
        best_fn=best_fn, best_mode="max",
        cleanup_tmp_directories=True,
        enable_async_checkpointing=asynchronous,
        create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(),
                       DATA_ITEM: grain.checkpoint.CheckpointHandler()})

  # -------------------------------------------------------------------- queries

  def all_steps(self) -> list[int]:
    """Committed (and, when asynchronous, in-flight) steps, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step, or None when there is none."""
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    """The step with the best `best_metric` among kept steps saved with metrics; None when
    `best_metric` is not set or no kept step has metrics."""
    if self.best_metric is None:
      return None
    return self._manager.best_step()

  def metrics(self, step: int) -> dict[str, Any] | None:
    """Metrics saved with `step` (only stored when `best_metric` is set), or None."""
    return self._manager.metrics(step)

  def reload(self) -> None:
    """Rereads the steps on disk (after another process wrote to the directory)."""
    self._manager.reload()

  # -------------------------------------------------------------------- save

  def save(self, step: int, state: Any, data_iterator: Any = None,
           metrics: Mapping[str, Any] | None = None, force: bool = False) -> bool:
    """Writes `state` (and the iterator's position) as checkpoint `step`, atomically.

    Args:
      step: the training step (non-negative int, not already saved).
      state: a pytree of arrays; nnx.State nodes are stored as dicts (module docstring).
      data_iterator: a grain DatasetIterator (or DataLoaderIterator) whose `get_state()` is
        stored; its position is read now, before `save` returns.
      metrics: scalar metrics of this step; must contain `best_metric` when that is set.
      force: save even when `step` is not a multiple of `save_interval_steps`.

    Returns:
      True when a checkpoint was written (or, asynchronously, started). False when orbax
      skipped the step: not a multiple of `save_interval_steps` (the first save of a
      Checkpointer is always written), or not newer than `latest_step()`; `force=True`
      overrides both.

    Raises:
      ValueError: if metrics lack `best_metric`, or (with force) the step already exists.
    """
    step = int(step)
    if metrics is not None:
      metrics = _json_metrics(metrics)
      if self.best_metric is not None and self.best_metric not in metrics:
        raise ValueError(f"metrics of step {step} lack best_metric={self.best_metric!r}; "
                         f"got keys {sorted(metrics)}")
    items = {STATE_ITEM: ocp.args.StandardSave(_as_arrays(to_pure(state)))}
    if data_iterator is not None:
      items[DATA_ITEM] = grain.checkpoint.CheckpointSave(data_iterator)
    saved = self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics,
                               force=force)
    if saved and not self.asynchronous:
      self._manager.wait_until_finished()
    return saved

  def wait_until_finished(self) -> None:
    """Blocks until any background save has committed (a no-op when synchronous)."""
    self._manager.wait_until_finished()

  # -------------------------------------------------------------------- restore

  def stored_leaves(self, step: int) -> dict[tuple[str, ...], Any]:
    """{path tuple: metadata with .shape and .dtype} of the state stored at `step`."""
    metadata = self._manager.item_metadata(step)
    state_md = metadata[STATE_ITEM] if STATE_ITEM in metadata.keys() else None
    if state_md is None:
      raise FileNotFoundError(f"checkpoint step {step} in {self.directory} has no "
                              f"{STATE_ITEM!r} item")
    return ocp.tree.to_flat_dict(state_md)

  def has_data_state(self, step: int) -> bool:
    """Whether step `step` was saved with a data iterator state."""
    return DATA_ITEM in self._manager.item_metadata(step).keys()

  def restore(self, step: int | None, abstract_state: Any, data_iterator: Any = None) -> Any:
    """Reads checkpoint `step` into the shardings of `abstract_state`.

    Args:
      step: the step to read; None for the latest.
      abstract_state: the expected state, with the structure of what was saved: a pytree of
        `jax.ShapeDtypeStruct` with `.sharding` set for the current mesh (see `abstract_like`;
        concrete arrays are accepted and only their shape, dtype and sharding are used).
      data_iterator: a grain iterator built like the saved one; its state is set in place.

    Returns:
      `abstract_state`'s structure holding jax arrays with the requested shardings.

    Raises:
      FileNotFoundError: if there is no such step (or no iterator state when one is given).
      CheckpointMismatchError: if stored leaf paths, shapes or dtypes differ from
        `abstract_state`, naming the first differing path and both shapes.
    """
    step = self._resolve_step(step)
    pure_abstract = to_pure(abstract_like(abstract_state))
    check_compatible(self.stored_leaves(step), ocp.tree.to_flat_dict(pure_abstract),
                     f"checkpoint step {step} in {self.directory}")
    items = {STATE_ITEM: ocp.args.StandardRestore(pure_abstract)}
    if data_iterator is not None:
      if not self.has_data_state(step):
        raise FileNotFoundError(f"checkpoint step {step} in {self.directory} has no data "
                                f"iterator state (it was saved without data_iterator)")
      items[DATA_ITEM] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    return from_pure(abstract_state, restored[STATE_ITEM])

  def restore_params(self, step: int | None, abstract_params: nnx.State,
                     keys: Sequence[str]) -> nnx.State:
    """The parameters stored under `keys` of the saved state, and nothing else.

    A stage saves its parameters next to its optimizer state and counters (e.g.
    {"trainable", "opt_state", "step"}); inference needs only the parameters, so this reads
    just those arrays (orbax's partial restore) and never needs the optimizer to rebuild the
    shape of its state.

    Args:
      step: the step to read; None for the latest.
      abstract_params: the policy's whole abstract state (`jax.ShapeDtypeStruct` leaves with
        their target shardings, see `abstract_like`).
      keys: the saved state's top-level entries that hold parameters, each a sub-tree of
        the policy's state in pure form (e.g. ("trainable",), or ("trunk", "mtp")).

    Returns:
      An nnx.State with only the parameters the checkpoint holds under `keys` (a subset of
      `abstract_params`' leaves), placed on their shardings.

    Raises:
      FileNotFoundError: no such step.
      CheckpointMismatchError: a stored parameter with another shape or dtype, or one the
        policy does not have.
    """
    step = self._resolve_step(step)
    stored = {tuple(str(k) for k in key): v for key, v in self.stored_leaves(step).items()}
    target, parts = {}, {}
    for key in keys:
      names = {path[1:] for path in stored if path[0] == key}
      part = abstract_params.filter(lambda path, _, names=names: tuple(map(str, path)) in names)
      pure = to_pure(abstract_like(part))
      got = {path[1:]: v for path, v in stored.items() if path[0] == key}
      check_compatible(got, ocp.tree.to_flat_dict(pure),
                       f"{key!r} of checkpoint step {step} in {self.directory}")
      if got:
        target[key], parts[key] = pure, part
    if not target:
      return nnx.State({})
    # The manager's StandardCheckpointHandler has no partial restore; the item on disk is
    # the PyTree handler's format, which does (the steps are plain integer directories).
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
      restored = reader.restore(
          os.path.join(self.directory, str(step), STATE_ITEM),
          args=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True))
    return nnx.merge_state(*(from_pure(parts[k], restored[k]) for k in target))

  def _resolve_step(self, step: int | None) -> int:
    """`step`, or the latest for None; FileNotFoundError when it is not there."""
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    step = int(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; "
                              f"available: {self.all_steps()}")
    return step

  # -------------------------------------------------------------------- lifetime

  def close(self) -> None:
    """Waits for background work (async saves, deletions) and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


# ------------------------------------------------------------------------ stage layout

def checkpoint_dir(workdir: str, stage: str) -> str:
  """Where `stage` keeps its checkpoints in `workdir`."""
  return os.path.join(workdir, stage, "checkpoints")
