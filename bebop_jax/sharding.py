"""Mesh construction, logical-axis rules, and the one helper that constrains activations.

Parameters carry logical axis names (metadata `logical_axes` on every `nnx.Param`, e.g.
("embed", "mlp")); activations name theirs at the call site (`constrain(x, ("batch",
"length", "embed"))`). One rules table maps logical names to mesh axes, e.g.

    (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
     ("kv_heads", "tensor"), ("vocab", "tensor"))

A logical name missing from the table is replicated. A mesh axis that does not divide the
dimension is dropped for that dimension (a 2-head KV projection on a 4-way tensor axis is
replicated rather than failing), so the tiny test models run on any mesh.

`use_mesh(mesh, rules)` makes a mesh current for `constrain`; without one `constrain` is the
identity, so the same model code runs unsharded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bebop_jax.settings_base import ConfigError, Section, fail, setting

Rules = Sequence[tuple[str, Any]]

# Mesh axis names the project knows: data parallel, fully-sharded data parallel, tensor.
MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
)


class MeshError(ValueError):
  """The requested mesh does not fit the devices."""


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """`shape` with a -1 entry replaced so the product is `num_devices`.

  Raises:
    MeshError: if no such shape exists, naming the shape and the device count.
  """
  shape = tuple(int(s) for s in shape)
  if shape.count(-1) > 1:
    raise MeshError(f"mesh shape {shape} has more than one -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if known < 1 or num_devices % known:
      raise MeshError(f"mesh shape {shape} cannot be completed for {num_devices} devices: "
                      f"{num_devices} is not a multiple of {known}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise MeshError(f"mesh shape {shape} needs {math.prod(shape)} devices but "
                    f"{num_devices} are available; use a shape whose product is "
                    f"{num_devices} (or -1 for one dimension)")
  return shape


def make_mesh(shape: Sequence[int], axes: Sequence[str],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh of `shape` (one entry may be -1) over `devices` (default: `jax.devices()`).

  Raises:
    MeshError: if the number of axes and dimensions differ or the mesh size is not the device
      count, naming both.
  """
  devices = list(jax.devices() if devices is None else devices)
  axes = tuple(axes)
  if len(tuple(shape)) != len(axes):
    raise MeshError(f"mesh.shape={tuple(shape)} has {len(tuple(shape))} dimensions but "
                    f"mesh.axes={axes} names {len(axes)}")
  if len(set(axes)) != len(axes):
    raise MeshError(f"mesh.axes={axes} repeats an axis name")
  shape = resolve_mesh_shape(shape, len(devices))
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), axes)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules,
                    mesh: Mesh | jax.sharding.AbstractMesh,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
  """PartitionSpec of an array with `logical_axes` under `rules` on `mesh`.

  A mesh axis is used at most once per array (first dimension wins) and only where it divides
  the dimension (when `shape` is given).
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(logical_axes):
    target = table.get(name) if name is not None else None
    if target is None:
      spec.append(None)
      continue
    candidates = (target,) if isinstance(target, str) else tuple(target)
    chosen = []
    size = 1
    for axis in candidates:
      if axis not in mesh.shape or axis in used:
        continue
      if shape is not None and shape[i] % (size * mesh.shape[axis]):
        continue
      chosen.append(axis)
      size *= mesh.shape[axis]
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return PartitionSpec(*spec)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for an nnx state (or abstract state): from each Param's `logical_axes`.

  Raises:
    ValueError: if a parameter has no `logical_axes` (every parameter must be annotated).
  """
  def one(path, var):
    axes = var.get_metadata("logical_axes", None) if _is_variable(var) else None
    value = var.value if _is_variable(var) else var
    if axes is None:
      if np.ndim(value) == 0 or not hasattr(value, "shape") or not value.shape:
        axes = ()
      else:
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical_axes")
    spec = logical_to_spec(axes, rules, mesh, value.shape)
    sharding = NamedSharding(mesh, spec)
    return var.replace(sharding) if _is_variable(var) else sharding

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


class _Current(threading.local):
  """The stack of current (mesh, rules), per thread: the RL learner and the rollout thread
  trace their programs for different meshes at the same time."""

  def __init__(self):
    super().__init__()
    self.stack: list[tuple[Mesh | None, tuple]] = []


_LOCAL = _Current()


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
  """Makes `mesh` and `rules` current for `constrain` (None: unsharded)."""
  _LOCAL.stack.append((mesh, tuple(rules)))
  try:
    if mesh is None:
      yield
    else:
      with jax.set_mesh(mesh):
        yield
  finally:
    _LOCAL.stack.pop()


