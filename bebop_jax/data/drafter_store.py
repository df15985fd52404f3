"""The drafter dataset's store: the policy's own rollouts, generated once, read by every MTP
objective and seed (an F3 sweep samples the policy once).

A store is a directory (the MTP stage keys it by the policy and the sampling settings):

  <split>.array_record    one record per rollout: tokens int32 (bos + prompt + completion),
                          loss_mask int32 (1 on the tokens the policy sampled), task (its
                          name), reward float32; read back with grain's ArrayRecordDataSource
  meta.json               per split: rollouts, policy tokens, seconds, mean reward by task;
                          the store's settings. Written after its split's records, so a split
                          is complete when meta.json lists it.
  features/<name>.npy     optional cached arrays derived from a split (the frozen trunk's
                          hidden states of its packed rows), written atomically

    store = DrafterStore(path)
    store.write_split("train", records, meta={...})      # records: dicts as above
    store.has_split("train"); store.read_split("train")  # -> list of dicts, in order
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Iterable, Sequence

import grain
import numpy as np
from array_record.python import array_record_module

_META = "meta.json"
_ARRAYS = ("tokens", "loss_mask")


def encode(record: dict[str, Any]) -> bytes:
  """A rollout record as bytes (a numpy .npz archive: no pickled objects)."""
  buf = io.BytesIO()
  np.savez(buf, tokens=np.asarray(record["tokens"], np.int32),
           loss_mask=np.asarray(record["loss_mask"], np.int32),
           task=np.asarray(str(record["task"])), reward=np.float32(record.get("reward", 0.0)))
  return buf.getvalue()


def decode(data: bytes) -> dict[str, Any]:
  with np.load(io.BytesIO(data), allow_pickle=False) as f:
    return {"tokens": f["tokens"], "loss_mask": f["loss_mask"], "task": str(f["task"]),
            "reward": float(f["reward"])}


class DrafterStore:
  """Rollout records by split in array_record files, plus cached feature arrays."""

  def __init__(self, path: str):
    self.path = path

  def _split_path(self, split: str) -> str:
    return os.path.join(self.path, f"{split}.array_record")

  def meta(self) -> dict[str, Any]:
    path = os.path.join(self.path, _META)
    if not os.path.exists(path):
      return {"splits": {}}
    with open(path) as f:
      return json.load(f)

  def has_split(self, split: str) -> bool:
    return split in self.meta()["splits"] and os.path.exists(self._split_path(split))

  def write_split(self, split: str, records: Iterable[dict[str, Any]],
                  meta: dict[str, Any] | None = None, settings: dict[str, Any] | None = None
                  ) -> int:
    """Writes `split`'s records (replacing any), then lists it in meta.json with `meta`.
    Both files are written under temporary names and renamed, so an interrupted write
    leaves the split absent, never half there. Returns the number of records."""
    os.makedirs(self.path, exist_ok=True)
    final = self._split_path(split)
    tmp = final + ".tmp"
    writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
    n = 0
    for record in records:
      if len(record["tokens"]) != len(record["loss_mask"]):
        raise ValueError(f"record {n} of split {split!r}: {len(record['tokens'])} tokens but "
                         f"{len(record['loss_mask'])} loss-mask entries")
      writer.write(encode(record))
      n += 1
    writer.close()
    os.replace(tmp, final)
    full = self.meta()
    full["splits"][split] = dict(meta or {}, rollouts=n)
    if settings is not None:
      full["settings"] = settings
    _write_json_atomic(os.path.join(self.path, _META), full)
    return n

  def source(self, split: str) -> grain.MapDataset:
    """`split`'s records as a grain MapDataset of decoded dicts (random access)."""
    if not self.has_split(split):
      raise FileNotFoundError(f"the drafter store {self.path} has no complete split "
                              f"{split!r} (has: {sorted(self.meta()['splits'])})")
    source = grain.sources.ArrayRecordDataSource([self._split_path(split)])
    return grain.MapDataset.source(source).map(decode)

  def read_split(self, split: str) -> list[dict[str, Any]]:
    """Every record of `split`, in the order written."""
    ds = self.source(split)
    return [ds[i] for i in range(len(ds))]

  # ---------------------------------------------------------------- cached features

  def _feature_path(self, name: str) -> str:
    return os.path.join(self.path, "features", f"{name}.npy")

  def has_features(self, name: str) -> bool:
    return os.path.exists(self._feature_path(name))

  def write_features(self, name: str, array: np.ndarray) -> None:
    path = self._feature_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)

  def features(self, name: str) -> np.ndarray:
    """A cached array, memory-mapped (read-only): rows are read when indexed."""
    return np.load(self._feature_path(name), mmap_mode="r")


def sequences(records: Sequence[dict[str, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
  """(tokens, loss_mask) of each record."""
  return [(r["tokens"], r["loss_mask"]) for r in records]


def _write_json_atomic(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
