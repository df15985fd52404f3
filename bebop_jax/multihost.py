"""Several JAX processes running one job (JAX's multi-controller runtime): start-up, the
check that they agree, which process writes files, and host data moved between them.

Every process runs the same program over the global mesh of all processes' devices. What
each process does on its own:
  - reads its share of the training data: the SFT and RL streams come in `data.shards`
    shards (0: one per process), each a grain pipeline over its slice of the datasets, and a
    process reads only the shards whose rows its devices hold (`data_shards`); its rows
    become part of a global batch with `jax.make_array_from_process_local_data` (`put_batch`);
  - samples its shards' RL rollouts on its first local device (`local_device`), and learns
    the other processes' rollouts through the coordinator (`gather_objects`).
Evaluations run in process 0 on its first device; the others receive the results
(`on_primary`). Files other than checkpoints are written by process 0 (`is_primary`); checkpoints are
written by every process (orbax: each its shards, process 0 the metadata; grain: each its
iterator's position). With one process every function here is the identity or a no-op, so a
one-process run is unchanged.

Start-up (`initialize`): CPU collectives over gloo, so processes on one machine (or CPU
hosts) can run collectives; a coordinator that does not answer, or processes that never
all arrive, stop the run after a bounded wait with a message naming the coordinator's
address and what to check (JAX itself would abort with DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import pickle
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from absl import logging

# How long a process waits for the others at a rendezvous inside a run (a barrier, a
# gather): long, since process 0 may be preparing data the others need meanwhile.
WAIT_S = 6 * 3600


class DistributedError(RuntimeError):
  """The processes of a run cannot start together or disagree about the run."""


# ----------------------------------------------------------------------------- start-up


def _parse_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise DistributedError(f"--coordinator={address!r} is not HOST:PORT (e.g. "
                           "localhost:12355)")
  return host.strip("[]"), int(port)


def _reachable(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host, port), timeout=1.0):
      return True
  except OSError:
    return False


def _wait_for_coordinator(host: str, port: int, timeout_s: float) -> bool:
  """Whether something accepts connections at host:port within `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while True:
    if _reachable(host, port):
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.2)


def _check_port_free(host: str, port: int, address: str) -> None:
  """Process 0 hosts the coordinator: its port must not be taken."""
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind(("", port))
  except OSError as e:
    raise DistributedError(
        f"process 0 hosts the coordinator at {address}, but port {port} is taken ({e}): "
        "pick a free port and give every process the same --coordinator") from e


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: float = 300) -> None:
  """`jax.distributed.initialize` with CPU collectives over gloo and a bounded wait.

  With `coordinator`, `num_processes` and `process_id` all None, JAX finds them (a TPU pod
  slice, SLURM, or JAX_COORDINATOR_ADDRESS and friends) and nothing else changes; otherwise
  all three are needed.
  Process 0 hosts the coordinator at `coordinator` (HOST:PORT); the others connect to it.

  Raises:
    DistributedError: bad arguments, no coordinator at the address within `timeout_s`
      (processes other than 0), or the coordinator's port taken (process 0). When the
      processes do not all connect within `timeout_s`, the process prints what to check
      and exits with status 2 (JAX's own timeout would abort it).
  """
  given = (coordinator, num_processes, process_id)
  if all(x is None for x in given):
    jax.distributed.initialize()  # the cluster says who is who (TPU pods, SLURM, ...)
    logging.info("jax.distributed: process %d of %d", jax.process_index(),
                 jax.process_count())
    return
  # Before any backend starts: CPU devices of different processes talk over gloo.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if any(x is None for x in given):
    raise DistributedError(
        "a run over several processes needs --coordinator=HOST:PORT, --num_processes=N and "
        f"--process_id=I on every process; got coordinator={coordinator!r}, "
        f"num_processes={num_processes!r}, process_id={process_id!r}")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise DistributedError(f"--process_id={process_id} is not allowed with "
                           f"--num_processes={num_processes}: one of 0..{num_processes - 1}")
  host, port = _parse_address(coordinator)
  who = f"process {process_id} of {num_processes}"
  start = time.monotonic()
  if process_id == 0:
    _check_port_free(host, port, coordinator)
  elif not _wait_for_coordinator(host, port, timeout_s):
    raise DistributedError(
        f"{who}: no coordinator answered at {coordinator} within {timeout_s:g} s. Process 0 "
        f"hosts it: start it with --process_id=0 and the same --coordinator={coordinator} "
        f"--num_processes={num_processes}; check the host name and port, and that nothing "
        "blocks the port (--distributed_timeout sets the wait)")
  left = max(timeout_s - (time.monotonic() - start), 1.0)
  connected = threading.Event()

  def watchdog():
    if connected.wait(left):
      return
    what = ("the other processes did not all connect to it" if process_id == 0 else
            "it answers, but the other processes did not all connect")
    print(f"error: {who}: the run did not start within {timeout_s:g} s: the coordinator is at "
          f"{coordinator} and {what}. Start all {num_processes} processes with "
          f"--coordinator={coordinator} --num_processes={num_processes} and each its own "
          f"--process_id in 0..{num_processes - 1} (--distributed_timeout sets the wait)",
          file=sys.stderr, flush=True)
    os._exit(2)  # pylint: disable=protected-access

  threading.Thread(target=watchdog, daemon=True, name="distributed-watchdog").start()
  # A coordinator on a loopback address listens there only (JAX binds all interfaces).
  loopback = host in ("localhost", "::1") or host.startswith("127.")
  bind = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}") if loopback else None
  # JAX's own deadline lies after the watchdog's: its abort would say less.
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id, coordinator_bind_address=bind,
                             initialization_timeout=int(left) + 30)
  connected.set()
  logging.info("jax.distributed: %s, coordinator %s", who, coordinator)


# ----------------------------------------------------------------------------- who is who


def _initialized() -> bool:
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client is not None


def process_count() -> int:
  """jax.process_count(); 1 without starting a backend when jax.distributed was not
  initialised (file writers call this outside of JAX work too)."""
  return jax.process_count() if _initialized() else 1


def process_index() -> int:
  return jax.process_index() if _initialized() else 0


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0; the process of a one-process
  run)."""
  return process_index() == 0


def local_device() -> jax.Device:
  """The device a process decodes and evaluates on: its first (with one process, the first
  device, as before)."""
  return jax.local_devices()[0]


# ----------------------------------------------------------------------------- the coordinator


def _client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    raise DistributedError("several JAX processes but no distributed client: call "
                           "jax.distributed.initialize first")
  return client


_COUNTER = itertools.count()


def _next_name(tag: str) -> str:
  # Every process makes the same calls in the same order: the n-th call has one name.
  return f"bebop/{tag}/{next(_COUNTER)}"


def barrier(tag: str) -> None:
  """Waits until every process reaches the same barrier (a no-op with one process)."""
  if process_count() == 1:
    return
  _client().wait_at_barrier(_next_name(tag), WAIT_S * 1000)


def gather_objects(obj: Any, tag: str = "gather") -> list[Any]:
  """[every process's `obj`] in process order, through the coordinator's key-value store
  (pickled host data: rollouts, metrics); [obj] with one process."""
  if process_count() == 1:
    return [obj]
  client, name = _client(), _next_name(tag)
  me = process_index()
  client.key_value_set_bytes(f"{name}/{me}", pickle.dumps(obj))
  out = [obj if i == me else pickle.loads(
      client.blocking_key_value_get_bytes(f"{name}/{i}", WAIT_S * 1000))
         for i in range(process_count())]
  client.wait_at_barrier(f"{name}/read", WAIT_S * 1000)  # everyone has read: free the value
  client.key_value_delete(f"{name}/{me}")
  return out


def on_primary(fn: Callable[[], Any], tag: str = "on_primary") -> Any:
  """fn() computed by process 0 alone, its result given to every process (through the
  coordinator): for work whose result every process needs but one can compute on its own
  device (evaluations). fn() itself with one process."""
  if process_count() == 1:
    return fn()
  client, name = _client(), _next_name(tag)
  if is_primary():
    try:
      result = fn()
    except BaseException as e:  # the others would wait for it: tell them, then raise
      client.key_value_set_bytes(name, pickle.dumps((False, f"{type(e).__name__}: {e}")))
      raise
    client.key_value_set_bytes(name, pickle.dumps((True, result)))
  else:
    ok, result = pickle.loads(client.blocking_key_value_get_bytes(name, WAIT_S * 1000))
    if not ok:
      raise DistributedError(f"process 0 failed at {name}: {result}")
  client.wait_at_barrier(f"{name}/read", WAIT_S * 1000)
  if is_primary():
    client.key_value_delete(name)
  return result


def flat_items(tree: Any, prefix: str = "") -> dict[str, str]:
  """{dotted key: repr(value)} of a nested mapping (a config's `to_dict()`)."""
  out = {}
  for key, value in (tree.items() if isinstance(tree, Mapping) else ()):
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flat_items(value, name + "."))
    else:
      out[name] = repr(value)
  return out


def check_same(items: Mapping[str, str], what: str = "config") -> None:
  """Raises DistributedError in every process when the processes' `items` ({key: value as
  text}, e.g. `flat_items(config.to_dict())` and the workdir) differ, naming the keys and
  each process's value. A no-op with one process."""
  if process_count() == 1:
    return
  mine = {str(k): str(v) for k, v in items.items()}
  everyone = gather_objects((hashlib.sha256(json.dumps(mine, sort_keys=True).encode())
                             .hexdigest(), mine), tag=f"check_{what}")
  if len({digest for digest, _ in everyone}) == 1:
    return
  keys = sorted({k for _, d in everyone for k in d
                 if len({d2.get(k, "<missing>") for _, d2 in everyone}) > 1})
  lines = [f"{k}: " + ", ".join(f"process {i} {d.get(k, '<missing>')}"
                                for i, (_, d) in enumerate(everyone)) for k in keys[:8]]
  more = f"\n  ... and {len(keys) - 8} more" if len(keys) > 8 else ""
  raise DistributedError(
      f"the {len(everyone)} processes were started with different {what}s (every process "
      f"must run the same command but --process_id):\n  " + "\n  ".join(lines) + more)


# ----------------------------------------------------------------------------- data


def data_shards(shards: int) -> tuple[int, tuple[int, ...]]:
  """(the number of shards of the data streams, the shards this process reads): `shards`
  (config data.shards; 0: one per process), split evenly over the processes in order.

  Raises:
    DistributedError: when the shards do not split evenly over the processes.
  """
  n, i = process_count(), process_index()
  total = shards or n
  if total % n:
    raise DistributedError(f"data.shards={shards} does not split over {n} processes: use a "
                           f"multiple of {n} (0: one per process)")
  per = total // n
  return total, tuple(range(i * per, (i + 1) * per))


def _check_local_rows(sharding: jax.sharding.Sharding, global_shape: Sequence[int]) -> None:
  """The process's devices must hold its contiguous, equal share of the batch rows."""
  n, i = process_count(), process_index()
  rows = global_shape[0]
  lo, hi = i * rows // n, (i + 1) * rows // n
  for device, index in sharding.devices_indices_map(tuple(global_shape)).items():
    if device.process_index != i:
      continue
    got = index[0]
    start = got.start or 0
    stop = rows if got.stop is None else got.stop
    if start < lo or stop > hi:
      raise DistributedError(
          f"process {i} reads batch rows {lo}..{hi - 1}, but its device {device} holds rows "
          f"{start}..{stop - 1}: with several processes the mesh must lay the batch over "
          "the processes' devices in order (the data axes spanning all processes)")


def put_batch(batch: Mapping[str, np.ndarray],
              shardings: Mapping[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
  """Global batch arrays from this process's rows (`batch`, its share of every global batch
  in process order): `jax.make_array_from_process_local_data`; with one process
  `jax.device_put` of the whole batch, as before."""
  if process_count() == 1:
    return {k: jax.device_put(v, shardings[k]) for k, v in batch.items()}
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    global_shape = (v.shape[0] * process_count(),) + v.shape[1:]
    _check_local_rows(shardings[k], global_shape)
    out[k] = jax.make_array_from_process_local_data(shardings[k], v, global_shape)
  return out


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """`jax.device_put(x, sharding)`; with several processes, a value every process holds
  whole (host data, an array on a local device) placed on a sharding over the processes
  block by block (`jax.make_array_from_callback`: the CPU backend has no cross-process
  transfers)."""
  if (process_count() == 1 or sharding.is_fully_addressable or
      (isinstance(x, jax.Array) and not x.is_fully_addressable)):
    return jax.device_put(x, sharding)
  value = np.asarray(x)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def put_everywhere(batch: Mapping[str, np.ndarray],
                   shardings: Mapping[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
  """Global arrays from host arrays every process holds whole (e.g. a learner batch built
  from gathered rollouts): each process places only the blocks its devices hold
  (`jax.make_array_from_callback`); with one process `jax.device_put`, as before."""
  if process_count() == 1:
    return {k: jax.device_put(v, shardings[k]) for k, v in batch.items()}
  return {k: jax.make_array_from_callback(np.shape(v), shardings[k],
                                          lambda index, v=np.asarray(v): v[index])
          for k, v in batch.items()}


def global_example(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Zeros of a global batch's shapes from one process's rows (what a train step is
  compiled for); `batch` itself with one process."""
  if process_count() == 1:
    return dict(batch)
  return {k: np.zeros((np.shape(v)[0] * process_count(),) + np.shape(v)[1:],
                      np.asarray(v).dtype) for k, v in batch.items()}


# ----------------------------------------------------------------------------- parameters


def to_local(tree: Any, device: jax.Device | None = None) -> Any:
  """`tree`'s arrays whole on one of this process's devices (default `local_device()`), for
  programs a process runs alone (decoding, evaluation). An array replicated over the
  processes is taken from this process's copy; one sharded across them is all-gathered
  (a collective: every process calls this at the same point). With one process `tree` is
  returned as it is."""
  if process_count() == 1:
    return tree
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  device = device or local_device()
  target = jax.sharding.SingleDeviceSharding(device)

  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable:
      return jax.device_put(x, target)
    if x.is_fully_replicated:
      return jax.device_put(x.addressable_shards[0].data, target)
    return jax.device_put(multihost_utils.process_allgather(x, tiled=True), target)

  return jax.tree.map(one, tree)


def local_context():
  """The context for a program one process runs alone (decoding, evaluation) from inside a
  global mesh's context (a training loop's): its first device's mesh, no rules. Nothing
  with one process (its programs run under the global mesh, as before)."""
  if process_count() == 1:
    return contextlib.nullcontext()
  from bebop_jax import sharding  # pylint: disable=g-import-not-at-top
  return sharding.use_mesh(jax.sharding.Mesh(np.asarray([local_device()]), ("data",)), ())


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of `x` as numpy in every process: `np.asarray` with one process or
  an array every process holds whole; an all-gather (a collective) for one sharded across
  the processes."""
  if process_count() == 1 or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def replicated_global(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Arrays of `tree` that live on one process only (host scalars, arrays on a local device)
  as arrays replicated over `mesh`, so a checkpoint holds one copy written once; arrays that
  already span the processes are kept. With one process `tree` as it is."""
  if process_count() == 1:
    return tree
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  return jax.tree.map(lambda x: x if isinstance(x, jax.Array) and not x.is_fully_addressable
                      else put(x, replicated), tree)
