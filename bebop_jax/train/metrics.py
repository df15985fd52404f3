"""Run metrics: metrics.jsonl in the workdir, TensorBoard event files, a progress bar.

Each record is one JSON object per line: {"step": int, "stage": str, ...scalars}. On resume,
`MetricsWriter(..., resume_step=s)` drops records past step s of the same stage, so the file
never holds two histories. In a run over several processes only process 0 writes these
files (and `write_json_atomic`'s); the others' writers do nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Mapping

import numpy as np
import tqdm
from tensorboardX import SummaryWriter


def _primary() -> bool:
  """Whether this process writes the run's files (bebop_jax.multihost.is_primary); a
  process that has not imported JAX is a one-process run (this module does not start it)."""
  if "jax" not in sys.modules:
    return True
  from bebop_jax import multihost  # pylint: disable=g-import-not-at-top
  return multihost.is_primary()


def _scalar(value: Any) -> float | int | str:
  if isinstance(value, (str, int)):
    return value
  arr = np.asarray(value)
  return arr.item() if arr.size == 1 else arr.tolist()


class MetricsWriter:
  """Writes metrics of one stage to `<workdir>/metrics.jsonl` and `<workdir>/tb/<stage>`."""

  def __init__(self, workdir: str, stage: str, resume_step: int = 0):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.stage = stage
    self._tb = None
    if not _primary():  # process 0 of several writes the run's files
      return
    if os.path.exists(self.path):
      self._truncate_after(resume_step)
    self._tb = SummaryWriter(os.path.join(workdir, "tb", stage))

  def _truncate_after(self, step: int):
    with open(self.path) as f:
      lines = f.readlines()
    kept = []
    for line in lines:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut by a crash
      if record.get("stage") == self.stage and record.get("step", 0) > step:
        continue
      kept.append(json.dumps(record) + "\n")
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)

  def write(self, step: int, metrics: Mapping[str, Any]):
    if self._tb is None:
      return
    record = {"stage": self.stage, "step": int(step), "time": time.time()}
    record.update({k: _scalar(v) for k, v in metrics.items()})
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for key, value in record.items():
      if key not in ("stage", "step", "time") and isinstance(value, (int, float)):
        self._tb.add_scalar(f"{self.stage}/{key}", value, step)

  def close(self):
    if self._tb is not None:
      self._tb.close()


MAX_SUFFIX = "_max"   # a metric that is a maximum: combined with max
COUNT_KEY = "tokens"  # a count (combined with sum) and the weight of the per-token means


def combine(parts: Mapping[str, Any], axis: int = 0) -> dict[str, Any]:
  """The metrics of several micro-batches or updates, stacked along `axis`, as one set:
  keys ending in MAX_SUFFIX take the maximum; COUNT_KEY is summed; with COUNT_KEY present,
  every other key but "loss" is a per-token mean weighted by its part's count (an empty part
  weighs nothing); without it, and for "loss" (each part's loss already carries its share
  of the batch's weights), the plain mean. Works on numpy and jax arrays."""
  xp = _array_module(parts)
  counts = parts.get(COUNT_KEY)
  out = {}
  for key, value in parts.items():
    if key.endswith(MAX_SUFFIX):
      out[key] = xp.max(value, axis=axis)
    elif key == COUNT_KEY:
      out[key] = xp.sum(value, axis=axis)
    elif counts is not None and key != "loss":
      total = xp.sum(counts, axis=axis)
      out[key] = xp.sum(value * counts, axis=axis) / xp.maximum(total, 1.0)
    else:
      out[key] = xp.mean(value, axis=axis)
  return out


def combine_list(parts: list[Mapping[str, Any]]) -> dict[str, float]:
  """`combine` over a list of host metric dicts (the keys of the first), as floats."""
  stacked = {k: np.asarray([float(p[k]) for p in parts]) for k in parts[0]}
  return {k: float(v) for k, v in combine(stacked).items()}


def _array_module(tree: Mapping[str, Any]):
  if any(not isinstance(v, (np.ndarray, np.generic, float, int)) for v in tree.values()):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    return jnp
  return np


def read_metrics(workdir: str, stage: str | None = None) -> list[dict[str, Any]]:
  """All records of metrics.jsonl (of one stage when given)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r for r in records if stage is None or r.get("stage") == stage]


class Progress:
  """A tqdm bar over steps with the steady-state step rate and ETA; compile time apart."""

  def __init__(self, total: int, initial: int, desc: str, disable: bool = False,
               unit: str = "step"):
    self.bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit=unit,
                         dynamic_ncols=True, disable=disable, mininterval=1.0)

  def update(self, n: int = 1, **postfix: Any):
    if postfix:
      self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v)
                            for k, v in postfix.items()}, refresh=False)
    self.bar.update(n)

  def close(self):
    self.bar.close()


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON to path via a temporary file and a rename: a crash leaves the old file.
  Only process 0 of a run over several processes writes."""
  if not _primary():
    return
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def read_json(path: str) -> Any | None:
  """The JSON at path, or None if there is no file."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


_COMPILE_STATS = {"seconds": 0.0, "cache_hits": 0}


def _on_duration(event: str, seconds: float, **_) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILE_STATS["seconds"] += seconds


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _COMPILE_STATS["cache_hits"] += 1


def compile_stats(since: Mapping[str, float] | None = None) -> dict[str, float]:
  """Seconds JAX spent in XLA compilation (loads from the persistent compilation cache
  included) and the cache's hits, counted from this function's first call in the process;
  with `since` (an earlier result), the difference."""
  if not getattr(compile_stats, "listening", False):
    import jax  # pylint: disable=g-import-not-at-top
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    compile_stats.listening = True
  now = dict(_COMPILE_STATS)
  return {k: v - since[k] for k, v in now.items()} if since else now
