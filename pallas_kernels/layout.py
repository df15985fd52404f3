"""What the kernel packages (tv_loss, fused_head) share: which implementation a backend gets,
and the checks of a PartitionSpec laid over [..., V] logits on a mesh."""

from __future__ import annotations

import math
from typing import Any, Sequence

from jax.sharding import Mesh, PartitionSpec

IMPLEMENTATIONS = ("reference", "xla_blockwise", "pallas_tpu", "pallas_gpu")
FALLBACK = "xla_blockwise"  # runs on every backend
BACKEND_DEFAULT = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu",
                   "rocm": "pallas_gpu", "cpu": "xla_blockwise"}


def axes(entry: Any) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def check_spec(mesh: Mesh, spec: PartitionSpec, shape: Sequence[int], what: str) -> None:
  """Raises ValueError, naming what is wrong (`what`: the op), unless `spec` fits logits
  [..., V] of `shape` on `mesh`."""
  if len(spec) != len(shape):
    raise ValueError(f"{what} spec {spec} has {len(spec)} entries; the logits "
                     f"{tuple(shape)} have {len(shape)} dimensions")
  seen: list[str] = []
  for entry in spec:
    for axis in axes(entry):
      if axis not in mesh.shape:
        raise ValueError(f"{what} spec {spec} names mesh axis {axis!r}; the mesh has "
                         f"{tuple(mesh.axis_names)}")
      seen.append(axis)
  if len(set(seen)) != len(seen):
    raise ValueError(f"{what} spec {spec} uses a mesh axis twice")
  for i, (dim, entry) in enumerate(zip(shape[:-1], spec[:-1])):
    size = math.prod(mesh.shape[a] for a in axes(entry))
    if dim % size:
      raise ValueError(f"{what} spec {spec} splits dimension {i} of size {dim} "
                       f"{size} ways; it must divide it")


def vocab_shards(mesh: Mesh, spec: PartitionSpec) -> int:
  """How many ways the spec splits the vocabulary (its last entry)."""
  return math.prod(mesh.shape[a] for a in axes(spec[-1]))
