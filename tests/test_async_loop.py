"""The async RL plumbing on its own (no model): the staleness bound under random delays, the
double-buffered weight store, and a crashing rollout worker that loses and repeats nothing."""

import dataclasses
import random
import threading
import time

import numpy as np
import pytest

from bebop_jax.rl import async_loop


@dataclasses.dataclass
class FakeRollouts:
  versions: np.ndarray
  policy_version: int


class Stream:
  """A prompt stream that counts what it hands out."""

  def __init__(self):
    self.drawn = 0

  def draw(self):
    self.drawn += 1
    return {"prompt_batch": self.drawn - 1}, str(self.drawn).encode()


def _producer(store, rng, *, chunks, delay, faults=None, sampled_ahead=None):
  """produce(index, prompts): `chunks` decoding calls, each under the newest weights (as with
  rl.asynchronous.interrupt), random sleeps; `faults(index, attempt)` may raise."""
  attempts = {}

  def produce(index, prompts):
    assert prompts["prompt_batch"] == index  # the prompts of this batch, drawn once
    attempts[index] = attempts.get(index, 0) + 1
    versions = []
    for c in range(chunks):
      with store.read() as (params, version):
        assert params == {"w": version}
        if sampled_ahead is not None:
          sampled_ahead.append(index - version)
        time.sleep(rng.uniform(0, delay))
        if faults is not None and c == chunks // 2:
          faults(index, attempts[index])
        versions += [version] * 2
    return FakeRollouts(np.array(versions, np.int32), max(versions)), {"rollout_s": 0.0}

  return produce


def _consume(feed, store, steps, eta, rng, delay):
  seen, stale = [], []
  for step in range(steps):
    batch = feed.get()
    stale.append(async_loop.check_batch(batch, step, eta))
    seen.append(batch.index)
    time.sleep(rng.uniform(0, delay))
    store.publish(lambda v=step + 1: {"w": v}, step + 1)
  return seen, np.concatenate(stale)


@pytest.mark.parametrize("eta", [0, 2])
def test_staleness_bound_holds_on_every_batch_under_random_delays(eta):
  """400 steps with random rollout and learner delays: batches arrive in order, each once;
  no row is older than eta, the rollout side never samples more than eta versions ahead,
  and with eta = 2 the bound is reached (the two sides really overlap)."""
  rng = random.Random(eta)
  store = async_loop.WeightStore({"w": 0}, 0)
  stream, ahead = Stream(), []
  steps = 400
  worker = async_loop.RolloutWorker(
      _producer(store, rng, chunks=3, delay=0.0006, sampled_ahead=ahead), stream.draw, store,
      start=0, end=steps, max_staleness=eta)
  worker.start()
  try:
    seen, stale = _consume(worker, store, steps, eta, random.Random(eta + 1), 0.002)
  finally:
    worker.stop()
  assert seen == list(range(steps))
  assert stream.drawn == steps
  assert stale.min() >= 0 and stale.max() <= eta
  assert max(ahead) <= eta and min(ahead) >= 0
  if eta:
    assert stale.max() == eta and np.mean(stale > 0) > 0.3, np.bincount(stale)
  else:
    assert not stale.any()


def test_a_crashing_rollout_worker_loses_and_repeats_no_batch():
  """Random failures mid-batch (about one batch in four, sometimes twice in a row): the
  thread restarts at the failed batch with the prompts drawn for it, every batch reaches the
  learner once and in order, and the bound still holds."""
  rng = random.Random(3)
  fail = random.Random(4)
  store = async_loop.WeightStore({"w": 0}, 0)
  stream, crashes = Stream(), []

  def faults(index, attempt):
    if attempt <= 2 and fail.random() < 0.25:
      crashes.append(index)
      raise RuntimeError(f"injected failure on batch {index}")

  steps = 120
  worker = async_loop.RolloutWorker(_producer(store, rng, chunks=2, delay=0.0005,
                                              faults=faults), stream.draw, store, start=0,
                                    end=steps, max_staleness=2, max_restarts=3)
  worker.start()
  try:
    seen, stale = _consume(worker, store, steps, 2, random.Random(5), 0.001)
  finally:
    worker.stop()
  assert len(crashes) > 10 and worker.restarts == len(crashes)
  assert seen == list(range(steps)) and stream.drawn == steps
  assert stale.max() <= 2


def test_the_worker_gives_up_after_max_restarts_consecutive_failures():
  store = async_loop.WeightStore({"w": 0}, 0)

  def produce(index, prompts):
    raise ValueError("always broken")

  worker = async_loop.RolloutWorker(produce, Stream().draw, store, start=0, end=5,
                                    max_staleness=1, max_restarts=2)
  worker.start()
  with pytest.raises(RuntimeError, match="failed 3 times in a row on batch 0") as info:
    worker.get()
  assert isinstance(info.value.__cause__, ValueError)
  worker.stop()


def test_check_batch_rejects_lost_repeated_and_too_stale_batches():
  batch = lambda index, versions: async_loop.RolloutBatch(
      index, FakeRollouts(np.array(versions), max(versions)), {})
  np.testing.assert_array_equal(async_loop.check_batch(batch(5, [4, 5, 3]), 5, 2), [1, 0, 2])
  with pytest.raises(RuntimeError, match="received rollout batch 4: a batch was repeated"):
    async_loop.check_batch(batch(4, [4]), 5, 2)
  with pytest.raises(RuntimeError, match="received rollout batch 6: a batch was lost"):
    async_loop.check_batch(batch(6, [5]), 5, 2)
  with pytest.raises(RuntimeError, match=r"staleness 0\.\.3 is outside \[0, max_staleness=2\]"):
    async_loop.check_batch(batch(5, [2, 5]), 5, 2)
  with pytest.raises(RuntimeError, match="outside"):
    async_loop.check_batch(batch(5, [6]), 5, 2)  # newer than the learner


def test_staleness_metrics_count_rows():
  m = async_loop.staleness_metrics(np.array([0, 0, 1, 2]), 2)
  assert m == {"staleness_max": 2.0, "staleness_mean": 0.75, "staleness_hist_0": 0.5,
               "staleness_hist_1": 0.25, "staleness_hist_2": 0.25}


def test_weight_store_keeps_two_copies_and_waits_for_the_reader_of_the_old_one():
  """A reader holds version 0; the learner publishes 1 (the free slot) at once, but 2 would
  overwrite version 0's slot, so it waits until the reader lets go; new reads get the
  newest; at no time are more than two versions alive."""
  store = async_loop.WeightStore({"w": 0}, 0)
  made = []
  make = lambda v: (lambda: made.append(v) or {"w": v})
  with store.read() as (params, version):
    assert (params, version) == ({"w": 0}, 0)
    store.publish(make(1), 1)
    with store.read() as (p1, v1):
      assert (p1, v1) == ({"w": 1}, 1)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (store.publish(make(2), 2), done.set()))
    thread.start()
    time.sleep(0.2)
    assert not done.is_set() and made == [1]  # version 2 not even copied yet
    assert params == {"w": 0}  # the reader's copy is intact
  thread.join(5)
  assert done.is_set() and made == [1, 2] and store.version == 2
  with store.read() as (p2, v2):
    assert (p2, v2) == ({"w": 2}, 2)
  with pytest.raises(ValueError, match="not newer"):
    store.publish(make(2), 2)


def test_wait_for_version_returns_when_stopped():
  store = async_loop.WeightStore({}, 0)
  stop = threading.Event()
  threading.Timer(0.1, stop.set).start()
  assert not store.wait_for_version(1, stop)
  assert store.wait_for_version(0, stop)
