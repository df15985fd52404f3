"""The drafter's starting point: how the MTP stage initialises the MTP modules.

    params = drafter_init.init_drafter(params, model_cfg, "copy_last_block", seed=0,
                                       proj_init="identity", hidden_rms=rms)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig

INITS = ("sft", "fresh", "copy_last_block")
PROJ_INITS = ("random", "identity")
MTP = nnx.All(nnx.Param, nnx.PathContains("mtp"))  # the drafter's parameters


def init_drafter(params: nnx.State, model_cfg: ModelConfig, how: str, *, seed: int,
                 proj_init: str = "random", hidden_rms: float = 1.0) -> nnx.State:
  """`params` with the MTP modules the stage starts from (`how`, one of INITS):
    sft              as the policy's checkpoint has them (e.g. trained jointly with SFT);
    fresh            a fresh random initialisation;
    copy_last_block  each module's block a copy of the trunk's last layer, input norms 1,
                     the 2E -> E projection by `proj_init`: "random" (normal, std (2E)^-1/2)
                     or "identity" (below).
  "identity" passes both normalised inputs through at the scale of the trunk's residual
  stream, which the copied block was trained on: u_i = hidden_rms * (RMSNorm(h_i) +
  RMSNorm(Emb(x_{i+1}))), `hidden_rms` the RMS of the trunk's h0 on the data. On SmolLM2 it
  did not help (docs/mtp.md#the-drafter-recipe)."""
  if how not in INITS:
    raise ValueError(f"mtp.init={how!r} is not allowed: one of {INITS}")
  if proj_init not in PROJ_INITS:
    raise ValueError(f"mtp.proj_init={proj_init!r} is not allowed: one of {PROJ_INITS}")
  if how == "sft":
    return params
  fresh = nnx.state(policy_lib.Policy(model_cfg, rngs=nnx.Rngs(seed))).filter(MTP)
  if how == "copy_last_block":
    layers = params["layers"]
    m, e = model_cfg.num_mtp_modules, model_cfg.d_model
    for name, var in fresh["mtp"]["blocks"].items():
      last = layers[name][...][-1]
      var.set_value(jnp.broadcast_to(last, (m,) + last.shape).astype(var[...].dtype))
    if proj_init == "identity":
      eye = hidden_rms * jnp.eye(e, dtype=jnp.float32)
      proj = jnp.broadcast_to(jnp.concatenate([eye, eye]), (m, 2 * e, e))
      fresh["mtp"]["proj"].set_value(proj.astype(fresh["mtp"]["proj"][...].dtype))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return with_drafter(params, jax.device_put(fresh, device))


def with_drafter(params: nnx.State, drafter: nnx.State) -> nnx.State:
  """`params` with their MTP modules replaced by those of `drafter` (a state holding them)."""
  return nnx.merge_state(params.filter(nnx.Not(MTP)), drafter.filter(MTP))
