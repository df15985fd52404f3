r"""TV-distance kernels: compiled temp memory and forward+backward time against the reference.

  python -m experiments.bench_tv_kernel --vocab_sizes=32768,151936 --rows=128,512 \
      --out=runs/bench_tv_kernel.json

For every (V, N, implementation) it jits d/d draft of mean_rows tv_distance(draft, target)
(value and gradient, i.e. forward + backward), reports the compiled `memory_analysis()` temp
bytes, the median wall time over --repeats runs (the implementations are timed round-robin
so background load hits them alike), and both as ratios to `reference` at the same shape.
Prints a markdown table and writes JSON. Pallas implementations are included by default only
on TPU/GPU backends (they run on CPU only in interpret mode, which is not a benchmark).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

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


def _default_implementations() -> list[str]:
  names = ["reference", "xla_blockwise"]
  backend = jax.default_backend()
  if backend == "tpu":
    names.append("pallas_tpu")
  elif backend in ("gpu", "cuda", "rocm"):
    names.append("pallas_gpu")
  return names


def _compile(implementation: str, draft: jax.Array, target: jax.Array):
  """Compiled value-and-gradient (w.r.t. draft) of the mean TV distance."""

  def mean_tv(d, t):
    return jnp.mean(api.tv_distance(d, t, implementation=implementation,
                                    block_size=_BLOCK.value))

  return jax.jit(jax.value_and_grad(mean_tv)).lower(draft, target).compile()


def _bench_shape(vocab: int, rows: int, implementations: list[str]) -> list[dict]:
  dtype = jnp.dtype(_DTYPE.value)
  key_d, key_t = jax.random.split(jax.random.key(0))
  draft = (3.0 * jax.random.normal(key_d, (rows, vocab))).astype(dtype)
  target = (3.0 * jax.random.normal(key_t, (rows, vocab))).astype(dtype)
  results, compiled = {}, {}
  for name in implementations:
    record = {"vocab": vocab, "rows": rows, "implementation": name, "dtype": dtype.name}
    try:
      start = time.perf_counter()
      compiled[name] = _compile(name, draft, target)
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
  lines = ["| V | N | implementation | temp MiB | time ms | temp / ref | time / ref |",
           "|---:|---:|---|---:|---:|---:|---:|"]
  for r in records:
    if "error" in r:
      lines.append(f"| {r['vocab']} | {r['rows']} | {r['implementation']} | error: "
                   f"{r['error'][:60]} | | | |")
      continue
    ratio = lambda key: f"{r[key]:.3f}" if key in r else "-"
    lines.append(f"| {r['vocab']} | {r['rows']} | {r['implementation']} | "
                 f"{r['temp_bytes'] / 2**20:.1f} | {r['median_s'] * 1e3:.1f} | "
                 f"{ratio('temp_vs_reference')} | {ratio('time_vs_reference')} |")
  return "\n".join(lines)


def main(argv):
  del argv
  implementations = _IMPLS.value or _default_implementations()
  for name in implementations:
    if name not in api.IMPLEMENTATIONS:
      raise ValueError(f"Unknown implementation {name!r}; expected {api.IMPLEMENTATIONS}.")
  records = []
  for vocab in map(int, _VOCAB.value):
    for rows in map(int, _ROWS.value):
      records += _bench_shape(vocab, rows, implementations)
      print(_markdown(records[-len(implementations):]).split("\n", 2)[-1], flush=True)
  table = _markdown(records)
  print(f"\nbackend={jax.default_backend()} devices={jax.device_count()} "
        f"jax={jax.__version__} dtype={_DTYPE.value} block_size={_BLOCK.value} "
        f"repeats={_REPEATS.value}\n\n{table}")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"backend": jax.default_backend(), "jax": jax.__version__,
                 "dtype": _DTYPE.value, "block_size": _BLOCK.value,
                 "repeats": _REPEATS.value, "records": records, "table": table}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
