r"""What bounds a verification forward on XLA:CPU: the cost of multiplying 1, 4 or 8 rows by
the weights, on SmolLM2-135M's MLP shapes.

  python experiments/bench_matmul_rows.py --out=docs/artifacts/matmul_rows.json

A chain of `--layers` SwiGLU-shaped pairs (d_model 576 -> mlp 1536 -> 576, float32: 212 MB
of weights at 30 layers, read once per pass) runs `--steps` times inside one jitted
`fori_loop`, so dispatch is not counted; each variant's seconds per pass:

  x_at_w         x [T, I] @ w [I, O], as the model multiplies (layers.dense);
  rows           the same product one row at a time (T matrix-vector products);
  out_major_arg  w stored [O, I] and passed in that order, computed as w @ x^T;
  out_major_jit  w passed [I, O] and transposed inside the jitted call, then as above.

One row reads the weights once; a verification forward over K + 1 = 4 tokens is cheap only
if 4 rows cost about as much. Variants are timed interleaved, the median of --rounds kept.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """The command's flags, defined when it runs (tests import the module beside others)."""
  flags.DEFINE_integer("layers", 30, "Layer pairs (SmolLM2-135M has 30 blocks).")
  flags.DEFINE_integer("d_model", 576, "Residual width.")
  flags.DEFINE_integer("mlp_dim", 1536, "MLP width.")
  flags.DEFINE_list("rows", ["1", "4", "8"], "Rows T multiplied per pass.")
  flags.DEFINE_integer("steps", 10, "Passes inside one timed loop.")
  flags.DEFINE_integer("rounds", 7, "Timed loops per variant (median kept).")
  flags.DEFINE_string("out", None, "JSON output path.")


def _loop(x, ws, ws2, matmul, steps):
  def body(_, x):
    for w, w2 in zip(ws, ws2):
      x = matmul(jnp.tanh(matmul(x, w)), w2)
    return x * 0.5
  return jax.lax.fori_loop(0, steps, body, x)


def _x_at_w(x, w):
  return x @ w


def _rows(x, w):
  return jnp.concatenate([x[i:i + 1] @ w for i in range(x.shape[0])], axis=0)


def _out_major(x, wt):
  return jnp.matmul(wt, x.T).T


def variants(steps: int):
  """{name: jitted fn(x, weights [I, O], weights^T [O, I] materialized outside)}."""
  return {
      "x_at_w": jax.jit(lambda x, a, b, at, bt: _loop(x, a, b, _x_at_w, steps)),
      "rows": jax.jit(lambda x, a, b, at, bt: _loop(x, a, b, _rows, steps)),
      "out_major_arg": jax.jit(lambda x, a, b, at, bt: _loop(x, at, bt, _out_major, steps)),
      "out_major_jit": jax.jit(lambda x, a, b, at, bt: _loop(
          x, [w.T for w in a], [w.T for w in b], _out_major, steps)),
  }


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  scale = 1 / np.sqrt(FLAGS.d_model)
  ws = [jnp.asarray(rng.standard_normal((FLAGS.d_model, FLAGS.mlp_dim), np.float32) * scale)
        for _ in range(FLAGS.layers)]
  ws2 = [jnp.asarray(rng.standard_normal((FLAGS.mlp_dim, FLAGS.d_model), np.float32) * scale)
         for _ in range(FLAGS.layers)]
  wts = [jnp.asarray(np.ascontiguousarray(np.asarray(w).T)) for w in ws]
  wts2 = [jnp.asarray(np.ascontiguousarray(np.asarray(w).T)) for w in ws2]
  fns = variants(FLAGS.steps)
  results = {}
  for t in [int(r) for r in FLAGS.rows]:
    x = jnp.ones((t, FLAGS.d_model), jnp.float32)
    # Every variant computes the same product: one pass through one layer pair (the whole
    # chain amplifies rounding differences between summation orders past any tolerance).
    one_layer = {k: np.asarray(fn(x, ws[:1], ws2[:1], wts[:1], wts2[:1]))
                 for k, fn in variants(1).items()}
    for k, out in one_layer.items():
      np.testing.assert_allclose(out, one_layer["x_at_w"], rtol=1e-4, atol=1e-5, err_msg=k)
    times = {k: [] for k in fns}
    for _ in range(FLAGS.rounds):
      for k, fn in fns.items():
        start = time.perf_counter()
        fn(x, ws, ws2, wts, wts2).block_until_ready()
        times[k].append((time.perf_counter() - start) / FLAGS.steps)
    results[t] = {k: float(np.median(v)) for k, v in times.items()}
  one = results[min(results)]["x_at_w"]
  weight_mb = 2 * FLAGS.layers * FLAGS.d_model * FLAGS.mlp_dim * 4 / 1e6
  print(f"{weight_mb:.0f} MB of weights; seconds per pass, and in one-row x_at_w passes:")
  print("| rows | " + " | ".join(fns) + " |")
  print("|---" * (len(fns) + 1) + "|")
  for t, r in results.items():
    print(f"| {t} | " + " | ".join(f"{1e3 * r[k]:.2f} ms ({r[k] / one:.2f})" for k in fns)
          + " |")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"command": "python experiments/bench_matmul_rows.py",
                 "layers": FLAGS.layers, "d_model": FLAGS.d_model, "mlp_dim": FLAGS.mlp_dim,
                 "weight_mb": weight_mb, "steps": FLAGS.steps, "rounds": FLAGS.rounds,
                 "backend": jax.default_backend(), "devices": jax.device_count(),
                 "seconds_per_pass": {str(t): r for t, r in results.items()}}, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
