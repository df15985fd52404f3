"""Asynchronous RL plumbing: a double-buffered weight store, the rollout worker thread with
its bounded queue, and exact version and staleness bookkeeping.

Versions. The learner's version v is the number of RL steps it has completed; the weights it
publishes after step s (trunk and MTP modules together) are version s + 1. Batch b of the
prompt stream (0-based) is consumed by learner step b, in order, exactly once.

Staleness. A row sampled by version u and consumed at step b has staleness b - u. With the
bound eta (`rl.asynchronous.max_staleness`) the worker samples batch b only with weights of version
>= b - eta (capacity control: it waits for the learner otherwise), so it never runs more than
eta versions ahead, and the learner checks every batch it consumes (`check_batch`): a batch
with a missing or repeated index, or one row older than eta, is an error, never trained on.
With eta = 0 every batch is sampled by the learner's current weights, in the same order as
the synchronous loop, so the run is the synchronous run exactly.

Weights. `WeightStore` holds at most two rollout-side copies: the newest, which new decoding
calls take, and the previous one while a call still decodes with it. The learner writes a new
version into the slot nobody reads (waiting for a reader of that slot to finish) and flips.

Faults. An exception in the worker thread is logged; the next `get` starts a new thread that
resumes at the batch that failed (its prompts were drawn once and are kept), so no batch is
lost or produced twice. `max_restarts` consecutive failures of one batch re-raise it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import numpy as np
from absl import logging


@dataclasses.dataclass
class RolloutBatch:
  """One batch of rollouts for learner step `index`.

  rollouts: the Rollouts (`versions` per row); metrics: rollout-side metrics (seconds,
  acceptance, ...); iterator_state: the prompt iterator's state after this batch was drawn
  (what a checkpoint after step `index` stores); idle_s: seconds the rollout side waited
  (for capacity or queue space) since its previous batch; attempts: 1 + failed tries.
  """
  index: int
  rollouts: Any
  metrics: dict[str, Any]
  iterator_state: bytes | None = None
  idle_s: float = 0.0
  attempts: int = 1


class SavedIteratorState:
  """A prompt iterator's state captured earlier, saved by the checkpointer in its place
  (grain's checkpoint handler calls `get_state()`); restore into the real iterator."""

  def __init__(self, state: bytes):
    self.state = state

  def get_state(self) -> bytes:
    return self.state


def capture_state(iterator: Any) -> bytes:
  """The state of a grain iterator, as the bytes its checkpoint would hold."""
  state = iterator.get_state()
  return state if isinstance(state, bytes) else json.dumps(state, indent=4).encode()


def check_batch(batch: RolloutBatch, step: int, max_staleness: int) -> np.ndarray:
  """The per-row staleness of `batch` consumed at learner step `step`.

  Raises:
    RuntimeError: if the batch is not the one for this step (a batch lost or repeated), or a
      row is older than `max_staleness` versions or newer than the learner.
  """
  if batch.index != step:
    raise RuntimeError(f"the learner at step {step} received rollout batch {batch.index}: "
                       f"a batch was {'repeated' if batch.index < step else 'lost'}")
  staleness = step - np.asarray(batch.rollouts.versions, np.int64)
  if staleness.min() < 0 or staleness.max() > max_staleness:
    raise RuntimeError(f"rollout batch {step} has rows of versions "
                       f"{sorted(set(np.asarray(batch.rollouts.versions).tolist()))}: staleness "
                       f"{int(staleness.min())}..{int(staleness.max())} is outside "
                       f"[0, max_staleness={max_staleness}]")
  return staleness


def staleness_metrics(staleness: np.ndarray, max_staleness: int) -> dict[str, float]:
  """staleness_max, staleness_mean and staleness_hist_<k> (fraction of rows, k = 0..eta)."""
  out = {"staleness_max": float(staleness.max()), "staleness_mean": float(staleness.mean())}
  counts = np.bincount(staleness, minlength=max_staleness + 1)
  out.update({f"staleness_hist_{k}": float(c / staleness.size) for k, c in enumerate(counts)})
  return out


class WeightStore:
  """Two slots of rollout-side parameters (see the module docstring). Thread-safe."""

  def __init__(self, params: Any, version: int):
    self._cond = threading.Condition()
    self._slots: list[tuple[Any, int] | None] = [(params, version), None]
    self._readers = [0, 0]
    self._latest = 0

  @property
  def version(self) -> int:
    with self._cond:
      return self._slots[self._latest][1]

  @contextlib.contextmanager
  def read(self) -> Iterator[tuple[Any, int]]:
    """(params, version) of the newest slot, held (not overwritten) until the block exits."""
    with self._cond:
      i = self._latest
      self._readers[i] += 1
      params, version = self._slots[i]
    try:
      yield params, version
    finally:
      with self._cond:
        self._readers[i] -= 1
        self._cond.notify_all()

  def publish(self, make_params: Callable[[], Any], version: int) -> float:
    """Writes version `version` (`make_params()`, called once the free slot is free: at most
    two copies ever exist) and makes it the newest; returns the seconds spent waiting for a
    reader of the older slot."""
    start = time.perf_counter()
    with self._cond:
      current = self._slots[self._latest][1]
      if version <= current:
        raise ValueError(f"version {version} is not newer than the published {current}")
      target = 1 - self._latest
      while self._readers[target]:
        self._cond.wait()
      self._slots[target] = None  # free it before the copy
    waited = time.perf_counter() - start
    params = make_params()
    with self._cond:
      self._slots[target] = (params, version)
      self._latest = target
      self._cond.notify_all()
    return waited

  def wait_for_version(self, version: int, stop: threading.Event) -> bool:
    """Blocks until the newest version is >= `version`; False if `stop` was set first."""
    with self._cond:
      while self._slots[self._latest][1] < version:
        if stop.is_set():
          return False
        self._cond.wait(timeout=0.05)
    return True


ProduceFn = Callable[[int, Any], tuple[Any, dict[str, Any]]]
DrawFn = Callable[[], tuple[Any, bytes | None]]


class InlineSource:
  """The synchronous loop's source: each `get` draws and samples the next batch on the
  calling thread with the newest weights."""

  def __init__(self, produce: ProduceFn, draw: DrawFn, start: int):
    self._produce, self._draw, self._next = produce, draw, start
    self.restarts = 0

  def start(self) -> None:
    pass

  def queue_depth(self) -> int:
    return 0

  def get(self) -> RolloutBatch:
    prompts, state = self._draw()
    rollouts, metrics = self._produce(self._next, prompts)
    self._next += 1
    return RolloutBatch(self._next - 1, rollouts, metrics, state)

  def stop(self) -> None:
    pass


class RolloutWorker:
  """A thread that samples batches `start`, `start + 1`, ... (< `end`) into a bounded queue.

  produce(index, prompts) -> (rollouts, metrics) samples one batch (reading the weight store
  itself); draw() -> (prompts, iterator state after them) takes the next prompt batch. Batch
  b waits for weights of version >= b - max_staleness. The consumer calls `get` (which also
  restarts a crashed thread) and finally `stop`.
  """

  def __init__(self, produce: ProduceFn, draw: DrawFn, store: WeightStore, *, start: int,
               end: int, max_staleness: int, queue_size: int = 0, max_restarts: int = 3):
    self._produce, self._draw, self._store = produce, draw, store
    self._next, self._end = start, end
    self.max_staleness, self.max_restarts = max_staleness, max_restarts
    self._queue: queue.Queue[RolloutBatch] = queue.Queue(maxsize=queue_size or
                                                         max_staleness + 1)
    self._stop = threading.Event()
    self._pending: tuple[int, Any, bytes | None] | None = None  # drawn, not yet queued
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._failures = 0  # consecutive failures of the pending batch
    self._idle = 0.0
    self.restarts = 0

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)
    self._thread.start()

  def queue_depth(self) -> int:
    return self._queue.qsize()

  def _run(self) -> None:
    try:
      while not self._stop.is_set() and self._next < self._end:
        if self._pending is None:
          prompts, state = self._draw()
          self._pending = (self._next, prompts, state)
        index, prompts, state = self._pending
        t = time.perf_counter()
        ready = self._store.wait_for_version(index - self.max_staleness, self._stop)
        self._idle += time.perf_counter() - t
        if not ready:
          return
        rollouts, metrics = self._produce(index, prompts)
        batch = RolloutBatch(index, rollouts, metrics, state, attempts=self._failures + 1)
        t = time.perf_counter()
        while True:
          if self._stop.is_set():
            return
          try:
            self._queue.put(batch, timeout=0.05)
            break
          except queue.Full:
            continue
        self._idle += time.perf_counter() - t
        batch.idle_s, self._idle = self._idle, 0.0
        self._pending, self._failures = None, 0
        self._next += 1
    except BaseException as e:  # pylint: disable=broad-except  # reported by get()
      self._error = e
      logging.error("rollout worker failed on batch %s:\n%s",
                    self._pending[0] if self._pending else self._next, traceback.format_exc())

  def get(self) -> RolloutBatch:
    """The next batch, in order; restarts the thread after a failure (up to max_restarts
    consecutive failures of one batch, then re-raises its exception)."""
    while True:
      try:
        return self._queue.get(timeout=0.05)
      except queue.Empty:
        pass
      if self._thread is None or self._thread.is_alive():
        continue
      if self._error is None:
        if self._queue.empty():
          raise RuntimeError(f"the rollout worker stopped at batch {self._next} "
                             f"(end {self._end}) with nothing queued")
        continue
      error, self._error = self._error, None
      self._failures += 1
      if self._failures > self.max_restarts:
        raise RuntimeError(f"the rollout worker failed {self._failures} times in a row on "
                           f"batch {self._pending[0] if self._pending else self._next}") from error
      self.restarts += 1
      print(f"[rl] rollout worker failed ({type(error).__name__}: {error}); restart "
            f"{self._failures} of {self.max_restarts}, resuming at batch "
            f"{self._pending[0] if self._pending else self._next}")
      self.start()

  def stop(self, timeout: float = 60.0) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