def current_mesh() -> Mesh | None:
  return _LOCAL.stack[-1][0] if _LOCAL.stack else None


def current_spec(logical_axes: Sequence[str | None],
                 shape: Sequence[int]) -> tuple[Mesh | None, PartitionSpec | None]:
  """(mesh, spec) of an array with `logical_axes` under the current mesh and rules, for code
  that lays out its own work (shard_map); (None, None) without a mesh."""
  mesh = current_mesh()
  if mesh is None:
    return None, None
  return mesh, logical_to_spec(logical_axes, _LOCAL.stack[-1][1], mesh, shape)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by its logical axes; identity with no mesh."""
  if not _LOCAL.stack or _LOCAL.stack[-1][0] is None:
    return x
  mesh, rules = _LOCAL.stack[-1]
  spec = logical_to_spec(logical_axes, rules, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def data_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
  """Sharding of a batch-major input array: batch over the data axes, the rest replicated."""
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def multihost(mode: str, env: dict[str, str]) -> bool:
  """Whether to initialise jax.distributed: always ("on"), never ("off"), or ("auto") when
  `env` names a coordinator or more than one TPU worker host."""
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed={mode!r} is not allowed: one of ('auto', 'on', 'off')")
  if mode != "auto":
    return mode == "on"
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  return bool(env.get("JAX_COORDINATOR_ADDRESS")) or len(hosts) > 1


def _rules_ok(rules: Any) -> bool:
  return isinstance(rules, (tuple, list))


@dataclasses.dataclass(frozen=True)
class MeshSettings(Section):
  """config.mesh: the device mesh, one dimension of which may be -1 (all remaining devices),
  and the rules that map logical axes of parameters and activations to mesh axes.

  rl.placement's learner_mesh and rollout_mesh are mesh sections too. The device count is
  checked by `sizes` (across sections: bebop_jax.settings)."""
  KEY = "mesh"
  shape: tuple[int, ...] = setting(
      (-1,), "mesh dimensions; one may be -1 (all remaining devices)",
      allowed="must hold positive ints and at most one -1",
      check=lambda s: (all(isinstance(x, int) and (x >= 1 or x == -1) for x in s)
                       and tuple(s).count(-1) <= 1))
  axes: tuple[str, ...] = setting(("data",), "the name of each dimension",
                                  allowed=f"axis names must come from {MESH_AXES}")
  rules: tuple[tuple[str, Any], ...] = setting(
      DEFAULT_RULES, "logical axes of parameters and activations to mesh axes (a mesh axis "
      "or a tuple of them); rules may name axes the mesh lacks, those are ignored",
      allowed="each rule must be (logical_axis, mesh_axis or tuple of them)", check=_rules_ok)

  def __post_init__(self):
    super().__post_init__()
    shape, axes = tuple(self.shape), tuple(self.axes)
    if len(shape) != len(axes) or len(set(axes)) != len(axes):
      self.fail("axes", f"must name each of the {len(shape)} dimensions of "
                f"{self.where('shape')}={shape} once")
    if any(a not in MESH_AXES for a in axes):
      self.fail("axes", f"axis names must come from {MESH_AXES}")
    for rule in self.rules:
      if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
        fail(self.where("rules"), rule, "each rule must be (logical_axis, mesh_axis or tuple "
             "of them)")
      targets = (rule[1],) if isinstance(rule[1], str) or rule[1] is None else tuple(rule[1])
      for target in targets:
        if target is not None and target not in MESH_AXES:
          fail(self.where("rules"), rule, f"mesh axis {target!r} is not one of {MESH_AXES} "
               "(rules may name axes the mesh lacks; those are ignored)")

  def sizes(self, num_devices: int | None = None) -> dict[str, int]:
    """{axis: size} over `num_devices` (default: all of them)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    try:
      resolved = resolve_mesh_shape(self.shape, num_devices)
    except MeshError as e:
      raise ConfigError(f"config.{self.where('shape')}={tuple(self.shape)} is not allowed: "
                        f"{e}") from e
    return dict(zip(self.axes, resolved))

  def data_parallel(self, sizes: dict[str, int]) -> tuple[int, tuple[str, ...]]:
    """(the data-parallel size of the mesh of `sizes`: the product of its batch axes, those
    axes)."""
    batch_axes = dict(self.rules).get("batch") or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    return math.prod(sizes.get(a, 1) for a in batch_axes), batch_axes
