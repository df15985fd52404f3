"""Where the RL learner and the rollout programs run: one mesh, or two disjoint sub-meshes.

`config.rl.placement` (typed: rl/settings.py's PlacementSettings):
  mode             "colocated" (default): the learner on `config.mesh` over every device, the
                   rollouts on the first device (one process, one set of devices; with
                   several processes, each samples its share on its own first device);
                   "split": the first `learner_devices` of `jax.devices()` form the learner
                   sub-mesh, the next `rollout_devices` the rollout sub-mesh.
  learner_devices  a count (>= 1) or a fraction in (0, 1) of the devices;
  rollout_devices  the same; 0 = all the devices the learner does not take.
  learner_mesh, rollout_mesh
                   each a mesh section like `config.mesh` (shape with at most one -1, axes,
                   logical-axis rules) laid over its own devices.

Each program is jitted for its own side: the learner's updates with the learner shardings
(train/trainer.py), the rollout programs under `rollout_context()`, which makes the rollout
mesh and rules current for the model's activation constraints, with parameters placed by
`to_rollout` (a copy, never an alias of the learner's donated buffers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bebop_jax import multihost
from bebop_jax import sharding

if TYPE_CHECKING:  # rl/settings.py imports this module (MODES, split_devices)
  from bebop_jax.rl.settings import PlacementSettings

MODES = ("colocated", "split")


class PlacementError(ValueError):
  """The placement does not fit the devices."""


def device_count(value: float, num_devices: int, key: str) -> int:
  """The number of devices `value` asks for: a count (>= 1, integral) or a fraction in (0, 1)
  of `num_devices`, rounded down (at least 1)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
    raise PlacementError(f"{key}={value!r} is not allowed: a device count >= 1 or a fraction "
                         "in (0, 1)")
  if value < 1:
    return max(1, int(math.floor(value * num_devices)))
  if value != int(value):
    raise PlacementError(f"{key}={value!r} is not allowed: a count must be a whole number "
                         "(or use a fraction in (0, 1))")
  return int(value)


def split_devices(learner: float, rollout: float, devices: Sequence[Any]
                  ) -> tuple[list[Any], list[Any]]:
  """(learner devices, rollout devices): the first ones for the learner, the next for the
  rollouts (`rollout` 0 = the rest).

  Raises:
    PlacementError: naming both counts and the device count when they do not fit.
  """
  n = len(devices)
  n_learner = device_count(learner, n, "rl.placement.learner_devices")
  n_rollout = (n - n_learner if not rollout else
               device_count(rollout, n, "rl.placement.rollout_devices"))
  if n_rollout < 1 or n_learner + n_rollout > n:
    raise PlacementError(
        f"rl.placement asks for {n_learner} learner + {max(n_rollout, 0)} rollout devices "
        f"but {n} devices are available (jax.device_count()); the two sub-meshes must be "
        f"disjoint, each with at least one device")
  return list(devices[:n_learner]), list(devices[n_learner:n_learner + n_rollout])


@dataclasses.dataclass(frozen=True)
class Placement:
  """The learner's and the rollouts' meshes and rules (see the module docstring)."""
  mode: str
  learner_mesh: Mesh
  learner_rules: tuple
  rollout_mesh: Mesh
  rollout_rules: tuple

  @property
  def split(self) -> bool:
    return self.mode == "split"

  def rollout_shardings(self, params: Any) -> Any:
    """Shardings of `params` on the rollout side: by the rollout rules when split; on the
    first device when colocated."""
    if not self.split:
      one = NamedSharding(self.rollout_mesh, PartitionSpec())
      return jax.tree.map(lambda _: one, params)
    return sharding.state_shardings(params, self.rollout_mesh, self.rollout_rules)

  def to_rollout(self, params: Any) -> Any:
    """A copy of `params` on the rollout side (resharded; never aliasing the learner's
    buffers, which its next update donates). With several processes each process's copy is
    on its own first device (multihost.to_local)."""
    params = multihost.to_local(params)
    shardings = self.rollout_shardings(params)
    return jax.tree.map(lambda x, s: jax.device_put(x, s, may_alias=False), params, shardings)

  def rollout_context(self):
    """The context the rollout programs trace and run in: the rollout mesh and rules when
    split (their activation constraints), nothing when colocated (as unsharded decoding)."""
    if not self.split:
      return contextlib.nullcontext()
    return sharding.use_mesh(self.rollout_mesh, self.rollout_rules)

  def describe(self) -> str:
    shape = lambda m: "x".join(f"{a}{s}" for a, s in m.shape.items())
    if not self.split:
      where = ("device 0" if multihost.process_count() == 1 else
               "each process's first device")
      return f"colocated (learner mesh {shape(self.learner_mesh)}, rollouts on {where})"
    return (f"split: learner {self.learner_mesh.devices.size} devices ({shape(self.learner_mesh)}),"
            f" rollouts {self.rollout_mesh.devices.size} devices ({shape(self.rollout_mesh)})")


def _mesh(section: sharding.MeshSettings, devices: Sequence[Any], key: str) -> Mesh:
  try:
    return sharding.make_mesh(section.shape, section.axes, devices=devices)
  except sharding.MeshError as e:
    raise PlacementError(f"{key} does not fit its {len(devices)} devices: {e}") from e


def make_placement(p: PlacementSettings, mesh: sharding.MeshSettings,
                   devices: Sequence[Any] | None = None) -> Placement:
  """The placement `p` (rl.placement) over `devices` (default: `jax.devices()`); `mesh`
  (config.mesh) is the learner's when colocated.

  Raises:
    PlacementError: for an unknown mode, or counts or meshes that do not fit the devices.
  """
  given = devices is not None
  devices = list(jax.devices() if devices is None else devices)
  if p.mode not in MODES:
    raise PlacementError(f"rl.placement.mode={p.mode!r} is not allowed: one of {MODES}")
  if multihost.process_count() > 1 and p.mode != "colocated":
    raise PlacementError(f"rl.placement.mode={p.mode!r} needs one process: a run over "
                         f"{multihost.process_count()} processes samples colocated (each "
                         "process on its first device)")
  if p.mode == "colocated":
    try:
      learner = sharding.make_mesh(mesh.shape, mesh.axes, devices=devices)
    except sharding.MeshError as e:
      raise PlacementError(f"config.mesh does not fit the {len(devices)} devices: {e}") from e
    # Rollouts on one device of this process: the first (with one process, device 0).
    first = Mesh(devices[:1] if given else [multihost.local_device()], ("data",))
    return Placement("colocated", learner, tuple(tuple(r) for r in mesh.rules), first, ())
  learner_devices, rollout_devices = split_devices(p.learner_devices, p.rollout_devices, devices)
  return Placement(
      "split",
      _mesh(p.learner_mesh, learner_devices, "rl.placement.learner_mesh"),
      tuple(tuple(r) for r in p.learner_mesh.rules),
      _mesh(p.rollout_mesh, rollout_devices, "rl.placement.rollout_mesh"),
      tuple(tuple(r) for r in p.rollout_mesh.rules))
