r"""TV-distance kernels: compiled temp memory and forward+backward time against the reference.

  python -m experiments.bench_tv_kernel --vocab_sizes=32768,151936 --rows=128,512 \
      --out=runs/bench_tv_kernel.json
  python -m experiments.bench_tv_kernel --mesh=2x4 --num_cpu_devices=8   # sharded

For every (V, N, implementation) it jits d/d draft of mean_rows tv_distance(draft, target)
(value and gradient, i.e. forward + backward), reports the compiled `memory_analysis()` temp
bytes, the median wall time over --repeats runs (the implementations are timed round-robin
so background load hits them alike), and both as ratios to `reference` at the same shape.
Prints a markdown table and writes JSON. Pallas implementations are included by default only
on TPU/GPU backends (they run on CPU only in interpret mode, which is not a benchmark).

--mesh=RxC lays the [N, V] logits out on an R x C device mesh, rows over R and the vocabulary
over C (pallas_kernels/tv_loss/sharded.py): every kernel runs in shard_map on its block, and
`reference` is the dense path as XLA partitions it. Memory is then per device. On CPU,
--num_cpu_devices simulates the devices (the timings of simulated devices share the cores).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.tv_loss import api

_VOCAB = flags.DEFINE_list("vocab_sizes", ["32768", "151936"], "Vocabulary sizes V.")
_ROWS = flags.DEFINE_list("rows", ["128", "512", "2048"],
                          "Row counts N (f32 [2048, 151936] is 1.2 GB per input array).")
_IMPLS = flags.DEFINE_list("implementations", None,
                           "Implementations (default: reference, xla_blockwise, and the "
                           "backend's Pallas kernel on TPU/GPU).")
_BLOCK = flags.DEFINE_integer("block_size", None,
                              "Vocabulary block size (default: each implementation's own).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Logits dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median kept).")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")
_MESH = flags.DEFINE_string("mesh", None, "RxC: rows over R devices, the vocabulary over C "
                            "(default: one device, no mesh).")
_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", None,
                                    "Simulated CPU devices (for --mesh on a CPU host).")


def _default_implementations() -> list[str]:
  names = ["reference", "xla_blockwise"]
  backend = jax.default_backend()
  if backend == "tpu":
    names.append("pallas_tpu")
  elif backend in ("gpu", "cuda", "rocm"):
    names.append("pallas_gpu")
  return names


def make_mesh(arg: str) -> Mesh:
  """The ("rows", "vocab") mesh of --mesh=RxC over the first R * C devices."""
  try:
    rows, cols = (int(x) for x in arg.lower().split("x"))
  except ValueError:
    raise ValueError(f"--mesh={arg!r} is not allowed: RxC with two positive integers, "
                     "e.g. 2x4") from None
  if rows < 1 or cols < 1 or rows * cols > jax.device_count():
    raise ValueError(f"--mesh={arg} needs {rows * cols} devices; {jax.device_count()} are "
                     "available (on CPU, --num_cpu_devices simulates more)")
  devices = jax.devices()[:rows * cols]
  return Mesh(np.asarray(devices, dtype=object).reshape(rows, cols), ("rows", "vocab"))


SPEC = PartitionSpec("rows", "vocab")


def _compile(implementation: str, draft: jax.Array, target: jax.Array, mesh: Mesh | None):
  """Compiled value-and-gradient (w.r.t. draft) of the mean TV distance."""
  sharded = mesh is not None and implementation != "reference"

  def mean_tv(d, t):
    return jnp.mean(api.tv_distance(d, t, implementation=implementation,
                                    block_size=_BLOCK.value, mesh=mesh if sharded else None,
                                    spec=SPEC if sharded else None))

  if mesh is None:
    return jax.jit(jax.value_and_grad(mean_tv)).lower(draft, target).compile()
  sh = NamedSharding(mesh, SPEC)
  return jax.jit(jax.value_and_grad(mean_tv), in_shardings=(sh, sh),
                 out_shardings=(NamedSharding(mesh, PartitionSpec()), sh)).lower(
                     draft, target).compile()


def _bench_shape(vocab: int, rows: int, implementations: list[str],
                 mesh: Mesh | None) -> list[dict]:
  dtype = jnp.dtype(_DTYPE.value)
  key_d, key_t = jax.random.split(jax.random.key(0))
  draft = (3.0 * jax.random.normal(key_d, (rows, vocab))).astype(dtype)
  target = (3.0 * jax.random.normal(key_t, (rows, vocab))).astype(dtype)
  if mesh is not None:
    draft, target = jax.device_put((draft, target), NamedSharding(mesh, SPEC))
  layout = "x".join(map(str, mesh.devices.shape)) if mesh is not None else "1"
  results, compiled = {}, {}
  for name in implementations:
    record = {"vocab": vocab, "rows": rows, "implementation": name, "dtype": dtype.name,
              "mesh": layout}
    try:
      start = time.perf_counter()
      compiled[name] = _compile(name, draft, target, mesh)
      record["compile_s"] = time.perf_counter() - start
      record["temp_bytes"] = compiled[name].memory_analysis().temp_size_in_bytes
      jax.block_until_ready(compiled[name](draft, target))  # warm-up
      record["times_s"] = []
    except Exception as e:  # pylint: disable=broad-except  # e.g. OOM: record, go on
      record["error"] = f"{type(e).__name__}: {e}"[:500]
      compiled.pop(name, None)
    results[name] = record
  for _ in range(_REPEATS.value):
    for name, fn in compiled.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(draft, target))
      results[name]["times_s"].append(time.perf_counter() - start)
  reference = results.get("reference", {})
  for record in results.values():
    if "times_s" in record:
      record["median_s"] = statistics.median(record["times_s"])
      if "median_s" in reference:
        record["time_vs_reference"] = record["median_s"] / reference["median_s"]
        record["temp_vs_reference"] = record["temp_bytes"] / max(reference["temp_bytes"], 1)
  return list(results.values())


def _markdown(records: list[dict]) -> str:
  lines = ["| mesh | V | N | implementation | temp MiB | time ms | temp / ref | time / ref |",
           "|---|---:|---:|---|---:|---:|---:|---:|"]
  for r in records:
    if "error" in r:
      lines.append(f"| {r['mesh']} | {r['vocab']} | {r['rows']} | {r['implementation']} | "
                   f"error: {r['error'][:60]} | | | |")
      continue
    ratio = lambda key: f"{r[key]:.3f}" if key in r else "-"
    lines.append(f"| {r['mesh']} | {r['vocab']} | {r['rows']} | {r['implementation']} | "
                 f"{r['temp_bytes'] / 2**20:.1f} | {r['median_s'] * 1e3:.1f} | "
                 f"{ratio('temp_vs_reference')} | {ratio('time_vs_reference')} |")
  return "\n".join(lines)


def main(argv):
  del argv
  if _CPU_DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  mesh = make_mesh(_MESH.value) if _MESH.value else None
  implementations = _IMPLS.value or _default_implementations()
  for name in implementations:
    if name not in api.IMPLEMENTATIONS:
      raise ValueError(f"Unknown implementation {name!r}; expected {api.IMPLEMENTATIONS}.")
  records = []
  for vocab in map(int, _VOCAB.value):
    for rows in map(int, _ROWS.value):
      records += _bench_shape(vocab, rows, implementations, mesh)
      print(_markdown(records[-len(implementations):]).split("\n", 2)[-1], flush=True)
  table = _markdown(records)
  print(f"\nbackend={jax.default_backend()} devices={jax.device_count()} "
        f"jax={jax.__version__} dtype={_DTYPE.value} block_size={_BLOCK.value} "
        f"repeats={_REPEATS.value} mesh={_MESH.value or 'none'}\n\n{table}")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"backend": jax.default_backend(), "jax": jax.__version__,
                 "dtype": _DTYPE.value, "block_size": _BLOCK.value,
                 "repeats": _REPEATS.value, "mesh": _MESH.value, "records": records,
                 "table": table}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
