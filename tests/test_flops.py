"""Model FLOPs counted from the parameters and the definition, and the matmul calibration."""

import time

import jax
import numpy as np
from flax import nnx

from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.train import flops


def test_train_flops_count_matmul_parameters_and_causal_attention():
  cfg = model_config.preset("tiny", tie_embeddings=False)
  _, state = policy_lib.init(cfg)
  params = {jax.tree_util.keystr(p): np.size(x) for p, x in
            jax.tree_util.tree_leaves_with_path(state.filter(nnx.Param))}
  matmul = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
  main = sum(n for k, n in params.items() if "layers" in k and any(f"'{w}'" in k for w in matmul))
  mtp_block = sum(n for k, n in params.items()
                  if "mtp" in k and any(f"'{w}'" in k for w in matmul)) // cfg.num_mtp_modules
  head = params["['head'].value"] if "['head'].value" in params else params["['head']"]
  b, t, k = 3, 20, 2
  tokens = b * t
  # Causal attention: QK^T and PV, 2 FLOPs per multiply-add, over the t(t+1)/2 pairs.
  attn = b * cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2
  main_fwd = 2 * tokens * (main + head) + attn
  mtp_fwd = k * (2 * tokens * (mtp_block + 2 * cfg.d_model * cfg.d_model + head)
                 + attn / cfg.num_layers)
  assert np.isclose(flops.train_flops_per_step(cfg, b, t, k), 3 * main_fwd + 3 * mtp_fwd)
  assert np.isclose(flops.train_flops_per_step(cfg, b, t, k, trainable_main=False),
                    main_fwd + 3 * mtp_fwd)


def test_matmul_calibration_is_measured_once_per_process_and_is_quick():
  flops.matmul_calibration.cache_clear()
  start = time.perf_counter()
  first = flops.matmul_calibration()
  seconds = time.perf_counter() - start
  assert seconds < 2.0, seconds
  assert first > 1e9  # any machine that runs the suite does a GFLOP/s
  assert flops.matmul_calibration() == first  # cached, not re-measured
  u = flops.utilization(2 * first, 4.0)
  assert np.isclose(u["flops_utilization"], 0.5) and u["matmul_flops_per_s"] == first
