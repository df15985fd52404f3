r"""Fused LM head: compiled temp memory and forward+backward time against the dense reference.

  python -m experiments.bench_fused_head --out=runs/bench_fused_head.json
  python -m experiments.bench_fused_head --rows=512 --vocab=32768 --chunk_sizes=2048,8192

The loss is the MTP-style mean TV + mean CE of K draft rows against one target row each:
  loss = mean(tv(softmax(h_q W), softmax(h_p W))) + mean(-log softmax(h_q W)[x])
with h_q [K, N, d], h_p [N, d], W [d, V], x [K, N]. For every implementation (and, for the
blockwise ones, every chunk size in --chunk_sizes) it compiles the value and the gradient
with respect to h_q and W (forward + backward, the head trains), reports the compiled
`memory_analysis()` temp bytes and the median wall time over --repeats runs (implementations
timed round-robin so background load hits them alike), both also as ratios to `reference`.
Prints a markdown table and writes JSON with every record to --out. Pallas implementations are
included only on TPU / GPU backends (on CPU they run only in interpret mode).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from pallas_kernels.fused_head import api

_VOCAB = flags.DEFINE_integer("vocab", 151936, "Vocabulary size V.")
_ROWS = flags.DEFINE_integer("rows", 2048, "Rows N (tokens) per draft depth.")
_HIDDEN = flags.DEFINE_integer("hidden", 1024, "Hidden size d.")
_DEPTHS = flags.DEFINE_integer("depths", 1, "Draft depths K (all against the same target).")
_IMPLS = flags.DEFINE_list("implementations", None,
                           "Implementations (default: reference, xla_blockwise, and the "
                           "backend's Pallas kernel on TPU/GPU).")
_CHUNKS = flags.DEFINE_list("chunk_sizes", ["default"],
                            "Vocabulary chunk sizes for the blockwise implementations "
                            "('default': the implementation's own).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Dtype of the hidden states and the head.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (median kept).")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def _default_implementations() -> list[str]:
  names = ["reference", "xla_blockwise"]
  backend = jax.default_backend()
  if backend == "tpu":
    names.append("pallas_tpu")
  elif backend in ("gpu", "cuda", "rocm"):
    names.append("pallas_gpu")
  return names


def _inputs(dtype):
  k, n, d, v = _DEPTHS.value, _ROWS.value, _HIDDEN.value, _VOCAB.value
  keys = jax.random.split(jax.random.key(0), 4)
  draft = jax.random.normal(keys[0], (k, n, d)).astype(dtype)
  target = jax.random.normal(keys[1], (n, d)).astype(dtype)
  head = (jax.random.normal(keys[2], (d, v)) * 3.0 / d**0.5).astype(dtype)  # logits ~ N(0, 9)
  tokens = jax.random.randint(keys[3], (k, n), 0, v)
  return draft, head, target, tokens


def _compile(implementation: str, chunk_size: int | None, args):
  """Compiled value-and-gradient (draft hidden states and head) of mean TV + mean CE."""

  def loss(draft, head, target, tokens):
    out = api.fused_head(draft, head, target_hidden=target, tokens=tokens,
                         implementation=implementation, chunk_size=chunk_size)
    return jnp.mean(out["tv"]) + jnp.mean(out["ce"])

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()


def _runs() -> list[tuple[str, int | None]]:
  runs = []
  for name in _IMPLS.value or _default_implementations():
    if name not in api.IMPLEMENTATIONS:
      raise ValueError(f"Unknown implementation {name!r}; expected {api.IMPLEMENTATIONS}.")
    if name == "reference":
      runs.append((name, None))
    else:
      default = importlib.import_module(f"pallas_kernels.fused_head.{name}").DEFAULT_CHUNK_SIZE
      runs += [(name, default if c == "default" else int(c)) for c in _CHUNKS.value]
  return runs


def bench() -> list[dict]:
  dtype = jnp.dtype(_DTYPE.value)
  args = _inputs(dtype)
  shape = dict(vocab=_VOCAB.value, rows=_ROWS.value, hidden=_HIDDEN.value,
               depths=_DEPTHS.value, dtype=dtype.name)
  records, compiled = {}, {}
  for name, chunk in _runs():
    key = (name, chunk)
    record = dict(shape, implementation=name, chunk_size=chunk)
    try:
      start = time.perf_counter()
      compiled[key] = _compile(name, chunk, args)
      record["compile_s"] = time.perf_counter() - start
      record["temp_bytes"] = compiled[key].memory_analysis().temp_size_in_bytes
      jax.block_until_ready(compiled[key](*args))  # warm-up
      record["times_s"] = []
    except Exception as e:  # pylint: disable=broad-except  # e.g. OOM: record, go on
      record["error"] = f"{type(e).__name__}: {e}"[:500]
      compiled.pop(key, None)
    records[key] = record
    print(f"compiled {name} chunk={chunk}: {record.get('temp_bytes', 0) / 2**20:.0f} MiB temp",
          flush=True)
  for _ in range(_REPEATS.value):
    for key, fn in compiled.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      records[key]["times_s"].append(time.perf_counter() - start)
  reference = records.get(("reference", None), {})
  for record in records.values():
    if "times_s" in record:
      record["median_s"] = statistics.median(record["times_s"])
      if "median_s" in reference:
        record["time_vs_reference"] = record["median_s"] / reference["median_s"]
        record["temp_vs_reference"] = record["temp_bytes"] / max(reference["temp_bytes"], 1)
  return list(records.values())


def _markdown(records: list[dict]) -> str:
  lines = ["| V | N | d | K | implementation | chunk | temp MiB | time s | temp / ref | "
           "time / ref |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in records:
    head = (f"| {r['vocab']} | {r['rows']} | {r['hidden']} | {r['depths']} | "
            f"{r['implementation']} | {r['chunk_size'] or '-'} |")
    if "error" in r:
      lines.append(f"{head} error: {r['error'][:60]} | | | |")
      continue
    ratio = lambda key: f"{r[key]:.3f}" if key in r else "-"
    lines.append(f"{head} {r['temp_bytes'] / 2**20:.1f} | {r['median_s']:.3g} | "
                 f"{ratio('temp_vs_reference')} | {ratio('time_vs_reference')} |")
  return "\n".join(lines)


def main(argv):
  del argv
  records = bench()
  table = _markdown(records)
  print(f"\nbackend={jax.default_backend()} jax={jax.__version__} dtype={_DTYPE.value} "
        f"repeats={_REPEATS.value}; loss = mean TV + mean CE, grad wrt draft hidden and head\n\n"
        f"{table}")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"backend": jax.default_backend(), "jax": jax.__version__,
                 "dtype": _DTYPE.value, "repeats": _REPEATS.value, "records": records,
                 "table": table}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
