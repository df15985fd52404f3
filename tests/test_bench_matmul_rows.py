"""experiments/bench_matmul_rows.py: its variants compute the same product (a timing of a
wrong product would bound nothing)."""

import jax.numpy as jnp
import numpy as np

from experiments import bench_matmul_rows


def test_every_variant_computes_the_chain_of_the_plain_product():
  rng = np.random.default_rng(1)
  ws = [jnp.asarray(rng.standard_normal((8, 12), np.float32) / 3) for _ in range(2)]
  ws2 = [jnp.asarray(rng.standard_normal((12, 8), np.float32) / 3) for _ in range(2)]
  wts, wts2 = [w.T.copy() for w in ws], [w.T.copy() for w in ws2]
  x = jnp.asarray(rng.standard_normal((3, 8), np.float32))
  want = x
  for _ in range(2):  # the loop's two passes, written out
    for w, w2 in zip(ws, ws2):
      want = np.tanh(np.asarray(want) @ np.asarray(w)) @ np.asarray(w2)
    want = want * 0.5
  for name, fn in bench_matmul_rows.variants(steps=2).items():
    np.testing.assert_allclose(np.asarray(fn(x, ws, ws2, wts, wts2)), want, rtol=1e-4,
                               atol=1e-5, err_msg=name)
